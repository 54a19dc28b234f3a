"""A request body -> what the engine loop takes: prompt ids, token budget, sampling settings in the
engine's ranges, the request's random key. Runs on a worker thread (parsing and tokenizing a
large body must not stall the event loop); the prompt's size is bounded before any work that
grows with it: the number of messages before they are validated, the conversation's size
(contents plus what the chat template adds per message) before it is rendered, the rendered
text before it is tokenized."""

from __future__ import annotations

import functools
import json
import secrets
from dataclasses import dataclass

import jax
import numpy as np

from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.engine.errors import InvalidRequest
from dspark_jax.serve.body import parse_json
from dspark_jax.serve.errors import BadRequest
from dspark_jax.serve.schema import validate
from dspark_jax.text.chat import render_text

_TEMPLATE_OWNED = {"messages", "add_generation_prompt", "tokenizer", "template"}


@dataclass
class Prepared:
    ids: list[int]
    max_new: int
    sampling: SamplingParams
    stop: list[str]
    seed: int | None  # as asked; None: `key` is from a fresh random seed
    key: np.ndarray  # jax.random.key_data of the request's random key
    stream: bool
    include_usage: bool


def seed_key(seed: int) -> np.ndarray:
    """The random key of `seed` taken as 64 bits (two's complement: each signed 64-bit seed gets
    its own key): key(seed) for 0 <= seed < 2^32, as the engine's own seeds; otherwise the high
    32 bits folded into key(low 32 bits)."""
    seed %= 1 << 64
    lo, hi = seed & 0xFFFFFFFF, seed >> 32
    key = jax.random.key(lo)
    if hi:
        key = jax.random.fold_in(key, hi)
    return np.asarray(jax.random.key_data(key))


def fresh_seed() -> int:
    """A seed from the operating system's random source (for requests that name none)."""
    return secrets.randbits(64)


def _encode(tok, text: str, field: str) -> list[int]:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (JSON allows "\ud800"): not text a tokenizer takes
        raise BadRequest(f"the {field} is not valid Unicode (it holds a lone surrogate)", field) from None
    return tok.encode(text)


def _chars(n: int, limit: int, what: str) -> None:
    if n > limit:
        raise BadRequest(f"the {what} has {n} characters; this server takes at most {limit} (--max-prompt-chars)",
                         what if what != "rendered conversation" else "messages")


def _count_messages(body, limit: int) -> None:
    """The number of messages, checked before each is validated (a 4 MB body holds 127 000 of them)."""
    msgs = body.get("messages") if isinstance(body, dict) else None
    if isinstance(msgs, list) and len(msgs) > limit:
        raise BadRequest(f"'messages' has {len(msgs)} messages; this server takes at most {limit} (--max-messages)",
                         "messages")


@functools.lru_cache(maxsize=8)
def message_chars(template: str | None) -> int:
    """The fewest characters `template` adds for one more message (user or assistant, empty
    content), measured once by rendering; 0 when it cannot be measured (the template refuses
    these short conversations). A lower bound: a conversation of n messages renders to at least
    its contents' length + n times this."""
    convo = [{"role": r, "content": ""} for r in ("user", "assistant", "user")]
    try:
        sizes = [len(render_text(convo[:n], template)) for n in (1, 2, 3)]
    except Exception:  # noqa: BLE001  (a template that raises on these shapes: no estimate)
        return 0
    return max(min(sizes[1] - sizes[0], sizes[2] - sizes[1]), 0)


def _chat_ids(served, req) -> list[int]:
    limit = served.limits.max_prompt_chars
    content = sum(len(m.content or "") for m in req.messages)
    _chars(content, limit, "messages")
    least = content + len(req.messages) * message_chars(served.chat_template)
    if least > limit:  # refused before rendering
        raise BadRequest(f"the {len(req.messages)} messages render to at least {least} characters with the chat "
                         f"template; this server takes at most {limit} (--max-prompt-chars)", "messages")
    kwargs = req.chat_template_kwargs or {}
    if not all(k.isidentifier() for k in kwargs) or _TEMPLATE_OWNED & set(kwargs):
        raise BadRequest("'chat_template_kwargs' must be an object of template variables (not "
                         f"{', '.join(sorted(_TEMPLATE_OWNED))})", "chat_template_kwargs")
    msgs = [{"role": "system" if m.role == "developer" else m.role, "content": m.content or ""} for m in req.messages]
    try:
        text = render_text(msgs, served.chat_template, add_generation_prompt=True, **kwargs)
    except Exception as e:  # noqa: BLE001  (the model's template may refuse an order of roles, a variable, ...)
        raise BadRequest(f"the chat template could not render these messages: {str(e)[:300]}", "messages") from None
    _chars(len(text), limit, "rendered conversation")
    return _encode(served.tokenizer, text, "messages")


def _representable(req, sampling: SamplingParams) -> None:
    """A top_p in (0, 1] that the engine's float32 controls round to 0 (5e-324) is refused here,
    with the value as sent: the engine would refuse the rounded value ("got 0.0")."""
    if req.top_p is not None and not sampling.top_p > 0:
        least = float(np.finfo(np.float32).smallest_subnormal)
        raise BadRequest(f"top_p must be in (0, 1], got {req.top_p!r}, which the engine's float32 settings round to 0 "
                         f"(the least they hold is {least:.3g})", "top_p")


def prepare(served, raw: bytes, chat: bool) -> Prepared:
    """-> Prepared, or BadRequest naming the field."""
    body = parse_json(raw, served.limits.max_json_depth)
    if chat:
        _count_messages(body, served.limits.max_messages)
    req = validate(body, chat)
    if req.model != served.model:
        raise BadRequest(f"model {json.dumps(req.model)[:80]} is not served here; this server serves "
                         f"'{served.model}' (GET /v1/models)", "model")
    eng = served.loop.engine
    room = eng.room
    tok = served.tokenizer
    field = "messages" if chat else "prompt"
    if chat:
        ids = _chat_ids(served, req)
    elif isinstance(req.prompt, str):
        _chars(len(req.prompt), served.limits.max_prompt_chars, "prompt")
        ids = _encode(tok, req.prompt, "prompt")
    else:
        ids = req.prompt
        vocab = min(tok.vocab_size, served.loop.vocab_size)
        if len(ids) <= room and (min(ids) < 0 or max(ids) >= vocab):
            raise BadRequest(f"'prompt' token ids must be in 0..{vocab - 1}", "prompt")
    name = "max_completion_tokens" if chat and req.max_completion_tokens is not None else "max_tokens"
    max_tokens = getattr(req, name)
    if max_tokens is None:
        max_tokens = max(min(512, room - len(ids)), 1) if chat else 16
    sampling = SamplingParams(1.0 if req.temperature is None else req.temperature,
                              0 if req.top_k is None else req.top_k, 1.0 if req.top_p is None else req.top_p)
    try:  # the engine's ranges, named as this API names its fields
        ok = eng.validate_request(ids, max_tokens, sampling=sampling, fit_context=True, prompt_name=f"the {field}",
                                  names={"prompt": field, "max_new": name})
    except InvalidRequest as e:
        raise BadRequest(str(e), e.param) from None
    _representable(req, ok.sampling)
    key = seed_key(fresh_seed() if req.seed is None else req.seed)
    return Prepared(ids=ok.prompt, max_new=ok.max_new, sampling=ok.sampling, stop=req.stop, seed=req.seed, key=key,
                    stream=bool(req.stream),
                    include_usage=bool(req.stream_options and req.stream_options.include_usage))
