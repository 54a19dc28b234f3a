"""Hardware-aware prefix scheduler (docs/method.md §3 and §3.1).

Every scheduler is a jit-compiled JAX function (static shapes ``[R, G]``; mode / cost are
static strings, everything else traced). The tests compare each with a plain-loop numpy
reference of the same signature (``tests/scheduler/prefix_reference.py``).

Conventions
-----------
* ``a[r, j]`` = prefix survival of slot j of request r (verifying slot j = verifying j+1
  draft tokens). It is clipped to [0, 1] and made non-increasing along j (running min;
  a true cumulative product already is).
* ``active[r]``: inactive rows get ``l_r = 0`` and contribute nothing to ``B`` or ``tau``.
* Candidates are ``(r, j)`` of active rows with ``a > 0``, ordered by the key
  ``(-a, j, r)`` (stable; ties broken by smaller j, then smaller r). Because a is
  non-increasing in j, (r, j) always precedes (r, j+1) even when fp32 survival
  saturates at 1.0, so admitted sets are always prefixes.
* ``B = sum_r active_r (1 + l_r)``; ``tau = sum_r active_r (1 + sum_{j<l_r} a[r, j])``.
* Cost: :class:`CostTable` (sorted bucket sizes, measured ``T_verify`` per bucket, per-round
  ``T_draft``, and ``skip_extra``: what a round without a draft costs beyond ``T_verify`` of its
  tokens, so that plain decoding of n active slots costs ``plain_time(n) = T_verify(n) +
  skip_extra``). ``cost="interp"``: exact-B cost, linear interpolation between buckets
  (flat below the first bucket); ``cost="step"``: the cost of the smallest bucket >= B.
  ``B`` above the largest bucket is infeasible (``T_verify = inf``, ``Theta = 0``).
  ``mode="sps"``: ``Theta = tau * SPS(B) = tau / T_verify(B)`` (paper);
  ``mode="latency"``: ``Theta = tau / (T_draft + T_verify(B))``.
"""

from __future__ import annotations

import json
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "CostTable", "make_table", "save_table", "load_table",
    "prefix_survival", "verify_time", "theta", "bucket_index", "greedy_rank",
    "schedule_early_stop", "schedule_static", "capacity_from_stale", "schedule_production",
    "schedule_threshold", "schedule_fixed", "plain_time", "speculation_pays", "known_speculation_pays",
    "settled_no", "drafting_gain", "verdict", "Verdict", "SETTLE_Z", "running_survivals", "fixed_verdict",
    "RUNNING_DECAY", "RUNNING_MIN_ROWS",
]


class CostTable(NamedTuple):
    """Profiled verification cost (a pytree). buckets: int [NB] sorted ascending;
    t_verify: float [NB] seconds per target step at that bucket; t_draft: seconds per round;
    skip_extra: seconds a round without a draft costs beyond t_verify of the tokens it verifies
    (None: nothing beyond; see `plain_time`)."""

    buckets: jax.Array
    t_verify: jax.Array
    t_draft: jax.Array
    skip_extra: jax.Array | None = None


def make_table(buckets, t_verify=None, sps=None, t_draft=0.0, as_numpy=False, skip_extra=0.0) -> CostTable:
    """Build a table from per-bucket verify times or steps-per-second (``sps = 1/T_verify``).
    `skip_extra` (seconds, >= 0): what a round without a draft costs beyond ``T_verify`` of its
    tokens (`scheduler.costs.skip_extra` reads it from a cost file)."""
    b = np.asarray(buckets, np.int64)
    if t_verify is None:
        t_verify = 1.0 / np.asarray(sps, np.float64)
    tv = np.asarray(t_verify, np.float64)
    assert b.ndim == 1 and tv.shape == b.shape and np.all(np.diff(b) > 0), "buckets must be sorted, unique"
    assert float(skip_extra) >= 0.0, "skip_extra must be >= 0"
    if as_numpy:
        return CostTable(b, tv, np.float64(t_draft), np.float64(skip_extra))
    return CostTable(*jax.device_put((b.astype(np.int32), tv.astype(np.float32), np.float32(t_draft),
                                      np.float32(skip_extra))))


