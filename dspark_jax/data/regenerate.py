"""Regenerate the assistant turns of a prompt set with the target and write the training dataset.

DSpark trains drafters on responses sampled from the target itself (docs/method.md §4), at
the reference's settings by default: temperature 0.7, top-p 0.8, top-k 20. Every assistant
turn of a chat is regenerated in order, each conditioned on the history with the target's
own earlier answers (``data.multiturn``); the chat's own answers are dropped. Prompts are
rendered with the target's chat template (generation header included; ``thinking`` sets
its ``enable_thinking``). Each record is the whole chat: the last turn is
``prompt tokens + generated tokens + template tail`` exactly as generated, with the loss mask
on every regenerated answer (a final stop token included), matching ``encode_chat``.
A response cut by ``max_new_tokens`` gets an unmasked end-of-turn so the record stays
well formed. Prompts longer than ``max_prompt_len`` keep their last tokens.

Sample i uses the key ``fold_in(key(seed), i)`` (turn k > 0 its own stream) and every batch
has the same static shape (fixed batch size, prompt length and cache length; the last batch
is padded with rows that generate nothing), so a resumed run (``resume=True`` continues after
the ``len(writer)`` records already stored) neither duplicates nor loses samples and writes
the same records as an uninterrupted one.

Through a server instead (``--server URL``): ``data.regen_server`` sends the same turns to any
OpenAI-compatible chat endpoint (vLLM, SGLang, ``python -m dspark_jax serve``).

The command: ``python -m dspark_jax regenerate`` (commands/regenerate.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from pathlib import Path

import jax
import numpy as np

from dspark_jax.console import progress_bar
from dspark_jax.data.corpora import build_corpus
from dspark_jax.data.dataset import DatasetWriter, recorded_info
from dspark_jax.data.multiturn import (
    encode_conversation,
    history_answer,
    left_truncate,
    turn_prompts,
)
from dspark_jax.data.regen_defaults import DEFAULT_SAMPLING
from dspark_jax.decoding.params import SamplingParams
from dspark_jax.io.hf import LoadedTarget, load_target
from dspark_jax.target.generation import generate
from dspark_jax.text.chat import END_OF_TURN, render_text

_SETTINGS_KEYS = ("seed", "temperature", "top_k", "top_p", "max_new_tokens", "max_prompt_len", "target_config_sha256",
                  "thinking")
_TURN_STREAM = 1 << 20  # turn k > 0 of a chat draws from fold_in(key(seed), _TURN_STREAM + k)

log = logging.getLogger(__name__)


def prompt_messages(conv) -> list[dict]:
    """Messages before the first assistant message (the whole conversation if it has none)."""
    out = []
    for m in conv:
        if m["role"] == "assistant":
            break
        out.append(m)
    if not out:
        raise ValueError("conversation starts with an assistant message: there is no prompt to regenerate from")
    return out


def template_tail(template: str | None) -> str:
    """Text a chat template puts after an assistant message's end-of-turn token (ChatML: newline)."""
    mark = "\x00DSPARK\x00"
    text = render_text([{"role": "user", "content": "q"}, {"role": "assistant", "content": mark}], template)
    at = text.find(mark + END_OF_TURN)
    return "" if at < 0 else text[at + len(mark) + len(END_OF_TURN):]


def distinct_ngram_ratio(seqs, n: int = 4) -> float:
    """Distinct n-grams / all n-grams, pooled over ``seqs`` (1.0 = no repetition at all)."""
    grams, total = set(), 0
    for s in seqs:
        s = [int(t) for t in s]
        for i in range(len(s) - n + 1):
            grams.add(tuple(s[i:i + n]))
            total += 1
    return len(grams) / total if total else 1.0


def as_loaded(target, dtype: str = "float32", mesh=None) -> LoadedTarget:
    """A target directory read (onto `mesh`), or an already loaded target as it is."""
    if isinstance(target, LoadedTarget):
        return target
    return load_target(target, dtype=dtype, mesh=mesh)


