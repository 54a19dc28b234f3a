"""Continuous batching with arrivals: one thread owns the device and the engine's decode state.

Requests wait in a bounded queue; between rounds the loop moves them into free slots (one
prefill per prompt-length bucket), writes their sampling settings and stop ids into the slot
rows of the traced controls, runs one compiled round for all slots, and hands each request the
tokens its slot committed. A request leaves when it finishes (stop / length / context), when a
stop string appears in its text, or when it is cancelled (client gone): its slot is freed
before the next round. With paged KV a request joins only when the pool can hold everything it
may write (its reach: prompt + max_tokens + one round's drafts) beside what running requests
were promised; otherwise it waits at the head of the queue. Nothing here knows about HTTP
(serve/app.py does).

Isolation: `submit` checks every value against the engine's ranges (int32 / float32 controls,
the vocabulary, the context) before the request reaches this thread. An error raised while
serving one request (its callbacks, its stop-string check, its join) ends that request with
reason "error" and the others go on. An error of the engine itself (a round, or a join that
consumed the decode state) fails the requests in flight and the loop starts from a fresh
state; when that keeps failing the loop stops, `error` says why and `on_fatal` is called.
"""

from __future__ import annotations

import collections
import itertools
import logging
import numbers
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.engine.engine import MAX_STOP_IDS
from dspark_jax.engine.state import FINISH_REASONS

log = logging.getLogger(__name__)

_ids = itertools.count()
INT32_MAX = 2 ** 31 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)
ENGINE_FAILURES = 3  # consecutive failed rounds (each from a fresh state) before the loop gives up


class QueueFull(Exception):
    """The waiting queue is at its bound: the caller should retry later (HTTP 429)."""


class InvalidRequest(ValueError):
    """A request outside the engine's ranges (HTTP 400); `param` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def engine_sampling(temperature, top_k, top_p, vocab_size: int) -> SamplingParams:
    """Sampling settings as the engine's controls hold them (float32, int32, float32): finite,
    in range, top_k clamped to the vocabulary (k >= V and k <= 0 both mean off)."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) \
            or not (0 <= temperature <= FLOAT32_MAX):
        raise InvalidRequest(f"temperature must be a finite number >= 0, got {temperature!r}", "temperature")
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not (0 < top_p <= 1):
        raise InvalidRequest(f"top_p must be in (0, 1], got {top_p!r}", "top_p")
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < -1:
        raise InvalidRequest(f"top_k must be an integer >= -1, got {top_k!r}", "top_k")
    return SamplingParams(float(np.float32(temperature)), int(min(max(int(top_k), 0), vocab_size)),
                          float(np.float32(top_p)))


@dataclass
class Request:
    """One generation. `on_tokens(new_ids)` and `on_finish(reason)` are called from the loop thread;
    reason "error" comes with `error` set."""

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
    error: str | None = None
    arrived: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None
    rounds: int = 0
    accepted: int = 0


class EngineFailure(RuntimeError):
    """The decode state is gone (a compiled call consumed it and raised)."""


def _intact(st) -> bool:
    return not any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(st))


