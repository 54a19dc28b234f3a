"""One request's values checked against an engine's ranges before it reaches the device: the
prompt (length, vocabulary), its token budget, stop ids, sampling settings and seed, each as the
traced controls hold them (int32 / float32). `Engine.validate_request` is the one entry point;
`Engine.generate` and the server both go through it."""

from __future__ import annotations

import numbers
import operator
from typing import NamedTuple

import numpy as np

from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.engine.errors import EngineError, InvalidRequest, PoolTooSmall

__all__ = ["MAX_STOP_IDS", "INT32_MAX", "Limits", "Checked", "check_request", "engine_sampling", "stop_row",
           "per_request", "reach"]

MAX_STOP_IDS = 8  # stop ids per request: one fixed-width row of the controls
INT32_MAX = 2 ** 31 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)


class Limits(NamedTuple):
    """What an engine takes: prompt lengths, vocabulary, context, and its page pool (None: dense KV)."""

    min_prompt: int  # the drafter kind's shortest prompt (1 for target-only)
    room: int  # tokens a request's prompt and answer may hold: max_len - gamma - 2
    vocab_size: int
    max_len: int
    G: int  # draft tokens a round may write past the committed ones
    mode: str  # "ar" or the drafter kind, for messages
    pages: object  # the PageAllocator, or None


class Checked(NamedTuple):
    prompt: list[int]
    max_new: int
    sampling: SamplingParams
    stop_ids: tuple[int, ...]
    seed: int


def reach(prompt_len: int, max_new: int, G: int, max_len: int) -> int:
    """Positions a request's rounds may write: its prompt, max_new tokens and a last round's G
    drafts, within max_len (what admission reserves pages for)."""
    return min(int(prompt_len) + int(max_new) + int(G), int(max_len))


def _token(x) -> int | None:
    """An integer scalar of any array library as an int (bools and floats are not token ids)."""
    if isinstance(x, (bool, np.bool_)):
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


def _integer(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def engine_sampling(temperature, top_k, top_p, vocab_size: int) -> SamplingParams:
    """Sampling settings as the engine's controls hold them (float32, int32, float32): finite,
    in range, top_k clamped to the vocabulary (k >= V and k <= 0 both mean off)."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) \
            or not (0 <= temperature <= FLOAT32_MAX):
        raise InvalidRequest(f"temperature must be a finite number >= 0, got {temperature!r}", "temperature")
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not (0 < top_p <= 1):
        raise InvalidRequest(f"top_p must be in (0, 1], got {top_p!r}", "top_p")
    if not _integer(top_k) or top_k < -1:
        raise InvalidRequest(f"top_k must be an integer >= -1, got {top_k!r}", "top_k")
    return SamplingParams(float(np.float32(temperature)), int(min(max(int(top_k), 0), vocab_size)),
                          float(np.float32(top_p)))


def check_request(lim: Limits, prompt, max_new, *, sampling=None, stop_ids=(), seed=0, fit_context=False,
                  prompt_name="the prompt", names=None) -> Checked:
    """-> the request normalised, or InvalidRequest naming the field (`names` maps "prompt",
    "max_new", "stop", "seed" to the caller's names for them). `fit_context`: the prompt and all
    of max_new must fit the context (else generation may end early with reason "context")."""
    names = {"prompt": "prompt", "max_new": "max_new", "stop": "stop", "seed": "seed", **(names or {})}
    p = None if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__len__") else [_token(x) for x in prompt]
    if p is None or None in p:
        raise InvalidRequest(f"{prompt_name} must be a list of token ids", names["prompt"])
    n = len(p)
    if n < lim.min_prompt:
        raise InvalidRequest(f"{prompt_name} has {n} tokens; {lim.mode} needs at least {lim.min_prompt}",
                             names["prompt"])
    if fit_context and n > lim.room - 1:
        raise InvalidRequest(f"{prompt_name} has {n} tokens; the context holds {lim.room} (prompt + at least one "
                             "new token): shorten it", names["prompt"])
    if n > lim.room:
        raise InvalidRequest(f"{prompt_name} has {n} tokens, longer than the maximum context allows (max_len "
                             f"{lim.max_len} - gamma {lim.G} - 2 = {lim.room}): shorten it or build the Engine with a "
                             "larger max_len",
                             names["prompt"])
    if min(p) < 0 or max(p) >= lim.vocab_size:
        raise InvalidRequest(f"{prompt_name} has token ids outside the vocabulary 0..{lim.vocab_size - 1}",
                             names["prompt"])
    budget = names["max_new"]
    if _token(max_new) is None or not 1 <= _token(max_new) <= INT32_MAX:
        raise InvalidRequest(f"{budget} must be an integer >= 1, got {max_new!r}", budget)
    max_new = _token(max_new)
    if fit_context and n + max_new > lim.room:
        raise InvalidRequest(f"{budget} {max_new} + the {n} prompt tokens exceed the context of {lim.room} tokens: "
                             f"ask for at most {lim.room - n}", budget)
    if lim.pages is not None:
        need = lim.pages.pages_for(reach(n, max_new, lim.G, lim.max_len))
        if need > lim.pages.num_pages:
            fit = lim.pages.num_pages * lim.pages.page_size - n - lim.G
            raise PoolTooSmall(f"{budget} {max_new} + the {n} prompt tokens may hold {need} KV pages of "
                               f"{lim.pages.page_size} tokens, more than the whole pool of {lim.pages.num_pages}: ask "
                               f"for at most {max(fit, 0)}, or give the page pool more pages (kv_pages=(num_pages, "
                               "page_size); --kv-pages NUM,SIZE on the command line)", budget)
    stops = tuple(_token(x) for x in stop_ids)
    if len(stops) > MAX_STOP_IDS or not all(x is not None and 0 <= x < lim.vocab_size for x in stops):
        raise InvalidRequest(f"at most {MAX_STOP_IDS} stop ids in the vocabulary 0..{lim.vocab_size - 1}, got "
                             f"{list(stop_ids)[:MAX_STOP_IDS + 1]}", names["stop"])
    if _token(seed) is None:
        raise InvalidRequest(f"the seed must be an integer, got {seed!r}", names["seed"])
    s = sampling or SamplingParams()
    return Checked(p, max_new, engine_sampling(*s, lim.vocab_size), stops, _token(seed))


def stop_row(stop_ids) -> np.ndarray:
    """Stop ids -> one fixed-width row (-1 = none), so changing them never recompiles."""
    stops = [int(x) for x in stop_ids]
    if len(stops) > MAX_STOP_IDS:
        raise EngineError(f"at most {MAX_STOP_IDS} stop ids, got {len(stops)}")
    return np.asarray(stops + [-1] * (MAX_STOP_IDS - len(stops)), np.int32)


def per_request(value, n: int, what: str) -> list:
    """One value for every request, or a list with one per request."""
    if isinstance(value, (list, tuple)) and not isinstance(value, SamplingParams) and \
            (what != "stop_ids" or (value and isinstance(value[0], (list, tuple)))):
        if len(value) != n:
            raise EngineError(f"{what}: {len(value)} values for {n} prompts; give one, or one per prompt")
        return list(value)
    return [value] * n