def regenerate(target, conversations, out_dir, *, num: int | None = None, batch_size: int = 16,
               max_new_tokens: int = 128, max_prompt_len: int = 128,
               sampling: SamplingParams = DEFAULT_SAMPLING, seed: int = 0, resume: bool = False,
               overwrite: bool = False, progress: bool = True, on_record=None, verbose: bool = True,
               dtype: str = "float32", mesh=None, thinking: bool | None = None) -> dict:
    """Write ``num`` regenerated records to ``out_dir`` (a ``DatasetWriter`` dataset); returns stats.

    ``target``: a directory or a ``LoadedTarget``. With a
    ``mesh`` the target is read onto it and each batch's rows (and KV cache) are split over
    data x fsdp, KV heads over tensor.
    ``on_record(i, tokens, loss_mask)`` is called after each record is stored.
    ``thinking``: the chat template's ``enable_thinking`` (None: off, as ``chat.render_text``).
    """
    lt = as_loaded(target, dtype, mesh)
    on_mesh = contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)
    tok = lt.require_tokenizer()
    template = lt.chat_template
    n_avail = len(conversations)
    num = n_avail if num is None else int(num)
    if not 0 <= num <= n_avail:
        raise ValueError(f"num={num} but only {n_avail} prompts are available: "
                         f"pass --num-prompts <= {n_avail} or more prompts")
    if batch_size < 1 or max_new_tokens < 1 or max_prompt_len < 1:
        raise ValueError("batch_size, max_new_tokens and max_prompt_len must be >= 1")
    ctx = lt.cfg.max_position_embeddings
    if max_prompt_len + max_new_tokens > ctx and verbose:
        log.warning(f"max_prompt_len + max_new_tokens = {max_prompt_len + max_new_tokens} exceeds "
                    f"the target's max_position_embeddings ({ctx})")
    out_dir = Path(out_dir)
    cfg_file = Path(lt.path) / "config.json"
    settings = {"seed": int(seed), "temperature": float(sampling.temperature), "top_k": int(sampling.top_k),
                "top_p": float(sampling.top_p), "max_new_tokens": int(max_new_tokens),
                "max_prompt_len": int(max_prompt_len),
                "target_config_sha256": (hashlib.sha256(cfg_file.read_bytes()).hexdigest() if cfg_file.is_file()
                                         else None),
                "target": str(lt.path), "thinking": bool(thinking)}
    template_kwargs = {} if thinking is None else {"enable_thinking": bool(thinking)}
    if resume:
        old = recorded_info(out_dir, "regenerate")
        if old is not None:
            missing = [k for k in _SETTINGS_KEYS if k not in old]
            if missing:
                raise ValueError(f"cannot resume {out_dir}: its meta.json records no {missing} (an older dataset); "
                                 "rerun with --overwrite")
            diff = [k for k in _SETTINGS_KEYS if old[k] != settings[k]]
            if diff:
                raise ValueError(f"cannot resume {out_dir}: settings {diff} differ from the interrupted run "
                                 f"({ {k: old.get(k) for k in diff} }); rerun with the same settings or --overwrite")
    stop_ids = tok.stop_ids
    tail = tok.encode(template_tail(template))
    sp = SamplingParams(*(np.float32(sampling.temperature), np.int32(sampling.top_k), np.float32(sampling.top_p)))
    stats = {"records": 0, "turns": 0, "generated_tokens": 0, "truncated_prompts": 0, "stopped": 0, "seconds": 0.0}

    with DatasetWriter(out_dir, resume=resume, overwrite=overwrite, vocab_size=tok.vocab_size,
                       tokenizer_hash=tok.fingerprint, info={"regenerate": settings}) as writer:
        start = len(writer)
        bar = progress_bar(total=num, initial=min(start, num), desc="regenerate", enabled=progress,
                                    unit="sample")
        t0 = time.time()
        for b0 in range(start, num, batch_size):
            idx = list(range(b0, min(b0 + batch_size, num)))
            turns = [turn_prompts(conversations[i]) for i in idx]
            history = [[] for _ in idx]  # messages so far, with the regenerated answers
            cut = [set() for _ in idx]  # history indices of answers cut by max_new_tokens
            records = [None] * len(idx)
            for k in range(max(len(t) for t in turns)):
                prompts = np.full((batch_size, max_prompt_len), tok.pad_id, np.int32)
                lens = np.ones((batch_size,), np.int32)
                max_new = np.zeros((batch_size,), np.int32)  # padding rows and finished chats generate nothing
                rows, plist = [r for r in range(len(idx)) if k < len(turns[r])], {}
                for r in rows:
                    msgs = history[r] + turns[r][k]
                    ids, pmask = encode_conversation(tok, msgs, template, frozenset(cut[r]), True, **template_kwargs)
                    ids, pmask, truncated = left_truncate(ids, pmask, max_prompt_len)
                    stats["truncated_prompts"] += int(truncated)
                    prompts[r, :len(ids)] = ids
                    lens[r] = len(ids)
                    max_new[r] = max_new_tokens
                    plist[r] = (msgs, ids, pmask)
                sample_index = np.concatenate([idx, np.full(batch_size - len(idx), idx[0])]).astype(np.int64)
                # turn 0 draws exactly as single-turn regeneration always did; turn k its own streams
                key = seed if k == 0 else jax.random.fold_in(jax.random.key(seed), _TURN_STREAM + k)
                with on_mesh:
                    out = generate(lt.model, prompts, lens, max_new_tokens=max_new_tokens, sampling=sp, seed=key,
                                   sample_index=sample_index, max_new=max_new, stop_ids=stop_ids, pad_id=tok.pad_id)
                    toks, glen = jax.device_get((out.tokens, out.lengths))
                for r in rows:
                    msgs, ids, pmask = plist[r]
                    gen = [int(t) for t in toks[r, :glen[r]]]
                    ended = bool(gen) and gen[-1] in stop_ids
                    stats["generated_tokens"] += len(gen)
                    stats["turns"] += 1
                    if k < len(turns[r]) - 1:
                        text = tok.decode(gen[:-1] if ended else gen)
                        history[r] = msgs + [{"role": "assistant", "content": history_answer(text)}]
                        if not ended:
                            cut[r].add(len(history[r]) - 1)
                        continue
                    rest = tail if ended else [tok.eos_id] + tail
                    records[r] = (np.asarray(ids + gen + rest, np.int32),
                                  np.asarray(pmask + [True] * len(gen) + [False] * len(rest), bool))
                    stats["stopped"] += int(ended)
            for r, i in enumerate(idx):
                record, mask = records[r]
                writer.add(record, mask)
                stats["records"] += 1
                if on_record is not None:
                    on_record(i, record, mask)
            bar.update(len(idx))
            el = time.time() - t0
            bar.set_postfix(tok_s=f"{stats['generated_tokens'] / max(el, 1e-9):.0f}")
        bar.close()
        stats["seconds"] = time.time() - t0
    stats["tokens_per_s"] = stats["generated_tokens"] / max(stats["seconds"], 1e-9)
    stats["total_records"] = num
    if verbose:
        log.info(f"{stats['records']} records ({stats['generated_tokens']} tokens, "
                 f"{stats['stopped']} ended by a stop token) in {stats['seconds']:.1f} s: "
                 f"{stats['tokens_per_s']:.1f} tokens/s (first batch includes compilation) -> {out_dir}")
    return stats


def default_prompts(seed: int = 0) -> list:
    """Prompts of the embedded corpora's train split (the target's own training prompts)."""
    return build_corpus("train", seed, n_code=1000, n_math=1000, n_prose=1000)