def save_table(path, table: CostTable) -> None:
    with open(path, "w") as f:
        json.dump({"buckets": np.asarray(table.buckets).tolist(),
                   "t_verify": np.asarray(table.t_verify, np.float64).tolist(),
                   "t_draft": float(table.t_draft),
                   "skip_extra": 0.0 if table.skip_extra is None else float(table.skip_extra)}, f, indent=1)


def load_table(path, as_numpy=False) -> CostTable:
    with open(path) as f:
        d = json.load(f)
    return make_table(d["buckets"], t_verify=d["t_verify"], t_draft=d["t_draft"], as_numpy=as_numpy,
                      skip_extra=d.get("skip_extra", 0.0))


# ----------------------------------------------------------------------------------------
# survival and cost model
# ----------------------------------------------------------------------------------------

@jax.jit
def prefix_survival(conf_logits, temperatures=None):
    """``a[r, j] = prod_{i<=j} sigmoid(z[r, i] / T_i)`` (T = 1 when temperatures is None)."""
    z = jnp.asarray(conf_logits, jnp.float32)
    if temperatures is not None:
        z = z / jnp.asarray(temperatures, jnp.float32)
    return jnp.cumprod(jax.nn.sigmoid(z), axis=-1)


def bucket_index(B, table: CostTable):
    """Index of the smallest bucket >= B (clipped to the last bucket)."""
    nb = table.buckets.shape[0]
    idx = jnp.searchsorted(table.buckets, jnp.asarray(B, table.buckets.dtype), side="left")
    return jnp.minimum(idx, nb - 1).astype(jnp.int32)


def holding_cost(table: CostTable):
    """Seconds to verify in each bucket's place: the cheapest bucket at least as large (the engine
    verifies a round's tokens in the cheapest compiled bucket that holds them, engine/round.py;
    on a TPU a larger bucket can be priced cheaper, e.g. one packed in place)."""
    return jax.lax.cummin(jnp.asarray(table.t_verify, jnp.float32), axis=0, reverse=True)


def verify_time(B, table: CostTable, cost: str = "interp"):
    b = jnp.asarray(B, jnp.float32)
    bk = table.buckets.astype(jnp.float32)
    tv = holding_cost(table)
    if cost == "interp":
        t = jnp.interp(b, bk, tv)
    elif cost == "step":
        t = tv[bucket_index(jnp.ceil(b).astype(table.buckets.dtype), table)]
    else:
        raise ValueError(f"unknown cost {cost!r}")
    return jnp.where(b > bk[-1], jnp.inf, t)


def plain_time(n, table: CostTable, cost: str = "interp"):
    """Seconds of a round that drafts nothing with n active slots (n tokens verified): what the
    skip rule weighs drafting against. ``T_verify(n)`` alone is not that price: a measured
    ``T_verify`` is a round minus the draft timed alone, and the draft alone costs more than it
    adds to a round, so the table's `skip_extra` (from the round without a draft, or the
    target-only step, priced at the table's slot count) is added."""
    t = verify_time(n, table, cost)
    return t if table.skip_extra is None else t + jnp.asarray(table.skip_extra, jnp.float32)


def theta(tau, B, table: CostTable, mode: str = "sps", cost: str = "interp"):
    """Expected throughput of a verification batch of B tokens with tau expected tokens."""
    tv = verify_time(B, table, cost)
    tau = jnp.asarray(tau, jnp.float32)
    if mode == "sps":
        return tau / tv
    if mode == "latency":
        return tau / (jnp.asarray(table.t_draft, jnp.float32) + tv)
    raise ValueError(f"unknown mode {mode!r}")


# ----------------------------------------------------------------------------------------
# greedy order
# ----------------------------------------------------------------------------------------

def _prep(a, active):
    a = jnp.clip(jnp.asarray(a, jnp.float32), 0.0, 1.0)
    a = jax.lax.cummin(a, axis=1)
    active = jnp.asarray(active, bool)
    cand = (a > 0.0) & active[:, None]
    return a, active, cand


