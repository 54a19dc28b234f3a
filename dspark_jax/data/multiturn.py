"""Conversations as turns to regenerate, and the records they become.

Each user message of a conversation (with the system or tool messages before it) is the prompt
of one turn; the conversation's own assistant messages are dropped (the target answers instead). Turn k is
generated from the history of earlier turns with the target's *regenerated* answers, as the
reference regenerates every turn. A record is the whole conversation, every regenerated answer
in the loss mask, except the end-of-turn of an answer cut by the length limit (the target never
produced it, so the drafter must not learn to predict it).
"""

from __future__ import annotations

import numpy as np

from dspark_jax.text.chat import END_OF_TURN, assistant_spans, render_text

THINK_END = "</think>"


def turn_prompts(conv) -> list[list[dict]]:
    """The prompts of the turns to generate, in order: each user message closes one (with the
    system or tool messages before it); the chat's own assistant messages are dropped. A
    ``{"turns": [q1, q2]}`` chat (MT-Bench) is two turns, as the reference answers it."""
    turns, cur = [], []
    for j, m in enumerate(conv):
        if m["role"] == "assistant":
            if not turns and not cur:
                raise ValueError("conversation starts with an assistant message: there is no prompt to regenerate from")
            if cur:  # non-user messages the chat's own answer followed (tool results): a turn of their own
                turns.append(cur)
                cur = []
            continue
        cur.append(m)
        if m["role"] == "user":
            turns.append(cur)
            cur = []
    if cur:
        turns.append(cur)
    if not turns:
        raise ValueError("conversation has no message to answer")
    return turns


def history_answer(text: str) -> str:
    """An answer as later turns see it: a reasoning block is dropped (Qwen3's template does the
    same to earlier turns, so the content must match what it renders)."""
    at = text.rfind(THINK_END)
    return text[at + len(THINK_END):].lstrip("\n") if at >= 0 else text


def encode_conversation(tokenizer, messages, template: str | None = None, cut: frozenset[int] = frozenset(),
                        add_generation_prompt: bool = False, **template_kwargs) -> tuple[list[int], list[bool]]:
    """(ids, loss mask) of ``messages`` rendered by ``template``: the assistant contents and their
    end-of-turn masked, except the end-of-turn of the assistant messages whose index is in ``cut``.

    Tokenized segment by segment, so mask edges are token edges (as in ``chat.encode_chat``);
    with ``add_generation_prompt`` the ids end with the assistant header (a generation prompt).
    """
    text = render_text(messages, template, add_generation_prompt, **template_kwargs)
    asst = [j for j, m in enumerate(messages) if m["role"] == "assistant"]
    spans = assistant_spans(text, messages)
    pieces, prev = [], 0
    for j, (start, end) in zip(asst, spans):
        pieces.append((prev, start, False))
        if j in cut:
            pieces += [(start, end - len(END_OF_TURN), True), (end - len(END_OF_TURN), end, False)]
        else:
            pieces.append((start, end, True))
        prev = end
    pieces.append((prev, len(text), False))
    ids, mask = [], []
    for a, b, on in pieces:
        if b > a:
            piece = tokenizer.encode(text[a:b])
            ids += piece
            mask += [on] * len(piece)
    return ids, mask


def left_truncate(ids: list[int], mask: list[bool], max_len: int) -> tuple[list[int], list[bool], bool]:
    """Keep the last ``max_len`` tokens (a long history loses its oldest turns first)."""
    if len(ids) <= max_len:
        return ids, mask, False
    return ids[-max_len:], mask[-max_len:], True


def as_arrays(ids, mask) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(ids, np.int32), np.asarray(mask, bool)
