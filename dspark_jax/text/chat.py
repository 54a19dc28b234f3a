"""Chat-template rendering to token ids with an assistant-token loss mask.

The drafter must see exactly the token stream the target sees at inference, so we
render with the target's own Jinja chat template when one is given (sandboxed, with
the helpers HF templates expect) and fall back to an embedded ChatML template.

Loss mask: the full conversation is rendered once; each assistant message's content
(followed by the turn terminator ``<|im_end|>``) is located in the rendered text in
message order, and the text is tokenized segment by segment (non-assistant / assistant
span / ...). Tokenizing per segment puts token boundaries exactly at the span edges, as
at inference (the prompt ending in the role header is tokenized before generation), so
the mask covers exactly the assistant content tokens plus ``<|im_end|>`` and never
the role header (nor template-injected text such as Qwen3's empty think block).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import numpy as np
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
END_OF_TURN = "<|im_end|>"


def _raise_exception(message):
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


_TEMPLATE_CACHE: dict[str, object] = {}


def _compile(template: str):
    t = _TEMPLATE_CACHE.get(template)
    if t is None:
        # Same environment settings as transformers' apply_chat_template.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        t = _TEMPLATE_CACHE[template] = env.from_string(template)
    return t


def load_chat_template(model_dir) -> str | None:
    """The target's template from chat_template.jinja or tokenizer_config.json, else None."""
    d = Path(model_dir)
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text(encoding="utf-8")
    cfg = d / "tokenizer_config.json"
    if cfg.is_file():
        t = json.loads(cfg.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(t, list):  # [{"name": "default", "template": ...}, ...]
            named = {e.get("name"): e.get("template") for e in t if isinstance(e, dict)}
            t = named.get("default") or next(iter(named.values()), None)
        if isinstance(t, str):
            return t
    return None


def render_text(messages, template: str | None = None, add_generation_prompt: bool = False,
                **template_kwargs) -> str:
    """Render ``messages`` to text. Qwen3 templates get ``enable_thinking=False`` by default."""
    template_kwargs.setdefault("enable_thinking", False)
    template_kwargs.setdefault("bos_token", "")
    template_kwargs.setdefault("eos_token", END_OF_TURN)
    return _compile(template or CHATML_TEMPLATE).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt, **template_kwargs)


def assistant_spans(text: str, messages, end_token: str = END_OF_TURN) -> list[tuple[int, int]]:
    """Char spans [start, end) of each assistant message's content + ``end_token`` in ``text``.

    Searches ``content + end_token`` left to right so role headers (which are never
    followed directly by the terminator) cannot match. Templates may strip leading
    newlines of the content (Qwen3), so we search the lstripped content.
    """
    cursor, spans = 0, []
    for j, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, str):
            continue
        needle = content.lstrip("\n") + end_token
        pos = text.find(needle, cursor)
        if pos < 0:
            if m["role"] == "assistant":
                raise ValueError(f"assistant message {j} not found verbatim (followed by {end_token!r}) "
                                 f"in the rendered chat template output")
            continue
        cursor = pos + len(needle)
        if m["role"] == "assistant":
            spans.append((pos, cursor))
    return spans


def encode_chat(tokenizer, messages, template: str | None = None, max_len: int | None = None,
                **template_kwargs) -> tuple[np.ndarray, np.ndarray]:
    """Render a full conversation -> (ids int32[T], loss_mask bool[T]); truncated to ``max_len``."""
    text = render_text(messages, template, add_generation_prompt=False, **template_kwargs)
    ids, mask, prev = [], [], 0
    for start, end in assistant_spans(text, messages) + [(len(text), len(text))]:
        for a, b, on in ((prev, start, False), (start, end, True)):
            if b > a:
                piece = tokenizer.encode(text[a:b])
                ids.extend(piece)
                mask.extend([on] * len(piece))
        prev = end
    ids_a, mask_a = np.asarray(ids, np.int32), np.asarray(mask, np.bool_)
    if max_len is not None:
        ids_a, mask_a = ids_a[:max_len], mask_a[:max_len]
    return ids_a, mask_a


def render_prompt(tokenizer, messages, template: str | None = None, add_generation_prompt: bool = True,
                  **template_kwargs) -> list[int]:
    """Token ids of a generation prompt (conversation + assistant header)."""
    return tokenizer.encode(render_text(messages, template, add_generation_prompt, **template_kwargs))