def _order(a, cand):
    """Rank-ordered flat (j-major) positions, their survivals, count, and rank[R, G]."""
    R, G = a.shape
    key = jnp.where(cand, -a, 1.0).T.reshape(-1)  # j-major: stable sort => ties by j, then r
    order = jnp.argsort(key, stable=True)
    sorted_a = jnp.where(cand.T.reshape(-1)[order], a.T.reshape(-1)[order], 0.0)
    rank = jnp.zeros((R * G,), jnp.int32).at[order].set(jnp.arange(R * G, dtype=jnp.int32))
    return sorted_a, jnp.sum(cand).astype(jnp.int32), rank.reshape(G, R).T


def _lengths(rank, cand, n_admit):
    return jnp.sum((rank < n_admit) & cand, axis=1).astype(jnp.int32)


def _theta_path(sorted_a, n_active, table, mode, cost):
    """Theta_i for i = 0..M (admitting the i best candidates), i > n_cand not masked."""
    M = sorted_a.shape[0]
    i = jnp.arange(M + 1, dtype=jnp.float32)
    tau = n_active.astype(jnp.float32) + jnp.concatenate([jnp.zeros((1,)), jnp.cumsum(sorted_a)])
    return theta(tau, n_active.astype(jnp.float32) + i, table, mode, cost)


def _early_stop_n(sorted_a, n_cand, n_active, table, mode, cost):
    th = _theta_path(sorted_a, n_active, table, mode, cost)
    M = sorted_a.shape[0]
    improve = (th[1:] > th[:-1]) & (jnp.arange(1, M + 1) <= n_cand)
    return jnp.sum(jnp.cumprod(improve.astype(jnp.int32))).astype(jnp.int32)


def _global_n(sorted_a, n_cand, n_active, table, mode, cost):
    th = _theta_path(sorted_a, n_active, table, mode, cost)
    th = jnp.where(jnp.arange(th.shape[0]) <= n_cand, th, -jnp.inf)
    return jnp.argmax(th).astype(jnp.int32)  # first maximum


@jax.jit
def greedy_rank(a, active):
    """rank[r, j] of each slot in the admission order (non-candidates rank after all candidates)."""
    a, active, cand = _prep(a, active)
    return _order(a, cand)[2]


# ----------------------------------------------------------------------------------------
# Algorithm 1 (early stop). Its lossy variant, the argmax over all prefix throughputs instead of the
# early stop, lets a draft's own value decide whether it is verified; the tests keep it in tests/broken.py.
# ----------------------------------------------------------------------------------------

@partial(jax.jit, static_argnames=("mode", "cost"))
def schedule_early_stop(a, active, table: CostTable, mode="sps", cost="interp"):
    """Algorithm 1: admit in (-a, j, r) order, stop at the first Theta_i <= Theta_{i-1}. -> l[R]."""
    a, active, cand = _prep(a, active)
    sorted_a, n_cand, rank = _order(a, cand)
    n_act = jnp.sum(active).astype(jnp.int32)
    return _lengths(rank, cand, _early_stop_n(sorted_a, n_cand, n_act, table, mode, cost))


# ----------------------------------------------------------------------------------------
# static-shape variant (3.1)
# ----------------------------------------------------------------------------------------

@partial(jax.jit, static_argnames=("mode",))
def schedule_static(a, active, table: CostTable, mode="sps"):
    """Early stop on the interpolated table, round B up to its bucket, fill the free padded
    slots with the next candidates in the same order. -> (l[R], bucket_idx).

    Never exceeds the bucket. Requires ``sum(active) <= buckets[-1]``."""
    a, active, cand = _prep(a, active)
    sorted_a, n_cand, rank = _order(a, cand)
    n_act = jnp.sum(active).astype(jnp.int32)
    n = _early_stop_n(sorted_a, n_cand, n_act, table, mode, "interp")
    b_idx = bucket_index(n_act + n, table)
    n_total = jnp.clip(table.buckets[b_idx].astype(jnp.int32) - n_act, 0, n_cand)
    return _lengths(rank, cand, n_total), b_idx


# ----------------------------------------------------------------------------------------
# production variant: capacity from stale survivals, then top-K by current survival
# ----------------------------------------------------------------------------------------