class EngineLoop:
    """Owns an `Engine` and its state on one thread; `submit` from any thread.

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
        self._slots: list[Request | None] = [None] * engine.R
        self._joining: list[Request] = []  # taken from the queue, being started
        self._ctl = engine.control(SamplingParams(), threshold=threshold, sts=sts, table=table)
        self._thread = threading.Thread(target=self._run, name="dspark-engine-loop", daemon=True)
        self.error: BaseException | None = None
        self.failed_requests = 0
        self.rounds = 0  # rounds completed
        self.warmup_seconds: float | None = None

    # ---------------------------------------------------------------- any thread
    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def check(self, req: Request) -> Request:
        """Normalise `req` to the engine's ranges in place, or raise InvalidRequest."""
        eng = self.engine
        min_len = 1 if eng.kind is None else eng.kind.min_prompt_len
        limit = eng.S - eng.G - 2
        p = req.prompt
        if not isinstance(p, (list, tuple)) or not all(type(x) is int for x in p):
            raise InvalidRequest("the prompt must be a list of token ids", "prompt")
        if not min_len <= len(p) <= limit:
            raise InvalidRequest(f"the prompt has {len(p)} tokens; this engine takes {min_len}..{limit}", "prompt")
        if min(p) < 0 or max(p) >= self.vocab_size:
            raise InvalidRequest(f"prompt token ids must be in 0..{self.vocab_size - 1}", "prompt")
        if type(req.max_new) is not int or not 1 <= req.max_new <= eng.S:
            raise InvalidRequest(f"max_new must be in 1..{eng.S}, got {req.max_new!r}", "max_tokens")
        if len(req.stop_ids) > MAX_STOP_IDS or not all(type(x) is int and 0 <= x < self.vocab_size
                                                       for x in req.stop_ids):
            raise InvalidRequest(f"at most {MAX_STOP_IDS} stop ids in the vocabulary", "stop")
        if isinstance(req.seed, bool) or not isinstance(req.seed, int):
            raise InvalidRequest(f"the seed must be an integer, got {req.seed!r}", "seed")
        req.prompt = list(p)
        req.sampling = engine_sampling(*req.sampling, self.vocab_size)
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
    def slots_in_use(self) -> int:
        return sum(r is not None for r in self._slots)

    # ---------------------------------------------------------------- loop thread
    def _run(self):
        eng = self.engine
        failures = 0
        try:
            st = eng.init_state()
            if self._warmup:
                t0 = time.perf_counter()
                st = self._warm(st)
                self.warmup_seconds = time.perf_counter() - t0
                log.info("engine warm in %.1f s", self.warmup_seconds)
            self.ready.set()
            while not self._stop.is_set():
                rounds = self.rounds
                try:
                    st = self._iterate(st, self._waiting)
                    if self.rounds > rounds:
                        failures = 0
                except Exception as e:  # the engine itself: fail what is in flight, start again from a fresh state
                    failures += 1
                    log.exception("engine round failed (%d in a row)", failures)
                    self._fail_in_flight(e)
                    if failures >= ENGINE_FAILURES:
                        raise
                    st = eng.init_state()
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
            for r in self._joining + [r for r in self._slots if r is not None]:
                self._end(r, reason, self.error)
            self._slots = [None] * len(self._slots)
            self._joining = []
            with self._lock:
                rest, self._waiting = list(self._waiting), collections.deque()
            for r in rest:
                self._end(r, reason, self.error)

    def _iterate(self, st, pending):
        """One turn: drop cancelled requests, admit from `pending`, run a round if any slot is busy."""
        self._purge(pending)
        st = self._drop_cancelled(st)
        st = self._admit(st, pending)
        if not any(r is not None for r in self._slots):
            self._wake.wait(0.05)
            self._wake.clear()
            return st
        t0 = time.perf_counter()
        st, ro = self.engine.step(st, self._ctl)
        return self._collect(st, ro, t0)

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
        for r in self._joining + [r for r in self._slots if r is not None]:
            self._end(r, "error", exc)
        self._slots = [None] * len(self._slots)
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

    def _free(self, st, slots):
        if not slots:
            return st
        for s in slots:
            self._slots[s] = None
        st = self.engine.release(st, slots)  # paged KV: pages and reservation back to the pool
        keep = np.ones((self.engine.R,), bool)
        keep[list(slots)] = False  # a fixed-shape mask: one compiled op for any number of slots
        return st._replace(active=st.active & jnp.asarray(keep))

    def _drop_cancelled(self, st):
        gone = [s for s, r in enumerate(self._slots) if r is not None and r.cancelled]
        for s in gone:
            self._end(self._slots[s], "cancelled")
        return self._free(st, gone)

    # ---------------------------------------------------------------- joining
    def _admit(self, st, pending):
        eng = self.engine
        free = [s for s, r in enumerate(self._slots) if r is None]
        taken: list[tuple[int, Request]] = []
        while free and pending:
            req = pending[0]
            if req.cancelled:
                pending.popleft()
                self._end(req, "cancelled")
                continue
            try:
                fits = eng.reserve(free[0], len(req.prompt), req.max_new)
            except Exception as e:  # noqa: BLE001  (larger than the whole page pool: this request alone)
                pending.popleft()
                self._end(req, "error", e)
                continue
            if not fits:
                break  # paged KV: waits, first in line, until running requests give pages back
            pending.popleft()
            taken.append((free.pop(0), req))
        if not taken:
            return st
        self._joining = [r for _, r in taken]
        try:
            st = self._start(st, taken)
        except Exception as e:
            if not _intact(st):
                raise EngineFailure(f"a join consumed the decode state: {e!r}") from e
            log.warning("a join of %d requests failed (%r); joining them one at a time", len(taken), e)
            for s, req in taken:
                try:  # from clean slots: pages a failed join may have grown go back first
                    st = eng.release(st, [s])
                    eng.reserve(s, len(req.prompt), req.max_new)
                    st = self._start(st, [(s, req)])
                except Exception as e1:
                    if not _intact(st):
                        raise EngineFailure(f"a join consumed the decode state: {e1!r}") from e1
                    self._joining.remove(req)
                    self._end(req, "error", e1)
                    st = eng.release(st, [s])
        self._joining = []
        return st

    def _start(self, st, taken):
        reqs = [r for _, r in taken]
        keys = np.stack([np.asarray(jax.random.key_data(jax.random.key(int(r.seed) % (1 << 32)))) for r in reqs])
        st, self._ctl = self.engine.start(st, self._ctl, [s for s, _ in taken], [r.prompt for r in reqs], keys,
                                          [r.max_new for r in reqs], [r.sampling for r in reqs],
                                          [r.stop_ids for r in reqs])
        for s, req in taken:
            self._slots[s] = req
            self._joining.remove(req)
        return st

    # ---------------------------------------------------------------- after a round
    def _collect(self, st, ro, t0):
        n_gen, active, finish, out, acc, lengths, decoded = jax.device_get(
            (st.n_gen, st.active, st.finish, st.out, ro.accepted, ro.lengths, ro.active))
        self.rounds += 1
        now = time.perf_counter()
        if self.metrics is not None and self.ready.is_set():  # slots still forwarding their prompt decoded nothing
            self.metrics.round(now - t0, acc, lengths, [r is not None and bool(decoded[s])
                                                        for s, r in enumerate(self._slots)], self.engine.G)
        ended = []
        for s, req in enumerate(self._slots):
            if req is None:
                continue
            try:
                reason = self._advance(req, s, n_gen, active, finish, out, acc, decoded, now)
            except Exception as e:  # this request's own path (its callback, its stop check): it alone ends
                log.exception("request %s failed", req.id)
                ended.append(s)
                self._end(req, "error", e)
                continue
            if reason is not None:
                ended.append(s)
                self._end(req, reason)
        return self._free(st, ended) if ended else st

    def _advance(self, req, s, n_gen, active, finish, out, acc, decoded, now) -> str | None:
        req.rounds += int(decoded[s])
        req.accepted += int(acc[s])
        new = out[s, len(req.tokens): n_gen[s]].tolist()
        reason = None if active[s] else FINISH_REASONS[int(finish[s])]
        if new:
            if req.first_token_s is None:
                req.first_token_s = now - req.arrived
                if self.metrics is not None and self.ready.is_set():
                    self.metrics.first_token(req.first_token_s)
            keep = req.stop_text(req.tokens + new) if req.stop_text is not None else None
            if keep is not None:  # a stop string: keep what precedes it, end the request
                new = (req.tokens + new)[:keep][len(req.tokens):]
                reason = "stop"
            req.tokens += new
            req.on_tokens(new)
        return reason

    # ---------------------------------------------------------------- warm-up
    def _warm(self, st):
        """Compile what the first requests would: each prefill bucket from an idle engine (R
        prompts a wave), the round, and (with chunked prefill) a join beside a running request."""
        eng = self.engine
        min_len = 1 if eng.kind is None else eng.kind.min_prompt_len
        limit = eng.S - eng.G - 3
        by_bucket = {}
        for b in eng.prefill_buckets:
            n = max(min(b, limit), min_len)
            by_bucket.setdefault(next(x for x in eng.prefill_buckets if x >= n), n)
        lens = sorted(by_bucket.values())

        def warm(n, max_new=2):
            return Request([1] * n, max_new, SamplingParams(0.0, 0, 1.0), (), seed=0)

        for i in range(0, len(lens), eng.R):
            st = self._drain(st, collections.deque(warm(n) for n in lens[i: i + eng.R]))
        if eng.prefill_chunk and eng.R > 1:
            pending = collections.deque([warm(min_len, 4)])
            st = self._iterate(st, pending)
            pending.append(warm(min_len))
            st = self._drain(st, pending)
        return st

    def _drain(self, st, pending):
        for _ in range(10_000):
            if self._stop.is_set():
                break
            busy = any(r is not None for r in self._slots)
            if not busy and pending and not self._admit_possible(pending):
                break
            if not busy and not pending:
                break
            st = self._iterate(st, pending)
        return st

    def _admit_possible(self, pending) -> bool:
        req = pending[0]
        try:
            return self.engine.pages is None or self.engine.admit_count([(len(req.prompt), req.max_new)]) > 0
        except Exception:  # noqa: BLE001  (too large for the page pool: not warmed)
            pending.clear()
            return False
