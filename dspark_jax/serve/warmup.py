"""The engine loop's warm-up: before the server answers /health "ok", compile every program the
first requests would need, by serving throwaway requests through the loop's own turns (so the
programs compiled are exactly the ones serving uses): one prefill per prompt-length bucket from
an idle engine, the round, and with chunked prefill a join beside a running request. Under a
skip rule each round program is compiled first (`Engine.compile_rounds`): which of them the
throwaway requests reach is the rule's choice."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.engine.batcher import Batcher, warmup_lengths
from dspark_jax.serve.request import Request

MAX_TURNS = 10_000  # per wave of warm-up requests: a bound, never reached in practice


def _warm_request(n: int, max_new: int = 2) -> Request:
    return Request([1] * n, max_new, SamplingParams(0.0, 0, 1.0), (), seed=0)


def warm_up(engine, batcher: Batcher, iterate: Callable[[collections.deque], None], stop: threading.Event) -> None:
    """Compile what the first requests would: each prefill bucket from an idle engine (R prompts
    a wave), the round, and (with chunked prefill) a join beside a running request. `iterate`
    is the loop's turn over a queue of pending requests; `stop` ends the warm-up early."""
    engine.compile_rounds(batcher.control)
    lens, min_len = warmup_lengths(engine), engine.min_prompt_len
    for i in range(0, len(lens), engine.R):
        _drain(batcher, iterate, stop, collections.deque(_warm_request(n) for n in lens[i: i + engine.R]))
    if engine.prefill_chunk and engine.R > 1:
        pending = collections.deque([_warm_request(min_len, 4)])
        iterate(pending)
        pending.append(_warm_request(min_len))
        _drain(batcher, iterate, stop, pending)


def _drain(batcher: Batcher, iterate, stop: threading.Event, pending: collections.deque) -> None:
    """Turns until `pending` is served and every slot is free (or nothing more can join)."""
    for _ in range(MAX_TURNS):
        if stop.is_set():
            break
        busy = batcher.busy
        if not busy and pending and not _admit_possible(batcher, pending):
            break
        if not busy and not pending:
            break
        iterate(pending)


def _admit_possible(batcher: Batcher, pending: collections.deque) -> bool:
    try:
        return batcher.can_admit(pending[0])
    except Exception:  # noqa: BLE001  (too large for the page pool: not warmed)
        pending.clear()
        return False
