"""Continuous batching with arrivals: one thread owns the device and the engine's decode state.

Requests wait in a bounded queue; between rounds the engine's Batcher (engine/batcher.py) moves
them into free slots, runs one compiled round for all slots, and hands back each request's newly
committed tokens, which go to the request's callbacks. A request leaves when it finishes (stop /
length / context), when a stop string appears in its text, or when it is cancelled (client gone):
its slot and pages are freed before the next round. With paged KV a request joins only when the
pool can hold everything it may write (its reach: prompt + max_tokens + one round's drafts)
beside what running requests were promised; otherwise it waits at the head of the queue. Nothing
here knows about HTTP (serve/handler.py does), and nothing here touches the engine's decode state
(the Batcher owns it).

Isolation: `submit` checks every value against the engine's ranges (int32 / float32 controls,
the vocabulary, the context) before the request reaches this thread. An error raised while
serving one request (its callbacks, its stop-string check, its join) ends that request with
reason "error" and the others go on. An error of the engine itself (a round, or a join that
consumed the decode state) fails the requests in flight and the loop starts from a fresh
state; when that keeps failing the loop stops, `error` says why and `on_fatal` is called.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.engine.batcher import Batcher, Round, Update
from dspark_jax.serve.request import EngineFailure, InvalidRequest, QueueFull, Request, intact
from dspark_jax.serve.warmup import warm_up

__all__ = ["EngineLoop", "Request", "QueueFull", "InvalidRequest", "EngineFailure"]

log = logging.getLogger(__name__)

ENGINE_FAILURES = 3  # consecutive failed rounds (each from a fresh state) before the loop gives up


class EngineLoop:
    """Owns an `Engine` and its Batcher on one thread; `submit` from any thread.

    `warmup`: before serving, compile every program the first requests would (one prefill per
    prompt-length bucket, the round, a join beside a running request); `ready` is set after.
    `on_fatal()`: called from the loop thread when the engine cannot continue."""

    def __init__(self, engine, *, max_queue: int = 64, metrics=None, threshold: float = 0.0, sts=None, table=None,
                 warmup: bool = False, on_fatal: Callable[[], None] | None = None):
        self.engine = engine
        self.max_queue = int(max_queue)
        self.metrics = metrics
        self.on_fatal = on_fatal
        self.vocab_size = int(engine.target.cfg.vocab_size)
        self._waiting: collections.deque[Request] = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.ready = threading.Event()
        self._warmup = warmup
        self._control_args = dict(threshold=threshold, sts=sts, table=table)
        # an engine that measures its own cost table does so on the loop thread, before its
        # warm-up (/health says "starting" meanwhile; without warm-up, for the first request);
        # any other builds its controls now, so that a bad setting fails here
        measures = table is None and engine.measures_own_table
        self._control = None if measures else engine.control(SamplingParams(), **self._control_args)
        self._table_updates = -1  # the live table's updates /metrics shows
        self._batcher: Batcher | None = None  # made on the loop thread (it owns the decode state)
        self._joining: list[Request] = []  # taken from the queue, being started
        self._thread = threading.Thread(target=self._run, name="dspark-engine-loop", daemon=True)
        self.error: BaseException | None = None
        self.failed_requests = 0
        self.rounds = 0  # rounds completed
        self.warmup_seconds: float | None = None
        self.costs_seconds = 0.0  # spent taking the engine's own cost table (measured or read back)

    # ---------------------------------------------------------------- any thread
    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def check(self, req: Request) -> Request:
        """Normalise `req` to the engine's ranges in place, or raise InvalidRequest."""
        ok = self.engine.validate_request(req.prompt, req.max_new, sampling=req.sampling, stop_ids=req.stop_ids,
                                          seed=req.seed, fit_context=True)
        req.prompt, req.sampling, req.stop_ids = ok.prompt, ok.sampling, ok.stop_ids
        return req

    def submit(self, req: Request) -> Request:
        """Queue `req` (checked first: InvalidRequest), or QueueFull; after a fatal engine error or
        `stop`, RuntimeError."""
        self.check(req)
        with self._lock:  # checked under the lock the loop's last drain takes: nothing is queued after it
            if self.error is not None:
                raise RuntimeError(f"the engine stopped: {self.error!r}")
            if self._stop.is_set():
                raise RuntimeError("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting (the bound is {self.max_queue})")
            self._waiting.append(req)
        self._wake.set()
        return req

    def cancel(self, req: Request) -> None:
        req.cancelled = True
        self._wake.set()

    def stop(self, timeout: float = 30.0) -> None:
        """Finish: every waiting and running request ends with reason "cancelled"."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def control(self):
        """The traced controls the rounds run with (STS temperatures, cost table, per-slot rows);
        before an engine that measures its own table has done so, its settings with the table
        that prices nothing yet."""
        if self._batcher is not None:
            return self._batcher.control
        if self._control is None:
            return self.engine.control(SamplingParams(), **{**self._control_args, "table": self.engine.unpriced_table})
        return self._control

    @property
    def slots_in_use(self) -> int:
        return 0 if self._batcher is None else len(self._batcher.jobs)

    # ---------------------------------------------------------------- loop thread
    def _run(self):
        failures = 0
        try:
            if self._control is None and not self._warmup:  # the table is taken for the first request
                self.ready.set()
                while not (self._waiting or self._stop.is_set()):
                    self._stop.wait(0.02)
                if self._stop.is_set():
                    return
            if self._control is None:
                t0 = time.perf_counter()
                self._control = self.engine.control(SamplingParams(), **self._control_args)
                self.costs_seconds = time.perf_counter() - t0
            self._batcher = Batcher(self.engine, self._control, stream=True)
            if self._warmup:
                t0 = time.perf_counter()
                self._warm()
                self.warmup_seconds = time.perf_counter() - t0
                log.info("engine warm in %.1f s", self.warmup_seconds)
            self.ready.set()
            while not self._stop.is_set():
                rounds = self.rounds
                try:
                    self._iterate(self._waiting)
                    if self.rounds > rounds:
                        failures = 0
                except Exception as e:  # the engine itself: fail what is in flight, start again from a fresh state
                    failures += 1
                    log.exception("engine round failed (%d in a row)", failures)
                    self._fail_in_flight(e)
                    if failures >= ENGINE_FAILURES:
                        raise
        except BaseException as e:
            self.error = e
            log.critical("the engine loop stopped: %r", e)
            if self.on_fatal is not None:
                try:
                    self.on_fatal()
                except Exception:
                    log.exception("on_fatal failed")
            if not isinstance(e, Exception):
                raise
        finally:
            self.ready.set()
            reason = "cancelled" if self.error is None else "error"
            running = [] if self._batcher is None else self._batcher.jobs
            for r in self._joining + running:
                self._end(r, reason, self.error)
            self._joining = []
            with self._lock:
                rest, self._waiting = list(self._waiting), collections.deque()
            for r in rest:
                self._end(r, reason, self.error)

    def _iterate(self, pending):
        """One turn: drop cancelled requests, admit from `pending`, run a round if any slot is busy."""
        self._purge(pending)
        self._drop_cancelled()
        self._admit(pending)
        if not self._batcher.busy:
            self._wake.wait(0.05)
            self._wake.clear()
            return
        self._collect(self._batcher.round())

    # ---------------------------------------------------------------- ending requests
    def _end(self, req: Request, reason: str, exc: BaseException | None = None) -> None:
        if reason == "error":
            req.error = req.error or (f"{type(exc).__name__}: {exc}" if exc is not None else "engine error")
            self.failed_requests += 1
            if self.metrics is not None:
                self.metrics.loop_errors.inc()
        try:
            req.on_finish(reason)
        except Exception:  # the caller's callback; nothing else to tell it
            log.exception("on_finish of request %s failed", req.id)

    def _fail_in_flight(self, exc: BaseException) -> None:
        """The decode state is suspect: every request in flight fails, the batcher starts afresh."""
        for r in self._joining + self._batcher.reset():
            self._end(r, "error", exc)
        self._joining = []

    def _purge(self, pending) -> None:
        with self._lock:  # `submit` appends from other threads: no iteration without the lock
            if not any(r.cancelled for r in pending):
                return
            gone = [r for r in pending if r.cancelled]
            keep = [r for r in pending if not r.cancelled]
            pending.clear()
            pending.extend(keep)
        for r in gone:
            self._end(r, "cancelled")

    def _drop_cancelled(self) -> None:
        for req in [r for r in self._batcher.jobs if r.cancelled]:
            self._batcher.cancel(req)
            self._end(req, "cancelled")

    # ---------------------------------------------------------------- joining
    def _admit(self, pending):
        b = self._batcher
        taken, refused = b.admit(pending)
        for req, e in refused:  # larger than the whole page pool: this request alone
            self._end(req, "error", e)
        if not taken:
            return
        self._joining = [r for _, r in taken]
        try:
            b.join(taken)
        except Exception as e:
            if not intact(b.state):
                raise EngineFailure(f"a join consumed the decode state: {e!r}") from e
            log.warning("a join of %d requests failed (%r); joining them one at a time", len(taken), e)
            for s, req in taken:
                try:  # from clean slots: pages a failed join may have grown go back first
                    b.give_back([s])
                    b.reserve(s, req)
                    b.join([(s, req)])
                except Exception as e1:
                    if not intact(b.state):
                        raise EngineFailure(f"a join consumed the decode state: {e1!r}") from e1
                    self._end(req, "error", e1)
                    b.give_back([s])
        self._joining = []

    # ---------------------------------------------------------------- after a round
    def _collect(self, rnd: Round) -> None:
        self.rounds += 1
        b = self._batcher
        if self.metrics is not None and self.ready.is_set():  # slots still forwarding their prompt decoded nothing
            self.metrics.round(rnd.seconds, rnd.accepted, rnd.lengths,
                               [i >= 0 and bool(rnd.decoded[s]) for s, i in enumerate(rnd.ids)], self.engine.G,
                               rnd.drafted)
            if b.live is not None and b.live.updates != self._table_updates:
                self.metrics.cost_table(b.live)
                self._table_updates = b.live.updates
        for u in rnd.updates:
            try:
                reason = self._advance(u.job, u.slot, u)
            except Exception as e:  # this request's own path (its callback, its stop check): it alone ends
                log.exception("request %s failed", u.job.id)
                b.cancel(u.job, "error")
                self._end(u.job, "error", e)
                continue
            if reason is not None:
                if u.reason is None:  # ended here (a stop string): its slot is freed now
                    b.cancel(u.job, reason)
                self._end(u.job, reason)

    def _advance(self, req: Request, s: int, u: Update) -> str | None:
        """Hand `req` the tokens of this round (cut at a stop string) -> why it ended, or None."""
        new, reason = u.new, u.reason
        if new:
            if req.first_token_s is None:
                req.first_token_s = time.perf_counter() - req.arrived
                if self.metrics is not None and self.ready.is_set():
                    self.metrics.first_token(req.first_token_s)
            before = req.tokens[: len(req.tokens) - len(new)]
            keep = req.stop_text(req.tokens) if req.stop_text is not None else None
            if keep is not None:  # a stop string: keep what precedes it, end the request
                req.tokens = before + req.tokens[len(before): keep]
                new = req.tokens[len(before):]
                reason = "stop"
            req.on_tokens(new)
        return reason

    def _warm(self):
        """Compile what the first requests would (serve/warmup.py)."""
        warm_up(self.engine, self._batcher, self._iterate, self._stop)
