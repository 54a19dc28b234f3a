"""What the engine loop takes and how it refuses: one generation (`Request`, a Batcher job with
the callbacks that hand its tokens out), a full queue (`QueueFull`), a decode state that is gone
(`EngineFailure`). Nothing here knows about HTTP."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import jax

from dspark_jax.engine.batcher import Job
from dspark_jax.engine.errors import InvalidRequest

__all__ = ["Request", "QueueFull", "InvalidRequest", "EngineFailure", "intact"]


class QueueFull(Exception):
    """The waiting queue is at its bound: the caller should retry later (HTTP 429)."""


@dataclass
class Request(Job):
    """One generation. `on_tokens(new_ids)` and `on_finish(reason)` are called from the loop thread;
    reason "error" comes with `error` set."""

    stop_text: Callable[[list[int]], int | None] | None = None  # tokens -> how many to keep, if a stop string hit
    on_tokens: Callable[[list[int]], None] = lambda ids: None
    on_finish: Callable[[str], None] = lambda reason: None
    cancelled: bool = False
    error: str | None = None
    arrived: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None


class EngineFailure(RuntimeError):
    """The decode state is gone (a compiled call consumed it and raised)."""


def intact(st) -> bool:
    """Whether no array of the decode state `st` was consumed (a failed compiled call may donate it)."""
    return not any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(st))
