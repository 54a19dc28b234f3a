"""Continuous batching: which request runs in which of an engine's slots, round after round.

The one loop of admit -> join -> round -> collect, used by `Engine.generate` (`generate` below),
the server (serve/loop.py) and the benchmarks. Requests wait in arrival order; between rounds the
head of the queue moves into free slots while the page pool can hold its whole reach (first
come, first served), joins (one prefill per prompt-length bucket, or handed to the rounds with
chunked prefill), and after each round every slot's newly committed tokens and, when it ended,
its reason come back as `Update`s; an ended request's slot and pages are free before the next
round. `cancel` ends a request early (its slot and pages too).
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import jax
import numpy as np

from dspark_jax.calibration.traces import Traces
from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.engine.errors import EngineError
from dspark_jax.engine.live_costs import LiveTable
from dspark_jax.engine.page_alloc import OutOfPagesError
from dspark_jax.engine.requests import per_request, reach
from dspark_jax.engine.results import GenerateResult, RequestResult
from dspark_jax.engine.state import FINISH_REASONS, RoundOut
from dspark_jax.io.program_store import stored_jit

__all__ = ["Job", "Update", "Round", "Batcher", "generate", "warmup_lengths"]

_ids = itertools.count()


def _request_key_data(seeds, index):
    """Request i's key data: its seed's key folded with its index in the call (distinct streams
    for equal seeds)."""
    return jax.random.key_data(jax.vmap(lambda sd, i: jax.random.fold_in(jax.random.key(sd), i))(seeds, index))


# one stored program per request count, not the eager key operations' several each process
_request_keys = stored_jit(_request_key_data, "request_keys")


@dataclass
class Job:
    """One request as the batcher runs it; `tokens`, `rounds`, `accepted` grow as it runs."""

    prompt: list[int]
    max_new: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: tuple[int, ...] = ()
    seed: int = 0  # its randomness: key(seed), unless `key_data` is given
    key_data: np.ndarray | None = None  # jax.random.key_data of its own key
    id: int = field(default_factory=lambda: next(_ids))
    tokens: list[int] = field(default_factory=list)
    rounds: int = 0  # rounds it decoded in
    accepted: int = 0  # accepted drafts kept, over its rounds
    started: float | None = None  # perf_counter when it joined a slot
    ended: float | None = None  # ... and when its end was collected
    finish_reason: str | None = None  # "stop", "length", "context", or the caller's ("cancelled", ...)

    def key(self) -> np.ndarray:
        if self.key_data is not None:
            return np.asarray(self.key_data)
        return np.asarray(jax.random.key_data(jax.random.key(int(self.seed) % (1 << 32))))


class Update(NamedTuple):
    """What one round did for one running job."""

    slot: int
    job: Job
    new: list[int]  # tokens committed since the last update (already appended to job.tokens)
    reason: str | None  # why it ended (its slot is free again), None while it runs


@dataclass
class Round:
    """One call of the engine (a round, or a compiled loop of rounds) and what it did."""

    index: int  # calls of this batcher before it
    ids: np.ndarray  # [R] the job id in each slot during the call (-1: none)
    updates: list[Update]
    seconds: float
    record: RoundOut | None = None  # the per-slot record on device (host loop only)
    accepted: np.ndarray | None = None  # [R] on the host, when the batcher streams (host loop)
    lengths: np.ndarray | None = None  # [R] verification lengths chosen
    decoded: np.ndarray | None = None  # [R] slots that decoded (not still forwarding their prompt)
    drafted: bool | None = None  # the drafter ran (False: the round skipped drafting)
    bucket: int | None = None  # the compiled verification bucket it ran in (index)


class Batcher:
    """Owns an engine's decode state and its slot table. `stream`: read every running job's new
    tokens after each call (for streaming); else only ended jobs' tokens are read."""

    def __init__(self, engine, control, *, stream: bool = True):
        self.engine, self.control, self.stream = engine, control, stream
        # a streaming batcher (a server's) keeps the scheduler's cost table current with its rounds
        self.live = LiveTable(control.table, engine.buckets) if stream and engine.needs_table else None
        self.slots: list[Job | None] = [None] * engine.R
        self.state = engine.init_state()
        self.calls = 0
        self.join_seconds = 0.0  # the joins' wall time so far (their prefills), apart from the rounds'

    def reset(self) -> list[Job]:
        """A fresh decode state with every slot free -> the jobs that were running (not ended)."""
        gone = self.jobs
        self.slots = [None] * self.engine.R
        self.state = self.engine.init_state()
        return gone

    @property
    def jobs(self) -> list[Job]:
        return [j for j in self.slots if j is not None]

    @property
    def busy(self) -> bool:
        return any(j is not None for j in self.slots)

    def free_slots(self) -> list[int]:
        return [s for s, j in enumerate(self.slots) if j is None]

    # ---------------------------------------------------------------- joining

    def admit(self, pending: collections.deque) -> tuple[list[tuple[int, Job]], list[tuple[Job, Exception]]]:
        """Move jobs from the head of `pending` into free slots while the page pool admits them ->
        (taken as (slot, job), refused as (job, error): larger than the whole pool). The head waits
        when the pool cannot hold it yet. Taken jobs still have to `join`."""
        free, taken, refused = self.free_slots(), [], []
        while free and pending:
            job = pending[0]
            try:
                fits = self.engine.reserve(free[0], len(job.prompt), job.max_new)
            except OutOfPagesError as e:
                pending.popleft()
                refused.append((job, e))
                continue
            if not fits:
                break
            pending.popleft()
            taken.append((free.pop(0), job))
        return taken, refused

    def can_admit(self, job: Job) -> bool:
        """Whether `job` could join now (the page pool holds its reach beside the promises made);
        raises OutOfPagesError when it exceeds the whole pool."""
        pages = self.engine.pages
        return pages is None or pages.admits([reach(len(job.prompt), job.max_new, self.engine.G, self.engine.S)]) > 0

    def reserve(self, slot: int, job: Job) -> bool:
        """Admission of one job into `slot` (after `give_back`, to retry a failed join alone)."""
        return self.engine.reserve(slot, len(job.prompt), job.max_new)

    def join(self, taken: list[tuple[int, Job]]) -> None:
        """Start the admitted jobs in their slots (raises when the engine refuses them). Waits for
        the join's work (the prefill): dispatched asynchronously, it would run inside the next
        round's wall time, and that round's seconds, which the live cost table observes and the
        metrics report, would carry it (docs/serving.md, the SmolLM2 section)."""
        t0 = time.perf_counter()
        jobs = [j for _, j in taken]
        self.state, self.control = self.engine.start(
            self.state, self.control, [s for s, _ in taken], [j.prompt for j in jobs],
            np.stack([j.key() for j in jobs]), [j.max_new for j in jobs], [j.sampling for j in jobs],
            [j.stop_ids for j in jobs])
        jax.block_until_ready(self.state)
        now = time.perf_counter()
        self.join_seconds += now - t0
        for s, job in taken:
            self.slots[s] = job
            job.started = now

    def give_back(self, slots: Iterable[int]) -> None:
        """Pages and reservations of `slots`, which hold no job (e.g. a join that failed), go back."""
        self.state = self.engine.release(self.state, list(slots))

    # ---------------------------------------------------------------- running

    def round(self, loop: str = "host", waiting: bool = False) -> Round:
        """One compiled round ("host"), or ("while") a compiled loop of rounds that returns when
        every slot is done or, with `waiting`, when one frees up -> what it did."""
        ids = np.asarray([-1 if j is None else j.id for j in self.slots], np.int64)
        t0 = time.perf_counter()
        record = None
        if loop == "host":
            self.state, record = self.engine.step(self.state, self.control)
        else:
            self.state = self.engine.run_rounds(self.state, self.control, waiting)
        rnd = Round(index=self.calls, ids=ids, updates=[], seconds=0.0, record=record)
        self.calls += 1
        self._collect(rnd)
        rnd.seconds = time.perf_counter() - t0
        if self.live is not None and rnd.bucket is not None:
            self.live.observe(rnd.bucket, rnd.drafted, rnd.seconds)
            table = self.live.refreshed()
            if table is not None:
                self.control = self.control._replace(table=table)
        return rnd

    def _collect(self, rnd: Round) -> None:
        st, busy = self.state, [s for s, j in enumerate(self.slots) if j is not None]
        want = {"active": st.active}
        if not self.stream:
            active = np.asarray(jax.device_get(st.active))
            if all(active[s] for s in busy):
                return
        want.update(n_gen=st.n_gen, out=st.out, finish=st.finish, rounds=st.rounds, acc=st.acc_sum)
        if self.stream and rnd.record is not None:
            want.update(accepted=rnd.record.accepted, lengths=rnd.record.lengths, decoded=rnd.record.active,
                        drafted=rnd.record.drafted, bucket=rnd.record.bucket)
        got = jax.device_get(want)
        rnd.accepted, rnd.lengths, rnd.decoded = got.get("accepted"), got.get("lengths"), got.get("decoded")
        rnd.drafted = None if "drafted" not in got else bool(got["drafted"])
        rnd.bucket = None if "bucket" not in got else int(got["bucket"])
        now, ended = time.perf_counter(), []
        for s in busy:
            job = self.slots[s]
            new = got["out"][s, len(job.tokens): got["n_gen"][s]].tolist()
            job.tokens += new
            job.rounds, job.accepted = int(got["rounds"][s]), int(got["acc"][s])
            reason = None if got["active"][s] else FINISH_REASONS[int(got["finish"][s])]
            if reason is not None:
                job.finish_reason, job.ended = reason, now
                self.slots[s] = None
                ended.append(s)
            if new or reason is not None:
                rnd.updates.append(Update(slot=s, job=job, new=new, reason=reason))
        self.state = self.engine.release(self.state, ended)  # paged KV: their pages go back at once

    def slot_of(self, which) -> int | None:
        """The slot of a job, a job id, or a slot number; None when it runs nowhere."""
        for s, j in enumerate(self.slots):
            if j is not None and (j is which or (isinstance(which, int) and j.id == which)):
                return s
        return None

    def cancel(self, which, reason: str = "cancelled") -> Job | None:
        """End a running job now (a Job or its id): its slot stops decoding and frees its pages
        -> the job, or None when it was not running."""
        s = self.slot_of(which)
        if s is None:
            return None
        job, self.slots[s] = self.slots[s], None
        job.finish_reason, job.ended = reason, time.perf_counter()
        self.state = self.engine.cancel(self.state, [s])
        return job

    def run(self, jobs: Iterable[Job], loop: str = "host", on_round: Callable[[Round], None] | None = None) -> None:
        """Run `jobs` to their ends, refilling slots as they free up."""
        pending = collections.deque(jobs)
        while True:
            taken, refused = self.admit(pending)
            if refused:
                raise refused[0][1]
            if taken:
                self.join(taken)
            if not self.busy:
                if pending:
                    raise EngineError("a waiting request does not fit the idle engine")
                return
            rnd = self.round(loop, waiting=bool(pending))
            if on_round is not None:
                on_round(rnd)


