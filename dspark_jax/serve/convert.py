"""A request body -> what the engine loop takes: prompt ids, token budget, sampling settings in the
engine's ranges. Runs on a worker thread (parsing and tokenizing a large body must not stall
the event loop); the prompt's size is bounded in characters before it is tokenized."""

from __future__ import annotations

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


def _chat_ids(served, req) -> list[int]:

    limit = served.limits.max_prompt_chars
    _chars(sum(len(m.content or "") for m in req.messages), limit, "messages")
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


def prepare(served, raw: bytes, chat: bool) -> Prepared:
    """-> Prepared, or BadRequest naming the field."""
    req = validate(parse_json(raw, served.limits.max_json_depth), chat)
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
    key = seed_key(fresh_seed() if req.seed is None else req.seed)
    return Prepared(ids=ok.prompt, max_new=ok.max_new, sampling=ok.sampling, stop=req.stop, seed=req.seed, key=key,
                    stream=bool(req.stream),
                    include_usage=bool(req.stream_options and req.stream_options.include_usage))
