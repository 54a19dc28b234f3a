"""Serving simulation: many concurrent requests, round times from a cost table, acceptance from traces.

    python -m dspark_jax simulate --costs configs/costs/accelerator_synthetic.json --synthetic-traces \
        --out docs/figures/sim_accel
    python -m dspark_jax simulate --costs T.json --traces dspark.npz --dflash-traces dflash.npz \
        --mtp-traces mtp.npz --drafter ckpt/drafter --out out/

Model (steady state, every slot busy). At concurrency R each simulated request replays a
recorded request's full-gamma rounds in order (starting at a random round, wrapping), so
per-request difficulty persists as it does in real traffic; every ``--turnover`` rounds a
slot moves on to a newly drawn request (churn). A round that verifies l draft
tokens of a trace row with accepted count k (at full gamma) accepts ``min(k, l)`` drafts:
exact under the prefix property of rejection sampling (the first l slots are accepted with
the same coins whether or not later slots are verified). The scheduler sees the row's
calibrated survival ``a = cumprod(sigmoid(z / T))`` (STS temperatures from the drafter's
``sts.json``, else fitted on the traces). One round costs ``T_draft(kind, R) +
T_verify(B)`` with ``B = sum_r (1 + l_r)`` (a round that skips drafting: `skipped_round_cost`,
the table's ``t_skip``, else no less than its target-only step; a settled one, below: the
target-only step, `target_only_cost`); ``--charge step`` (default)
charges the bucket B rounds up to (what the static-shape engine runs), ``interp`` the exact-B
cost (a ragged engine). Each round commits ``sum_r (min(k_r, l_r) + 1)`` tokens.

Methods: target-only; MTP-1 (MTP traces, else a stated acceptance rate); fixed gamma
(DFlash traces, DSpark traces); static threshold on the calibrated survival; DSpark with
the early-stop (Algorithm 1), static-shape and production schedulers (the compiled JAX
versions from ``dspark_jax.scheduler.prefix``, vmapped over rounds), optionally skipping the
draft by the engine's rules: ``--skip known`` (default; ``EngineConfig(skip_drafting="known")``):
skip when the best case does not pay or when the survivals of the last round that drafted
say no admission count beats a round without a draft (priced as `skipped_round_cost`, as the
engine's rule prices it: ``prefix.plain_time``), drafting after ``--probe-every`` skipped rounds
to refresh them (the interval doubles up to ``--probe-max`` while fresh survivals say no, and
probes stop when they say no by more than their sampling error, ``prefix.settled_no``). A round
that may lose (a probe, or a "yes" within its sampling error: the lower bound of its gain,
``prefix.drafting_gain``, is negative) drafts only while the credit, what the drafted rounds
saved by their own survivals, covers that loss. Rounds skipped while the best case does not pay,
such a "no" holds or the credit does not cover the next draft are settled: the engine runs them
as the target-only program, without keeping the drafter's context. The window is steady state:
the rule starts from the survivals of the round before it (and that round's gain as its credit),
as the production scheduler's stale input does. ``--skip best_case``
(``prefix.speculation_pays``) only the first part. ``--skip stale`` is an idealisation no
engine can run: it reads the survivals of two rounds ago even when that round skipped drafting
(so produced none). ``--fixed-skip acceptance``: the fixed-length variants skip by the engine's
"acceptance" rule (``EngineConfig(skip_drafting="acceptance")``, the default of drafters without
a confidence head): the "known" rule on survivals from the drafted rounds' own acceptance counts,
priced at the fixed length (``prefix.running_survivals``, ``prefix.fixed_verdict``).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.calibration.traces import TraceSet
from dspark_jax.scheduler import prefix
from dspark_jax.scheduler.costs import draft_time_for, skip_extra

__all__ = ["Method", "SimResult", "default_methods", "replay_rows", "simulate_method", "run_sweep",
           "matched_throughput", "headline", "write_outputs", "priced_concurrency", "versus_target_only",
           "ratio_rows_markdown", "skipped_round_cost", "target_only_cost"]

SCHEDULED = ("early_stop", "static", "production")


@dataclass(frozen=True)
class Method:
    name: str
    kind: str  # ar | mtp1 | fixed | threshold | early_stop | static | production
    traces: str | None = "dspark"  # which trace set supplies acceptance: dspark | dflash | mtp1 | None
    gamma: int | None = None  # fixed-gamma length (default: the traces' gamma)
    threshold: float = 0.5
    skip: str = "none"  # none | known | best_case | stale (scheduled kinds) | acceptance (fixed)


def default_methods(threshold: float = 0.5, skip: str = "known", have_dflash: bool = True,
                    fixed_skip: str = "none") -> list[Method]:
    """The simulated methods; `skip`: the scheduled variants' skip rule, `fixed_skip`: the
    fixed-length ones' ("none" or "acceptance")."""
    out = [Method("target-only", "ar", None), Method("MTP-1", "mtp1", "mtp1")]
    if have_dflash:
        out.append(Method("DFlash gamma=7", "fixed", "dflash", gamma=7, skip=fixed_skip))
    out += [Method("DSpark gamma=7", "fixed", "dspark", gamma=7, skip=fixed_skip),
            Method(f"DSpark threshold {threshold:g}", "threshold", "dspark", threshold=threshold),
            Method("DSpark early-stop", "early_stop", "dspark", skip=skip),
            Method("DSpark static-shape", "static", "dspark", skip=skip),
            Method("DSpark production", "production", "dspark", skip=skip)]
    return out