@partial(jax.jit, static_argnames=("mode", "cost"))
def capacity_from_stale(a_stale, active, table: CostTable, mode="sps", cost="step"):
    """K = argmax_K Theta(top-K stale candidates) by a global search (no early stop), capped
    so that ``sum(active) + K <= buckets[-1]``."""
    a, active, cand = _prep(a_stale, active)
    sorted_a, n_cand, _ = _order(a, cand)
    n_act = jnp.sum(active).astype(jnp.int32)
    return _global_n(sorted_a, n_cand, n_act, table, mode, cost)


@partial(jax.jit, static_argnames=("mode", "cost"))
def schedule_production(a, active, a_stale, stale_valid, table: CostTable, default_k,
                        mode="sps", cost="step"):
    """Production scheduler. ``a_stale``: survivals from two rounds ago (any array of the same
    shape when ``stale_valid`` is False, e.g. the first two rounds, where ``K = default_k``).
    Admits the top-K current candidates in (-a, j, r) order; l_r <= G by construction.
    -> (l[R], bucket_idx, K)."""
    a, active, cand = _prep(a, active)
    sorted_a, n_cand, rank = _order(a, cand)
    n_act = jnp.sum(active).astype(jnp.int32)
    k = jnp.where(stale_valid, capacity_from_stale(a_stale, active, table, mode, cost),
                  jnp.asarray(default_k, jnp.int32))
    k = jnp.clip(k, 0, jnp.maximum(table.buckets[-1].astype(jnp.int32) - n_act, 0)).astype(jnp.int32)
    l = _lengths(rank, cand, k)
    return l, bucket_index(n_act + jnp.sum(l), table), k


# ----------------------------------------------------------------------------------------
# static threshold, fixed gamma, skip drafting
# ----------------------------------------------------------------------------------------

@jax.jit
def schedule_threshold(a, active, threshold):
    """Verify slot j iff a[r, i] >= threshold for all i <= j (prefix); inactive rows 0."""
    a = jnp.asarray(a, jnp.float32)
    ok = (a >= threshold) & jnp.asarray(active, bool)[:, None]
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


@partial(jax.jit, static_argnames=("G",))
def schedule_fixed(active, gamma, G):
    """Fixed-gamma verification: l_r = min(gamma, G) for active rows."""
    g = jnp.clip(jnp.asarray(gamma, jnp.int32), 0, G)
    return jnp.where(jnp.asarray(active, bool), g, 0).astype(jnp.int32)


@partial(jax.jit, static_argnames=("max_tokens", "mode", "cost"))
def speculation_pays(n_active, table: CostTable, max_tokens, mode="sps", cost="interp"):
    """Whether admitting any K in 1..max_tokens draft tokens, each with survival 1 (the best
    case), beats not drafting at all (``Theta_0 = n / plain_time(n)``, no draft time).
    False => skip drafting this round."""
    n = jnp.asarray(n_active, jnp.float32)
    th0 = n / plain_time(n, table, cost)
    k = jnp.arange(1, max_tokens + 1, dtype=jnp.float32)
    return jnp.any(theta(n + k, n + k, table, mode, cost) > th0)


SETTLE_Z = 2.0  # standard errors by which survivals must say "no" (or "yes") for the verdict to stand


def _token_se(a, active, n):
    """Relative standard error of the mean tokens the active slots' survivals promise (t_r = 1 +
    sum_j a_rj over the n active slots: sd(t) / (mean(t) sqrt(n))); 0 below two slots."""
    t = 1.0 + jnp.sum(a, axis=1)
    w = active.astype(jnp.float32)
    mean = jnp.sum(w * t) / jnp.maximum(n, 1.0)
    var = jnp.sum(w * (t - mean) ** 2) / jnp.maximum(n - 1.0, 1.0)
    return jnp.where(n >= 2.0, jnp.sqrt(var) / (mean * jnp.sqrt(jnp.maximum(n, 1.0))), 0.0)