def warmup_lengths(engine) -> list[int]:
    """Prompt lengths that compile every prefill bucket of `engine` once (the shortest per bucket
    that a request may have)."""
    by_bucket: dict[int, int] = {}
    for b in engine.prefill_buckets:
        n = max(min(b, engine.room - 1), engine.min_prompt_len)
        by_bucket.setdefault(next(x for x in engine.prefill_buckets if x >= n), n)
    return sorted(by_bucket.values())


def generate(engine, prompts, *, max_new_tokens: int = 64, sampling: SamplingParams | None = None, seed: int = 0,
             gamma: int | None = None, threshold: float = 0.0, stop_ids=(), sts=None, sample_index=None,
             traces: bool = False, loop: str = "host", table=None) -> GenerateResult:
    """Generate for every prompt (lists of token ids) on `engine`, R at a time, refilling freed slots.

    Per request or for all: `max_new_tokens`, `sampling`, `stop_ids` and `seed` each take one
    value or a list with one per prompt (changing them never recompiles). Request i draws its
    randomness from `fold_in(key(seed_i), sample_index[i])` (default i), so its output does
    not depend on the batch it ran in. `loop`: "host" (a Python loop over the compiled round;
    required for traces) or "while" (a compiled `lax.while_loop` that returns to the host
    only when a slot frees up while requests wait).
    """
    if loop not in ("host", "while"):
        raise EngineError(f"loop must be 'host' or 'while', got {loop!r}")
    if traces and loop != "host":
        raise EngineError("traces need loop='host' (the while loop does not return per-round records)")
    n = len(prompts)
    max_news = per_request(max_new_tokens, n, "max_new_tokens")
    samplings = per_request(sampling, n, "sampling")
    stops = per_request(list(stop_ids), n, "stop_ids")
    seeds = per_request(seed, n, "seed")
    checked = [engine.validate_request(p, m, sampling=sp, stop_ids=tuple(sd), seed=s, prompt_name=f"prompt {i}",
                                       names={"max_new": "max_new_tokens", "stop": "stop_ids"})
               for i, (p, m, sp, sd, s) in enumerate(zip(prompts, max_news, samplings, stops, seeds))]
    ctl = engine.control(checked[0].sampling if n else sampling, gamma, threshold, (), sts, table)
    idx = list(range(n)) if sample_index is None else [int(i) for i in sample_index]
    keys = np.asarray(_request_keys(np.asarray(seeds, np.uint32), np.asarray(idx, np.uint32))) if n else None
    jobs = [Job(prompt=c.prompt, max_new=c.max_new, sampling=c.sampling, stop_ids=c.stop_ids, key_data=keys[i], id=i)
            for i, c in enumerate(checked)]
    tr = Traces(engine.G) if traces else None
    batcher = Batcher(engine, ctl, stream=False)
    t0 = time.perf_counter()
    batcher.run(jobs, loop, on_round=None if tr is None else lambda r: tr.add(r.index, r.ids, r.record))
    results = [RequestResult(tokens=j.tokens, prompt_len=len(j.prompt), rounds=j.rounds, accepted=j.accepted,
                             seconds=j.ended - j.started, finish_reason=j.finish_reason) for j in jobs]
    return GenerateResult(results=results, seconds=time.perf_counter() - t0, round_calls=batcher.calls, traces=tr)