@dataclass
class SimResult:
    method: str
    concurrency: int
    total_tps: float  # tokens / s, all requests
    per_user_tps: float
    budget: float  # mean verified tokens per request per round (1 + l)
    tau: float  # mean committed tokens per request per round
    skip_frac: float  # rounds without drafting
    round_ms: float
    rounds: dict = field(default_factory=dict, repr=False)  # per-round arrays when keep_rounds


# ------------------------------------------------------------------ acceptance replay


def replay_rows(ts: TraceSet, n_requests: int, n_rounds: int, rng, turnover: int | None = 64) -> np.ndarray:
    """Row indices [n_rounds, n_requests] into ``ts``: each simulated slot replays one recorded
    request's rounds in order from a random start (wrapping), and switches to a freshly drawn
    request every ``turnover`` rounds (request churn; None = never)."""
    order = np.lexsort((ts.round, ts.request))
    req = ts.request[order]
    starts = np.r_[0, np.flatnonzero(np.diff(req)) + 1]
    lens = np.diff(np.r_[starts, len(req)])
    L = n_rounds if not turnover else int(turnover)
    n_seg = -(-n_rounds // L)
    g = rng.integers(0, len(starts), (n_seg, n_requests))
    off = rng.integers(0, lens[g])
    t = np.arange(n_rounds)[:, None]
    seg = t[:, 0] // L
    return order[starts[g[seg]] + (off[seg] + t) % lens[g[seg]]]


# ------------------------------------------------------------------ compiled schedulers


@lru_cache(maxsize=None)
def _sched_fn(kind: str, mode: str):

    if kind == "early_stop":
        f = lambda a, s, act, tab, dk: prefix.schedule_early_stop(a, act, tab, mode=mode, cost="interp")
    elif kind == "static":
        f = lambda a, s, act, tab, dk: prefix.schedule_static(a, act, tab, mode=mode)[0]
    elif kind == "production":
        f = lambda a, s, act, tab, dk: prefix.schedule_production(a, act, s, True, tab, dk,
                                                                  mode=mode, cost="step")[0]
    else:
        raise ValueError(kind)
    return jax.jit(jax.vmap(f, in_axes=(0, 0, None, None, None)))


def _pad_rows(x, R_pad):
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, R_pad - x.shape[1])
    return np.pad(x, pad)


