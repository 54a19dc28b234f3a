"""The engine's compiled round and draft timed per verification bucket: the measured cost tables
of scheduler/costs.py (`python -m dspark_jax costs measure`)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from dspark_jax.engine.state import PIN_SKIP
from dspark_jax.scheduler.costs import MeasureError, bucket_plan, measure_table, time_stat

__all__ = ["prefilled_state", "engine_draft_timer", "engine_round_timer", "measure_engine",
           "draft_time", "engine_skip_timer"]


def prefilled_state(engine, k: int, seed: int = 0, prompt: int | None = None, fill: int | None = None):
    """The engine's state with requests in slots 0..k-1, their next round mid-cache (a prompt of
    about half the cache), or with `prompt` tokens prefilled and then every row's cache length and
    position moved to `fill`: attention then reads that many keys of the cache, whatever they
    hold, without forwarding a whole context (what the roofline benchmark times)."""
    S, G, V = engine.S, engine.G, engine.target.cfg.vocab_size
    shortest = 1 if engine.kind is None else engine.kind.min_prompt_len
    n = max(min(S // 2 - G, S - G - 2) if prompt is None else prompt, shortest)
    prompts = [[(7 * i + 3 * j + 1) % V for j in range(n)] for i in range(k)]
    kd = jax.random.key_data(jax.random.split(jax.random.key(seed), k))
    st = engine.prefill_slots(engine.init_state(), list(range(k)), prompts, kd, [S] * k)
    if fill is None:
        return st
    at = lambda a: jnp.where(jnp.arange(engine.R) < k, fill, a).astype(jnp.int32)
    st = st._replace(pos=at(st.pos), cache=st.cache.with_lengths(at(st.cache.lengths)))
    return st._replace(dcache=st.dcache.with_lengths(at(st.dcache.lengths))) if engine.G else st


def _state(engine, k: int, states: dict | None, **state):
    """`prefilled_state` with k slots, kept in `states` (when given) for the other timers: none
    donates it (the rounds run on copies)."""
    if states is None:
        return prefilled_state(engine, k, **state)
    if k not in states:
        states[k] = prefilled_state(engine, k, **state)
    return states[k]


def engine_draft_timer(engine, sampling=None, states: dict | None = None, **state):
    """``draft_fn() -> seconds`` (one call): the round's draft part, i.e. the engine's own draft
    function (`Engine.draft`: the call the compiled round makes first, jitted alone) on a state with all R
    slots prefilled. It drafts G tokens for every row whatever lengths the policy later picks, so
    one number per round is exact; timing it apart (rather than as the difference of two rounds)
    keeps it from absorbing the round's other bucket-independent work, which `measure_table`
    charges to verification instead (``t_draft + t_verify(b)`` stays the measured round). All
    inputs are traced arguments, as in the round: as closure constants XLA folds the per-row
    sampling branches and the draft times several times faster than inside the round."""
    if not engine.G:
        return lambda: 0.0

    st, ctl = _state(engine, engine.R, states, **state), engine.control(sampling, table=engine.unpriced_table)

    def draft_fn() -> float:
        t0 = time.perf_counter()
        jax.block_until_ready(engine.draft(st, ctl))
        return time.perf_counter() - t0

    return draft_fn


def engine_round_timer(engine, sampling=None, buckets=None, states: dict | None = None, **state):
    """``(round_fn, plan, used)``: ``round_fn(bucket) -> seconds`` (one call) times the engine's
    compiled round (`Engine.step`, all buckets in one program) on a state with k active slots and
    verify length g from `bucket_plan` pinned (`Control.pin`: whatever the engine's policy and
    skip rule), so the round runs its own `lax.switch` branch for that bucket. Each call starts
    from a fresh copy of the state (the round donates it; copying is not timed).
    ``used[bucket]`` records `RoundOut.bucket` of every call; a round that lands elsewhere raises
    MeasureError. `state`: `prefilled_state`'s prompt / fill for the timed states."""

    # chunk-only buckets are never priced; `buckets`: a subset of the priced ones
    plan = bucket_plan(engine.priced_buckets if buckets is None else buckets, engine.R, engine.G)
    states = {} if states is None else states
    ctls, used = {}, {}

    def round_fn(bucket: int) -> float:
        k, g = plan[bucket]
        _state(engine, k, states, **state)
        if g not in ctls:
            ctls[g] = engine.control(sampling, gamma=g, pin=g, table=engine.unpriced_table)
        s = jax.block_until_ready(jax.tree.map(jnp.copy, states[k]))
        t0 = time.perf_counter()
        out = jax.block_until_ready(engine.step(s, ctls[g]))
        dt = time.perf_counter() - t0
        got = int(out[1].bucket)
        used.setdefault(bucket, []).append(got)
        if got != engine.buckets.index(bucket):
            raise MeasureError(f"the round timed for bucket {bucket} ({k} active slots x (1 + {g}) tokens) ran in "
                               f"bucket {engine.buckets[got]}")
        return dt

    return round_fn, plan, used