class Verdict(NamedTuple):
    """What survivals say of drafting against plain decoding, from one pass over the admission
    counts K >= 1 (`verdict`)."""
    pays: jnp.ndarray  # some K beats plain decoding (rho > 1)
    settled_no: jnp.ndarray  # rho falls short of 1 by more than z standard errors (>= 2 slots)
    gain: jnp.ndarray  # seconds the best K saves against plain decoding of its tokens (negative: costs)
    low: jnp.ndarray  # `gain` with rho lowered by z standard errors: what the round may lose


def verdict(a_rows, active, table: CostTable, z=SETTLE_Z, mode="latency", cost="step") -> Verdict:
    """On survivals `a_rows`: the best admission count K >= 1 by throughput Theta_K (`mode`'s
    objective), rho = Theta_K / Theta_0 (Theta_0 = n / plain_time(n), no draft time), and from
    them every skip verdict (`Verdict`); the standard error is that of the tokens the survivals
    promise (over the n active slots, t_r = 1 + sum_j a_rj: sd(t) / (mean(t) sqrt(n)); none below
    two slots). gain = (rho - 1) t_K, t_K = tau_K / Theta_K the round's time; 0 without slots."""
    a, active, cand = _prep(a_rows, active)
    sorted_a, n_cand, _ = _order(a, cand)
    n_act = jnp.sum(active).astype(jnp.int32)
    n = n_act.astype(jnp.float32)
    th = _theta_path(sorted_a, n_act, table, mode, cost)
    i = jnp.arange(th.shape[0])
    masked = jnp.where((i >= 1) & (i <= n_cand), th, -jnp.inf)
    best = jnp.max(masked)
    plain = plain_time(n, table, cost)
    se = _token_se(a, active, n)
    kb = jnp.where(n_cand > 0, jnp.argmax(masked), 0)
    tau = n + jnp.concatenate([jnp.zeros((1,)), jnp.cumsum(sorted_a)])[kb]
    return _judged(n, tau, best, th[kb], plain, se, evidence=n, ok=n > 0.0, z=z)


def _judged(n, tau, best, th, plain, se, *, evidence, ok, z) -> Verdict:
    """The verdict on a round of `n` slots expecting `tau` tokens at throughput `th` (`best`: the
    best throughput over admission counts, -inf without one) against plain decoding's
    n / `plain`; a "no" settles on `evidence` of two (slots or rows) or more."""
    rho = best * plain / jnp.maximum(n, 1.0)
    t = tau / jnp.maximum(th, 1e-30)
    gain = tau * plain / jnp.maximum(n, 1.0) - t
    ok = ok & jnp.isfinite(gain)
    return Verdict(pays=ok & (best > n / plain), settled_no=ok & (evidence >= 2.0) & (1.0 - rho > z * se),
                   gain=jnp.where(ok, gain, 0.0), low=jnp.where(ok, gain - z * se * t, 0.0))


@partial(jax.jit, static_argnames=("mode", "cost"))
def known_speculation_pays(a_known, active, table: CostTable, mode="latency", cost="step"):
    """Whether, on survivals already known (an earlier round's), some admission count K >= 1
    beats not drafting (``Theta_0 = n / plain_time(n)``, no draft time). Deciding from the past
    only, it cannot bias the output; False => skip drafting this round."""
    return verdict(a_known, active, table, mode=mode, cost=cost).pays


@partial(jax.jit, static_argnames=("mode", "cost"))
def settled_no(a_fresh, active, table: CostTable, z=SETTLE_Z, mode="latency", cost="step"):
    """Whether fresh survivals (the round that just drafted) say no admission count K >= 1 beats
    not drafting by more than their sampling error, so that probing again at this load is not
    worth its draft: the best throughput on them relative to plain decoding, rho = max_K Theta_K
    / Theta_0, falls short of 1 by more than `z` standard errors of the tokens they promise
    (over the n active slots, t_r = 1 + sum_j a_rj: sd(t) / (mean(t) sqrt(n))). Never from fewer
    than two slots (one request's survivals say nothing of the next one's)."""
    return verdict(a_fresh, active, table, z, mode, cost).settled_no