def _verify_cost(B, table_np, charge):
    bk = np.asarray(table_np.buckets, np.float64)
    tv = np.asarray(table_np.t_verify, np.float64)
    B = np.asarray(B, np.float64)
    if np.any(B > bk[-1]):
        return np.where(B > bk[-1], np.inf, 0.0) + _verify_cost(np.minimum(B, bk[-1]), table_np, charge)
    if charge == "step":
        return tv[np.searchsorted(bk, B, side="left")]
    return np.interp(B, bk, tv)


def _plain_cost(R, table_np, charge):
    """A round without a draft at R requests (``prefix.plain_time``): t_verify(R) plus the
    table's skip_extra."""
    extra = 0.0 if table_np.skip_extra is None else float(table_np.skip_extra)
    return _verify_cost(R, table_np, charge) + extra


def _stale_skip(a_stale, R, table_np, t_draft, charge, mode="latency"):
    """Per round: True where, on the given survivals, no admission count K >= 1 beats a round
    without a draft (``prefix.known_speculation_pays``; the objective `mode` as in the engine:
    "latency" counts the draft time, "sps" does not)."""
    flat = -np.sort(-a_stale.reshape(a_stale.shape[0], -1), axis=1)  # [T, R*G] descending
    tau = R + np.cumsum(flat, axis=1)
    B = R + np.arange(1, flat.shape[1] + 1)
    th = tau / ((t_draft if mode == "latency" else 0.0) + _verify_cost(B, table_np, charge))[None]
    return th.max(axis=1) <= R / _plain_cost(R, table_np, charge)


def _best_case_pays(R, table_np, t_draft, max_tokens, mode="latency"):
    """The engine's best-case rule (``prefix.speculation_pays`` on the interpolated table): some
    K in 1..max_tokens draft tokens, each surviving, beats a round without a draft (no draft time)."""
    B = R + np.arange(1, max_tokens + 1)
    th = B / ((t_draft if mode == "latency" else 0.0) + _verify_cost(B, table_np, "interp"))
    return bool(np.any(th > R / _plain_cost(R, table_np, "interp")))


def _drafting_gain(a, R, table_np, t_draft, charge, mode="latency", z=prefix.SETTLE_Z):
    """``prefix.drafting_gain`` on one round's survivals [R, G] (all R slots active): (expected,
    lower bound) seconds that drafting with the best admission count saves against plain decoding
    of the tokens it expects."""
    flat = -np.sort(-np.clip(a, 0.0, 1.0).reshape(-1))
    tau = R + np.cumsum(flat)
    t = (t_draft if mode == "latency" else 0.0) + _verify_cost(R + np.arange(1, flat.size + 1), table_np, charge)
    k = int(np.argmax(tau / t))
    gain = float(tau[k] * _plain_cost(R, table_np, charge) / R - t[k])
    tt = 1.0 + np.clip(a, 0.0, 1.0).sum(axis=-1)
    se = tt.std(ddof=1) / (tt.mean() * np.sqrt(R)) if R >= 2 else 0.0
    return gain, gain - z * se * float(t[k])


def _settled_no(a, R, table_np, t_draft, charge, mode="latency", z=prefix.SETTLE_Z):
    """``prefix.settled_no`` on one round's survivals [R, G] (all R slots active): fresh
    survivals that say no admission count pays by more than z standard errors of the tokens they
    promise."""
    if R < 2:
        return False
    flat = -np.sort(-a.reshape(-1))
    tau = R + np.cumsum(flat)
    B = R + np.arange(1, flat.size + 1)
    th = tau / ((t_draft if mode == "latency" else 0.0) + _verify_cost(B, table_np, charge))
    rho = th.max() * _plain_cost(R, table_np, charge) / R
    t = 1.0 + np.clip(a, 0.0, 1.0).sum(axis=-1)
    return bool(1.0 - rho > z * t.std(ddof=1) / (t.mean() * np.sqrt(R)))