def engine_skip_timer(engine, sampling=None, states: dict | None = None, **state):
    """``skip_fn() -> seconds`` (one call): the engine's compiled round with every slot decoding
    and drafting skipped (`Control.pin` = `PIN_SKIP`: the plain round a skip rule runs), from a
    fresh copy of the state each call. Only an engine with a skip rule compiles that round."""
    st = _state(engine, engine.R, states, **state)
    ctl = engine.control(sampling, pin=PIN_SKIP, table=engine.unpriced_table)

    def skip_fn() -> float:
        s = jax.block_until_ready(jax.tree.map(jnp.copy, st))
        t0 = time.perf_counter()
        jax.block_until_ready(engine.step(s, ctl))
        return time.perf_counter() - t0

    return skip_fn


def measure_engine(engine, repeats: int = 5, warmup: int = 1, stat: str = "median", sampling=None,
                   log=None, buckets=None, state: dict | None = None, warm_programs: bool = False,
                   draft: str = "timed") -> dict:
    """Cost table of ``engine`` measured on its compiled round (whatever its policy: each timed
    round's length is pinned): `measure_table` over `engine_round_timer` and `engine_draft_timer`,
    plus the plan (active slots, verify length, tokens per bucket), the bucket index every timed
    round used and, for an engine with a skip rule, ``t_skip``: its round that skips drafting
    (`engine_skip_timer`, timed in the same sweeps).
    `buckets`: the priced buckets to time (default all); `state`: `prefilled_state`'s prompt / fill
    for the timed states; `warmup` untimed sweeps, or with `warm_programs` one untimed call of each
    program. `draft`: "timed" (the draft program alone, `engine_draft_timer`) or "skip": what
    skipping it saves, the round with every slot active and no draft verified minus the skipped
    round (`measure_table`'s draft_from_skip; no draft program compiled), where the engine has a
    skip rule and such a bucket is timed, else "timed"."""
    if (warmup < 1 and not warm_programs) or repeats < 1:
        raise MeasureError(f"need warmup >= 1 or warm_programs (the first round compiles) and repeats >= 1, got "
                           f"{warmup}, {repeats}")
    if draft not in ("timed", "skip"):
        raise MeasureError(f"draft must be 'timed' or 'skip', got {draft!r}")
    buckets = engine.priced_buckets if buckets is None else tuple(buckets)
    state, states = state or {}, {}
    round_fn, plan, used = engine_round_timer(engine, sampling, buckets, states=states, **state)
    skip = engine_skip_timer(engine, sampling, states=states, **state) \
        if engine.G and engine.spec.skip_drafting is not None else None
    full = next((b for b in sorted(plan) if plan[b] == (engine.R, 0)), None) \
        if draft == "skip" and skip is not None else None
    draft_fn = engine_draft_timer(engine, sampling, states=states, **state) if full is None else None
    res = measure_table(round_fn, buckets, draft_fn, repeats=repeats, warmup=warmup, stat=stat, log=log,
                        skip_fn=skip, warm_programs=warm_programs, draft_from_skip=full)
    res["plan"] = [{"bucket": b, "active_slots": k, "verify_len": g, "tokens": k * (1 + g)}
                   for b, (k, g) in sorted(plan.items())]
    res["buckets_used"] = {b: used[b] for b in res["buckets"]}
    return res


def draft_time(engine, repeats: int = 5, warmup: int = 1, stat: str = "median", sampling=None) -> float:
    """Seconds of the engine's draft part per round (0 without a drafter); see `engine_draft_timer`."""
    f = engine_draft_timer(engine, sampling)
    return time_stat([f() for _ in range(warmup + repeats)][warmup:], stat)