@partial(jax.jit, static_argnames=("mode", "cost"))
def drafting_gain(a_rows, active, table: CostTable, z=SETTLE_Z, mode="latency", cost="step"):
    """(gain, low): on survivals `a_rows`, the seconds a round that drafts and admits the best
    count K >= 1 saves against plain decoding of the tokens it expects, ``gain = (rho - 1) t_K``
    (rho = Theta_K / Theta_0, t_K = tau_K / Theta_K the round's time by the objective `mode`;
    negative: what it costs), and that gain with rho lowered by `z` standard errors of the tokens
    the survivals promise (`settled_no`'s; none below two slots), ``low = gain - z se t_K``: what
    the round may lose. The "known" skip rule adds each drafted round's gain to a credit and drafts
    a round whose `low` is negative only while the credit covers it. 0 without active slots."""
    v = verdict(a_rows, active, table, z, mode, cost)
    return v.gain, v.low


# ----------------------------------------------------------------------------------------
# the running acceptance: survivals of a drafter without a confidence head
# ----------------------------------------------------------------------------------------

# the running counts' weight after each drafted round: about the last 50 drafted rows of a slot,
# enough for one slot's evidence to settle a "no" (`fixed_verdict`)
RUNNING_DECAY = 0.98
# rows of evidence before the "acceptance" rule decides on them: until then every round drafts (a
# first round's few rows, pulled towards 1/2 by the prior, would otherwise stop a drafter that pays
# before its own rounds could show it)
RUNNING_MIN_ROWS = 8.0


def running_survivals(counts):
    """Survivals from past rounds' acceptance, for a drafter without a confidence head.
    `counts` [2, G]: (decayed) rows at risk at draft position k (they verified k and accepted
    every draft before it) and rows whose draft at k was accepted -> (s [G], rows): the chance
    of accepting k given k - 1 accepted, (accepted_k + 1) / (at_risk_k + 2) (one accepted and
    one rejected draft of prior for each), multiplied up to k. Per-position priors alone would
    each add about 1 / (rows + 2) to the drafts a round expects, seven of them at gamma 7: half
    a draft a round promised by a drafter that never had one accepted. `rows`: the rows behind
    s_1, the weight of the evidence. Positions past the verified length are the caller's to cut
    (`fixed_verdict`)."""
    at_risk, accepted = counts[0], counts[1]
    return jnp.cumprod((accepted + 1.0) / (at_risk + 2.0), axis=0), at_risk[0]


def fixed_verdict(s, rows, n_active, gamma, table: CostTable, z=SETTLE_Z, mode="latency", cost="step") -> Verdict:
    """`verdict` for a round in which each of `n_active` slots verifies `gamma` drafts, on the
    survivals `s` [G] shared by all slots (`running_survivals`): tau = n (1 + sum_{k<=gamma} s_k)
    expected tokens from B = n (1 + gamma) verified, against plain decoding's n / plain_time(n).
    The standard error is that of the estimate: the accepted count's spread (P(X >= k) = s_k)
    over the `rows` behind it, relative to the tokens a row expects, so evidence gathered over
    rounds settles a "no" for one slot as well (from two rows on)."""
    s = jnp.clip(jnp.asarray(s, jnp.float32), 0.0, 1.0)
    n = jnp.asarray(n_active, jnp.float32)
    k = jnp.arange(1, s.shape[0] + 1, dtype=jnp.float32)
    s = jnp.where(k <= jnp.asarray(gamma, jnp.float32), s, 0.0)
    mean = jnp.sum(s)  # accepted drafts a row expects
    var = jnp.maximum(jnp.sum((2.0 * k - 1.0) * s) - mean ** 2, 0.0)
    se = jnp.where(rows >= 2.0, jnp.sqrt(var / jnp.maximum(rows, 1.0)) / (1.0 + mean), 0.0)
    tau = n * (1.0 + mean)
    th = theta(tau, n * (1.0 + jnp.asarray(gamma, jnp.float32)), table, mode, cost)
    return _judged(n, tau, th, th, plain_time(n, table, cost), se, evidence=rows,
                   ok=(n > 0.0) & (jnp.asarray(gamma) > 0), z=z)
