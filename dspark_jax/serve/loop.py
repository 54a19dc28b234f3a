"""Continuous batching with arrivals: one thread owns the device and the engine's decode state.

Requests wait in a bounded queue; between rounds the loop moves them into free slots (one
prefill per prompt-length bucket), writes their sampling settings and stop ids into the slot
rows of the traced controls, runs one compiled round for all slots, and hands each request the
tokens its slot committed. A request leaves when it finishes (stop / length / context), when a
stop string appears in its text, or when it is cancelled (client gone): its slot is freed at
once. With paged KV a request joins only when the pool can hold everything it may write (its
reach: prompt + max_tokens + one round's drafts) beside what running requests were promised;
otherwise it waits at the head of the queue. Nothing here knows about HTTP (serve/app.py does).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.engine.state import FINISH_REASONS

_ids = itertools.count()


class QueueFull(Exception):
    """The waiting queue is at its bound: the caller should retry later (HTTP 429)."""


@dataclass
class Request:
    """One generation. `on_tokens(new_ids)` and `on_finish(reason)` are called from the loop thread."""

    prompt: list[int]
    max_new: int
    sampling: SamplingParams
    stop_ids: tuple[int, ...] = ()
    seed: int = 0
    stop_text: Callable[[list[int]], int | None] | None = None  # tokens -> how many to keep, if a stop string hit
    on_tokens: Callable[[list[int]], None] = lambda ids: None
    on_finish: Callable[[str], None] = lambda reason: None
    id: int = field(default_factory=lambda: next(_ids))
    tokens: list[int] = field(default_factory=list)
    cancelled: bool = False
    arrived: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    rounds: int = 0
    accepted: int = 0


class EngineLoop:
    """Owns an `Engine` and its state on one thread; `submit` from any thread."""

    def __init__(self, engine, *, max_queue: int = 64, metrics=None, threshold: float = 0.0, sts=None, table=None):
        self.engine = engine
        self.max_queue = int(max_queue)
        self.metrics = metrics
        self._waiting: queue.Queue[Request] = queue.Queue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._slots: list[Request | None] = [None] * engine.R
        self._next: Request | None = None  # taken from the queue, waiting for pages (it keeps its place)
        self._ctl = engine.control(SamplingParams(), threshold=threshold, sts=sts, table=table)
        self._thread = threading.Thread(target=self._run, name="dspark-engine-loop", daemon=True)
        self.error: BaseException | None = None

    # ---------------------------------------------------------------- any thread
    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def submit(self, req: Request) -> Request:
        if self._waiting.qsize() >= self.max_queue:
            raise QueueFull(f"{self._waiting.qsize()} requests are waiting (the bound is {self.max_queue})")
        self._waiting.put(req)
        self._wake.set()
        return req

    def cancel(self, req: Request) -> None:
        req.cancelled = True
        self._wake.set()

    def stop(self, timeout: float = 30.0) -> None:
        """Finish: every waiting and running request ends with reason "cancelled"."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    @property
    def queue_depth(self) -> int:
        return self._waiting.qsize() + (self._next is not None)

    @property
    def slots_in_use(self) -> int:
        return sum(r is not None for r in self._slots)

    # ---------------------------------------------------------------- loop thread
    def _run(self):
        eng = self.engine
        st = eng.init_state()
        try:
            while not self._stop.is_set():
                st = self._drop_cancelled(st)
                st = self._admit(st)
                if not any(r is not None for r in self._slots):
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                t0 = time.perf_counter()
                st, ro = eng.step(st, self._ctl)
                st = self._collect(st, ro, t0)
        except BaseException as e:  # the server reports it on /health and fails new requests
            self.error = e
            raise
        finally:
            for s, r in enumerate(self._slots):
                if r is not None:
                    self._slots[s] = None
                    r.on_finish("cancelled")
            if self._next is not None:
                self._next, nxt = None, self._next
                nxt.on_finish("cancelled")
            while not self._waiting.empty():
                self._waiting.get_nowait().on_finish("cancelled")

    def _free(self, st, slots):
        if not slots:
            return st
        idx = jnp.asarray(slots, jnp.int32)
        for s in slots:
            self._slots[s] = None
        st = self.engine.release(st, slots)  # paged KV: pages and reservation back to the pool
        return st._replace(active=st.active.at[idx].set(False))

    def _drop_cancelled(self, st):
        gone = [s for s, r in enumerate(self._slots) if r is not None and r.cancelled]
        for s in gone:
            self._slots[s].on_finish("cancelled")
        return self._free(st, gone)

    def _admit(self, st):
        eng = self.engine
        free = [s for s, r in enumerate(self._slots) if r is None]
        taken: list[tuple[int, Request]] = []
        while free and (self._next is not None or not self._waiting.empty()):
            req, self._next = (self._next, None) if self._next is not None else (self._waiting.get_nowait(), None)
            if req.cancelled:
                req.on_finish("cancelled")
                continue
            if not eng.reserve(free[0], len(req.prompt), req.max_new):
                self._next = req  # paged KV: waits, first in line, until running requests give pages back
                break
            taken.append((free.pop(0), req))
        if not taken:
            return st
        reqs = [r for _, r in taken]
        keys = np.stack([np.asarray(jax.random.key_data(jax.random.key(int(r.seed) % (1 << 32)))) for r in reqs])
        st, self._ctl = eng.start(st, self._ctl, [s for s, _ in taken], [r.prompt for r in reqs], keys,
                                  [r.max_new for r in reqs], [r.sampling for r in reqs], [r.stop_ids for r in reqs])
        for s, req in taken:
            self._slots[s] = req
        return st

    def _collect(self, st, ro, t0):
        n_gen, active, finish, out, acc, lengths, decoded = jax.device_get(
            (st.n_gen, st.active, st.finish, st.out, ro.accepted, ro.lengths, ro.active))
        now = time.perf_counter()
        if self.metrics is not None:  # slots still forwarding their prompt in chunks decoded nothing
            self.metrics.round(now - t0, acc, lengths, [r is not None and bool(decoded[s])
                                                        for s, r in enumerate(self._slots)], self.engine.G)
        ended = []
        for s, req in enumerate(self._slots):
            if req is None:
                continue
            req.rounds += int(decoded[s])
            req.accepted += int(acc[s])
            new = out[s, len(req.tokens): n_gen[s]].tolist()
            reason = None if active[s] else FINISH_REASONS[int(finish[s])]
            if new:
                if req.first_token_s is None:
                    req.first_token_s = now - req.arrived
                    if self.metrics is not None:
                        self.metrics.first_token(req.first_token_s)
                keep = req.stop_text(req.tokens + new) if req.stop_text is not None else None
                if keep is not None:  # a stop string: keep what precedes it, end the request
                    new = (req.tokens + new)[:keep][len(req.tokens):]
                    reason = "stop"
                req.tokens += new
                req.on_tokens(new)
            if reason is not None:
                ended.append(s)
                req.on_finish(reason)
        return self._free(st, ended) if ended else st