def _known_rounds(a, best_case_pays, R, table_np, t_draft, charge, probe_every, probe_max=64, mode="latency",
                  seed=None):
    """The engine's "known" rule, round by round -> (skip [T], settled [T]): skip unless the best
    case pays and either the survivals of the last round that drafted say some admission count
    beats a round without a draft, or there are none yet, or `gap` rounds have passed since that
    round (a probe). After each drafted round the gap resets to `probe_every` if its survivals
    say drafting pays, else it doubles, up to `probe_max`; when they say no by more than their
    sampling error (`_settled_no`) the verdict settles: no more probes at this load. A round
    whose gain on the known survivals may be negative (`_drafting_gain`'s lower bound) drafts
    only while the credit, the sum of the drafted rounds' gains on their own survivals, covers
    that bound. `settled`: skipped rounds that expect no draft at this load (the best case does
    not pay, a settled "no", or no credit for the next draft), which the engine runs without
    keeping the drafter's context. `seed` [R, G]: the survivals of the round before the first
    (steady state: the rule has drafted before; its gain is the starting credit), else the first
    round drafts to learn them."""
    T = a.shape[0]
    if not best_case_pays:
        return np.ones(T, bool), np.ones(T, bool)
    skip, final = np.zeros(T, bool), np.zeros(T, bool)
    known_pays, settled, since, gap, gain, low, credit = None, False, 0, probe_every, 0.0, 0.0, 0.0

    def verdict(x, gap):
        pays = not bool(_stale_skip(x[None], R, table_np, t_draft, charge, mode)[0])
        settled = not pays and _settled_no(x, R, table_np, t_draft, charge, mode)
        gain, low = _drafting_gain(x, R, table_np, t_draft, charge, mode)
        return pays, settled, probe_every if pays else min(2 * gap, probe_max), gain, low

    if seed is not None:
        known_pays, settled, gap, gain, low = verdict(seed, probe_every // 2)
        credit = gain
    for t in range(T):
        funded = low >= 0.0 or credit + low >= 0.0
        skip[t] = known_pays is not None and not (funded and (known_pays or (not settled and since + 1 >= gap)))
        if skip[t]:
            final[t] = settled or not funded
            since += 1
        else:
            known_pays, settled, gap, gain, low = verdict(a[t], gap)
            credit += gain
            since = 0
    return skip, final


def _known_skip(*args, **kw):
    """[T] bool: the rounds `_known_rounds` skips."""
    return _known_rounds(*args, **kw)[0]


def _skip_rounds(rule, a, a_stale, R, t_draft, table_np, G, mode, charge, probe_every, probe_max, seed=None):
    """(skip [T], settled [T]): rounds in which a scheduled method does not draft, by `rule`
    (module doc), and of those the "known" rule's settled ones; `seed`: the survivals of the
    round before the first ("known")."""
    T = a.shape[0]
    none = np.zeros(T, bool)
    if rule == "none":
        return none, none
    if rule == "stale":
        return _stale_skip(a_stale, R, table_np, t_draft, charge, mode), none
    best = _best_case_pays(R, table_np, t_draft, R * G, mode)
    if rule == "best_case":
        return np.full(T, not best), none
    if rule == "known":
        return _known_rounds(a, best, R, table_np, t_draft, charge, probe_every, probe_max, mode, seed=seed)
    raise ValueError(f"unknown skip rule {rule!r}")


@lru_cache(maxsize=None)
def _fixed_verdict_fn(mode: str, cost: str):
    def verdict(counts, n, gamma, table):
        s, rows = prefix.running_survivals(counts)
        return prefix.fixed_verdict(s, rows, n, gamma, table, mode=mode, cost=cost)

    return jax.jit(verdict)


def _acceptance_rounds(k, gamma, best_case_pays, R, table, charge, probe_every, probe_max=64, mode="latency"):
    """The engine's "acceptance" rule (fixed-length drafters without a confidence head), round by
    round -> (skip [T], settled [T]): the "known" rule (`_known_rounds`) on the survivals of the
    drafted rounds' own acceptance: decayed counts per draft position of the rows at risk there
    and of those accepted there (`k` [T, R]: each row's accepted count at full gamma), and the
    verdict on a round of `gamma` drafts a slot (`prefix.running_survivals`,
    `prefix.fixed_verdict`). Rounds draft until `prefix.RUNNING_MIN_ROWS` rows are known."""
    T = k.shape[0]
    if not best_case_pays:
        return np.ones(T, bool), np.ones(T, bool)
    verdict_fn = _fixed_verdict_fn(mode, charge)
    pos = np.arange(gamma)
    counts = np.zeros((2, gamma), np.float32)
    skip, final = np.zeros(T, bool), np.zeros(T, bool)
    v, settled, since, gap, credit = None, False, 0, probe_every, np.float32(0.0)  # float32: the engine's
    for t in range(T):
        if counts[0, 0] >= prefix.RUNNING_MIN_ROWS:
            pays, low = bool(v.pays), np.float32(v.low)
            funded = low >= 0.0 or credit + low >= 0.0
            skip[t] = not (funded and (pays or (not settled and since + 1 >= gap)))
            if skip[t]:
                final[t] = settled or not funded
                since += 1
                continue
        acc = np.minimum(k[t], gamma)
        counts = np.float32(prefix.RUNNING_DECAY) * counts + np.stack(
            [(pos[None] <= acc[:, None]).sum(0), (pos[None] < acc[:, None]).sum(0)]).astype(np.float32)
        v = verdict_fn(counts, R, gamma, table)
        settled = bool(v.settled_no) and not bool(v.pays)
        gap = probe_every if bool(v.pays) else -R if settled else min(2 * max(gap, probe_every // 2), probe_max)
        credit = credit + np.float32(v.gain)
        since = 0
    return skip, final


def _carried_stale(a_all, skip):
    """The engine's stale input of round t: the survivals of the last round <= t - 2 that drafted.
    a_all [T + 2, R, G] (the two leading rounds drafted); skip [T]."""
    drafted = np.concatenate([[True, True], ~np.asarray(skip, bool)])
    last = np.maximum.accumulate(np.where(drafted, np.arange(drafted.size), 0))
    return a_all[last[: skip.shape[0]]]


def simulate_method(method: Method, R: int, cost: dict, traces: dict, temps, *, n_rounds: int = 300, seed: int = 0,
                    mtp_accept: float = 0.85, mode: str = "latency", charge: str = "step", R_pad: int | None = None,
                    keep_rounds: bool = False, turnover: int | None = 64, probe_every: int = 8,
                    probe_max: int = 64) -> SimResult:
    """One method at concurrency R. ``traces``: {"dspark": TraceSet, "dflash": ..., "mtp1": ...}
    (full-gamma rounds); ``temps``: STS temperatures for the DSpark traces."""
    rng = np.random.default_rng([seed, R])
    table_np = _table_np(cost)
    draft_kind = {"ar": "ar", "mtp1": "mtp1"}.get(method.kind, method.traces or "dspark")
    t_draft = draft_time_for(cost, R, draft_kind)
    T = n_rounds
    if method.kind == "ar":
        l = np.zeros((T, R), np.int64)
        k = np.zeros((T, R), np.int64)
    elif method.kind == "mtp1":
        ts = traces.get("mtp1")
        if ts is not None:
            k = np.minimum(ts.accepted[replay_rows(ts, R, T, rng, turnover)], 1)
        else:
            k = (rng.random((T, R)) < mtp_accept).astype(np.int64)
        l = np.ones((T, R), np.int64)
    else:
        ts = traces.get(method.traces)
        if ts is None:
            raise ValueError(f"method {method.name!r} needs {method.traces} traces")
        G = ts.gamma
        # two extra leading rounds: the production scheduler's stale input
        rows = replay_rows(ts, R, T + 2, rng, turnover)
        k_all = ts.accepted[rows]
        z = ts.conf_logits[rows].astype(np.float64)
        t = np.ones(G) if temps is None or method.traces != "dspark" else np.asarray(temps, np.float64)
        a_all = np.cumprod(1.0 / (1.0 + np.exp(-z / t)), axis=-1)  # [T+2, R, G]
        a, a_stale, k = a_all[2:], a_all[:-2], k_all[2:]
        if method.kind == "fixed":
            gamma = G if method.gamma is None else min(method.gamma, G)
            l = np.full((T, R), gamma, np.int64)
            if method.skip == "acceptance":
                tab = prefix.make_table(cost["buckets"], t_verify=cost["t_verify"], t_draft=t_draft,
                                        skip_extra=float(table_np.skip_extra))
                best = _best_case_pays(R, table_np, t_draft, R * G, mode)
                skip, settled = _acceptance_rounds(k, gamma, best, R, tab, charge, probe_every, probe_max, mode)
            elif method.skip != "none":
                raise ValueError(f"method {method.name!r}: a fixed length skips by 'acceptance' only, "
                                 f"got {method.skip!r}")
        elif method.kind == "threshold":
            l = np.cumprod(a >= method.threshold, axis=-1).sum(-1)
        elif method.kind in SCHEDULED:

            # steady state: the round before the first drafted (as the production scheduler's
            # stale input, the leading rounds' survivals)
            skip, settled = _skip_rounds(method.skip, a, a_stale, R, t_draft, table_np, G, mode, charge,
                                         probe_every, probe_max, seed=a_all[1])
            if method.skip in ("known", "best_case"):  # as in the engine: skipped rounds leave no survivals
                a_stale = _carried_stale(a_all, skip)
            Rp = max(R_pad or R, R)
            tab = prefix.make_table(cost["buckets"], t_verify=cost["t_verify"], t_draft=t_draft,
                                    skip_extra=float(table_np.skip_extra))
            act = jnp.asarray(np.arange(Rp) < R)
            dk = jnp.int32(R * G)
            l = np.asarray(_sched_fn(method.kind, mode)(jnp.asarray(_pad_rows(a, Rp), jnp.float32),
                                                         jnp.asarray(_pad_rows(a_stale, Rp), jnp.float32),
                                                         act, tab, dk))[:, :R].astype(np.int64)
        else:
            raise ValueError(f"unknown method kind {method.kind!r}")
    drafted = np.full(T, method.kind != "ar")
    skips = method.kind in SCHEDULED or (method.kind == "fixed" and method.skip == "acceptance")
    if skips:
        drafted &= ~skip
        l = np.where(skip[:, None], 0, l)
    acc = np.minimum(k, l)
    B = np.sum(1 + l, axis=1)
    times = np.where(drafted, t_draft, 0.0) + _verify_cost(B, table_np, charge)
    if skips:
        # a skipped round keeps the drafter's context (`skipped_round_cost`) unless it is settled:
        # then it is the target-only step
        plain = np.where(settled, target_only_cost(cost, R, table_np, charge),
                         skipped_round_cost(cost, R, table_np, charge))
        times = np.where(drafted, times, plain)
    if method.kind == "ar":
        times = np.full(T, target_only_cost(cost, R, table_np, charge))
    tokens = np.sum(acc + 1, axis=1)
    total = float(tokens.sum() / times.sum()) if np.all(np.isfinite(times)) else float("nan")
    res = SimResult(method.name, R, total, total / R, float(np.mean(1 + l)), float(np.mean(acc + 1)),
                    float(1.0 - drafted.mean()), float(1e3 * times.mean()))
    if keep_rounds:
        res.rounds = {"lengths": l, "k": k, "accepted": acc, "B": B,
                      "times": times, "tokens": tokens, "drafted": drafted}
    return res


def _table_np(cost: dict):
    return prefix.make_table(cost["buckets"], t_verify=cost["t_verify"], t_draft=0.0, as_numpy=True,
                             skip_extra=skip_extra(cost))


def target_only_cost(cost: dict, R: int, table_np=None, charge: str = "interp") -> float:
    """Seconds of a target-only step at R requests: the table's `t_target_step` where it prices
    one at its own R (a predicted table), else verifying R tokens."""
    if "t_target_step" in cost and (cost.get("engine") or {}).get("num_slots") == R:
        return float(cost["t_target_step"])
    table_np = _table_np(cost) if table_np is None else table_np
    return float(_verify_cost(np.asarray([R]), table_np, charge)[0])


def skipped_round_cost(cost: dict, R: int, table_np=None, charge: str = "interp") -> float:
    """Seconds of a round that skips drafting at R requests, as the skip rule prices it
    (``prefix.plain_time``): verifying R tokens plus what a round without a draft costs beyond
    that (`costs.skip_extra`: from the table's `t_skip` where it has one, else no less than its
    target-only step, at the table's own R)."""
    table_np = _table_np(cost) if table_np is None else table_np
    return float(_plain_cost(np.asarray([R]), table_np, charge)[0])


def run_sweep(methods, concurrency, cost: dict, traces: dict, temps, **kw) -> list[SimResult]:
    Rp = max(concurrency)
    return [simulate_method(m, R, cost, traces, temps, R_pad=Rp, **kw) for m in methods for R in concurrency]


# ------------------------------------------------------------------ scheduled DSpark against target-only


def priced_concurrency(cost: dict, gamma: int = 7) -> list[int]:
    """The concurrencies R at which a table prices whole rounds of R requests: the active slots
    of every bucket it timed verifying no drafts (a measured table's `plan`: the round a
    target-only step or a skipped round of R requests runs); else the slot count it was made for
    (a predicted table prices R = `engine.num_slots`); else (a synthetic table) the powers of two
    whose full blocks, R (1 + gamma) tokens, fit its largest bucket."""
    plan = cost.get("plan")
    if plan:
        return sorted({int(p["active_slots"]) for p in plan if int(p["verify_len"]) == 0})
    slots = (cost.get("engine") or {}).get("num_slots")
    if slots:
        return [int(slots)]
    top = int(cost["buckets"][-1])
    return [2 ** i for i in range(16) if 2 ** i * (gamma + 1) <= top]


def versus_target_only(cost: dict, traces: dict, temps, concurrency, *, skip: str = "known",
                       **kw) -> list[dict]:
    """Scheduled DSpark (the production scheduler with skip rule `skip`, as the engine runs it)
    against target-only at each concurrency: one dict per R with both total throughputs, their
    ratio, the fraction of rounds that skipped drafting and the scheduled budget (1 + l).
    `kw`: `simulate_method`'s settings."""
    methods = (Method("target-only", "ar", None), Method("DSpark scheduled", "production", "dspark", skip=skip))
    out = []
    for r in concurrency:
        base, sched = (simulate_method(m, r, cost, traces, temps, R_pad=max(concurrency), **kw) for m in methods)
        out.append({"concurrency": int(r), "target_tps": base.total_tps, "scheduled_tps": sched.total_tps,
                    "ratio": sched.total_tps / base.total_tps, "skip_frac": sched.skip_frac, "budget": sched.budget})
    return out


def ratio_rows_markdown(rows: list[dict], profiles: list[str]) -> list[str]:
    """A markdown table of scheduled / target-only: one line per (table, concurrency), one column
    per acceptance profile (`rows`: dicts with "table", "origin", "concurrency", "profile",
    "ratio"), then one line per table with its worst point per profile; ratios below 1 in bold."""
    fmt = lambda v: f"{v:.3f}" if v >= 1.0 else f"**{v:.4f}**"  # below target-only: bold, one digit more
    cells: dict[tuple, dict[str, float]] = {}
    for r in rows:
        cells.setdefault((r["table"], r["origin"], r["concurrency"]), {})[r["profile"]] = r["ratio"]
    head = ["| table | origin | R | " + " | ".join(profiles) + " |", "|---|---|---|" + "---|" * len(profiles)]
    lines = head + [f"| {t} | {o} | {c} | " + " | ".join(fmt(v[p]) if p in v else "" for p in profiles) + " |"
                    for (t, o, c), v in cells.items()]
    worst: dict[tuple, dict[str, tuple[float, int]]] = {}
    for r in rows:
        w = worst.setdefault((r["table"], r["origin"]), {})
        if r["profile"] not in w or r["ratio"] < w[r["profile"]][0]:
            w[r["profile"]] = (r["ratio"], r["concurrency"])
    lines += ["", "Worst point of each table (ratio at R):", "",
              "| table | origin | " + " | ".join(profiles) + " |", "|---|---|" + "---|" * len(profiles)]
    lines += [f"| {t} | {o} | " + " | ".join(f"{fmt(w[p][0])} at {w[p][1]}" if p in w else "" for p in profiles)
              + " |" for (t, o), w in worst.items()]
    return lines


# ------------------------------------------------------------------ comparisons


def _curve(results, name):
    pts = sorted((r.concurrency, r.total_tps, r.per_user_tps) for r in results if r.method == name)
    return np.asarray([p[1] for p in pts]), np.asarray([p[2] for p in pts])


def matched_throughput(results, method: str, baseline: str) -> list[dict]:
    """For each baseline point, ``method``'s per-user speed at the same total throughput
    (log-log interpolation along its concurrency curve; best crossing) and the ratio."""
    tx, ux = _curve(results, method)
    out = []
    for R, tb, ub in sorted((r.concurrency, r.total_tps, r.per_user_tps) for r in results if r.method == baseline):
        best = None
        for i in range(len(tx) - 1):
            lo, hi = sorted((tx[i], tx[i + 1]))
            if lo <= tb <= hi and tx[i] != tx[i + 1]:
                w = (np.log(tb) - np.log(tx[i])) / (np.log(tx[i + 1]) - np.log(tx[i]))
                u = float(np.exp(np.log(ux[i]) + w * (np.log(ux[i + 1]) - np.log(ux[i]))))
                best = u if best is None else max(best, u)
        if best is not None:
            out.append({"baseline_concurrency": R, "total_tps": float(tb), "baseline_per_user": float(ub),
                        "per_user": best, "gain": best / ub - 1.0})
    return out


def headline(results, target_only: str = "target-only") -> dict:
    """Throughput relative to target-only at every concurrency, and its minimum per method."""
    base = {r.concurrency: r.total_tps for r in results if r.method == target_only}
    rel: dict[str, dict[int, float]] = {}
    for r in results:
        rel.setdefault(r.method, {})[r.concurrency] = r.total_tps / base[r.concurrency]
    R_max = max(base)
    return {"relative_to_target_only": rel, "at_max_concurrency": {m: v[R_max] for m, v in rel.items()},
            "min_over_concurrency": {m: min(v.values()) for m, v in rel.items()}, "max_concurrency": R_max}


# ------------------------------------------------------------------ outputs


def write_outputs(results, out_dir, title: str = "") -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "sweep.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method", "concurrency", "total_tokens_per_s", "per_user_tokens_per_s", "verify_budget_tokens",
                    "tau", "skip_frac", "round_ms"])
        for r in results:
            w.writerow([r.method, r.concurrency, f"{r.total_tps:.4g}", f"{r.per_user_tps:.4g}", f"{r.budget:.4g}",
                        f"{r.tau:.4g}", f"{r.skip_frac:.3f}", f"{r.round_ms:.4g}"])
    names = list(dict.fromkeys(r.method for r in results))
    fig, ax = plt.subplots(figsize=(7, 5))
    for n in names:
        pts = sorted((r.concurrency, r.total_tps, r.per_user_tps) for r in results if r.method == n)
        ax.plot([p[1] for p in pts], [p[2] for p in pts], marker="o", ms=3, label=n,
                ls="--" if n in ("target-only", "MTP-1") else "-")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("total throughput (tokens/s)")
    ax.set_ylabel("per-user speed (tokens/s)")
    ax.set_title((title + "\n" if title else "") + "points: concurrency 1 (left) ... max (right)", fontsize=8)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "throughput_vs_per_user.png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4))
    for n in names:
        pts = sorted((r.concurrency, r.budget) for r in results if r.method == n)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=3, label=n)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (requests)")
    ax.set_ylabel("verified tokens per request per round (1 + l)")
    ax.set_title(title, fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "budget_vs_concurrency.png", dpi=110)
    plt.close(fig)
    return {"csv": str(out / "sweep.csv"), "png": [str(out / "throughput_vs_per_user.png"),
                                                   str(out / "budget_vs_concurrency.png")]}


