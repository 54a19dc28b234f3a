"""Hardware-aware prefix scheduler (docs/method.md §3 and §3.1).

Every scheduler exists twice with the same signature: a plain-loop numpy version
(``*_np``, the readable reference, host-side) and a jit-compiled JAX version (static
shapes ``[R, G]``; mode / cost are static strings, everything else traced).

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
  ``T_draft``). ``cost="interp"``: exact-B cost, linear interpolation between buckets
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
    "prefix_survival", "prefix_survival_np",
    "verify_time", "verify_time_np", "theta", "theta_np", "bucket_index", "bucket_index_np",
    "greedy_rank", "greedy_rank_np",
    "schedule_early_stop", "schedule_early_stop_np",
    "schedule_static", "schedule_static_np",
    "capacity_from_stale", "capacity_from_stale_np",
    "schedule_production", "schedule_production_np",
    "schedule_threshold", "schedule_threshold_np",
    "schedule_fixed", "schedule_fixed_np",
    "speculation_pays", "speculation_pays_np",
    "known_speculation_pays", "known_speculation_pays_np",
]


class CostTable(NamedTuple):
    """Profiled verification cost (a pytree). buckets: int [NB] sorted ascending;
    t_verify: float [NB] seconds per target step at that bucket; t_draft: seconds per round."""

    buckets: jax.Array
    t_verify: jax.Array
    t_draft: jax.Array


def make_table(buckets, t_verify=None, sps=None, t_draft=0.0, as_numpy=False) -> CostTable:
    """Build a table from per-bucket verify times or steps-per-second (``sps = 1/T_verify``)."""
    b = np.asarray(buckets, np.int64)
    if t_verify is None:
        t_verify = 1.0 / np.asarray(sps, np.float64)
    tv = np.asarray(t_verify, np.float64)
    assert b.ndim == 1 and tv.shape == b.shape and np.all(np.diff(b) > 0), "buckets must be sorted, unique"
    if as_numpy:
        return CostTable(b, tv, np.float64(t_draft))
    return CostTable(jnp.asarray(b, jnp.int32), jnp.asarray(tv, jnp.float32), jnp.asarray(t_draft, jnp.float32))


def save_table(path, table: CostTable) -> None:
    with open(path, "w") as f:
        json.dump({"buckets": np.asarray(table.buckets).tolist(),
                   "t_verify": np.asarray(table.t_verify, np.float64).tolist(),
                   "t_draft": float(table.t_draft)}, f, indent=1)


def load_table(path, as_numpy=False) -> CostTable:
    with open(path) as f:
        d = json.load(f)
    return make_table(d["buckets"], t_verify=d["t_verify"], t_draft=d["t_draft"], as_numpy=as_numpy)


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


def prefix_survival_np(conf_logits, temperatures=None):
    z = np.asarray(conf_logits, np.float64)
    if temperatures is not None:
        z = z / np.asarray(temperatures, np.float64)
    return np.cumprod(1.0 / (1.0 + np.exp(-z)), axis=-1)


def bucket_index(B, table: CostTable):
    """Index of the smallest bucket >= B (clipped to the last bucket)."""
    nb = table.buckets.shape[0]
    idx = jnp.searchsorted(table.buckets, jnp.asarray(B, table.buckets.dtype), side="left")
    return jnp.minimum(idx, nb - 1).astype(jnp.int32)


def bucket_index_np(B, table: CostTable):
    for i, b in enumerate(np.asarray(table.buckets)):
        if B <= b:
            return i
    return len(table.buckets) - 1


def verify_time(B, table: CostTable, cost: str = "interp"):
    b = jnp.asarray(B, jnp.float32)
    bk = table.buckets.astype(jnp.float32)
    tv = jnp.asarray(table.t_verify, jnp.float32)
    if cost == "interp":
        t = jnp.interp(b, bk, tv)
    elif cost == "step":
        t = tv[bucket_index(jnp.ceil(b).astype(table.buckets.dtype), table)]
    else:
        raise ValueError(f"unknown cost {cost!r}")
    return jnp.where(b > bk[-1], jnp.inf, t)


def verify_time_np(B, table: CostTable, cost: str = "interp"):
    bk = np.asarray(table.buckets, np.float64)
    tv = np.asarray(table.t_verify, np.float64)
    if B > bk[-1]:
        return np.inf
    if cost == "step":
        return tv[bucket_index_np(B, table)]
    if cost != "interp":
        raise ValueError(f"unknown cost {cost!r}")
    if B <= bk[0]:
        return tv[0]
    i = int(np.searchsorted(bk, B, side="left"))  # bk[i-1] < B <= bk[i]
    w = (B - bk[i - 1]) / (bk[i] - bk[i - 1])
    return tv[i - 1] + w * (tv[i] - tv[i - 1])


def theta(tau, B, table: CostTable, mode: str = "sps", cost: str = "interp"):
    """Expected throughput of a verification batch of B tokens with tau expected tokens."""
    tv = verify_time(B, table, cost)
    tau = jnp.asarray(tau, jnp.float32)
    if mode == "sps":
        return tau / tv
    if mode == "latency":
        return tau / (jnp.asarray(table.t_draft, jnp.float32) + tv)
    raise ValueError(f"unknown mode {mode!r}")


def theta_np(tau, B, table: CostTable, mode: str = "sps", cost: str = "interp"):
    tv = verify_time_np(B, table, cost)
    if mode == "sps":
        return tau / tv
    if mode == "latency":
        return tau / (float(table.t_draft) + tv)
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


def _cands_np(a, active):
    a = np.clip(np.asarray(a, np.float64), 0.0, 1.0)
    a = np.minimum.accumulate(a, axis=1)
    R, G = a.shape
    c = [(-a[r, j], j, r) for r in range(R) for j in range(G) if active[r] and a[r, j] > 0]
    c.sort()
    return a, c


def greedy_rank_np(a, active):
    a, c = _cands_np(a, active)
    R, G = a.shape
    rank = np.full((R, G), R * G, np.int64)
    for i, (_, j, r) in enumerate(c):
        rank[r, j] = i
    return rank


# ----------------------------------------------------------------------------------------
# Algorithm 1 (early stop); its lossy retroactive variant is in dspark_jax.testing.broken
# ----------------------------------------------------------------------------------------

@partial(jax.jit, static_argnames=("mode", "cost"))
def schedule_early_stop(a, active, table: CostTable, mode="sps", cost="interp"):
    """Algorithm 1: admit in (-a, j, r) order, stop at the first Theta_i <= Theta_{i-1}. -> l[R]."""
    a, active, cand = _prep(a, active)
    sorted_a, n_cand, rank = _order(a, cand)
    n_act = jnp.sum(active).astype(jnp.int32)
    return _lengths(rank, cand, _early_stop_n(sorted_a, n_cand, n_act, table, mode, cost))


def _early_stop_np(a, active, table, mode, cost, retro=False):
    """`retro`: argmax over all prefixes (the lossy variant, testing.broken) instead of the early stop."""
    a, c = _cands_np(a, active)
    n_act = int(np.sum(np.asarray(active, bool)))
    B, tau = n_act, float(n_act)
    th = theta_np(tau, B, table, mode, cost)
    best_n, best_th, n = 0, th, 0
    for (na, _, _) in c:
        B, tau = B + 1, tau - na
        th1 = theta_np(tau, B, table, mode, cost)
        n += 1
        if retro:
            if th1 > best_th:
                best_n, best_th = n, th1
        else:
            if th1 <= th:
                break
            best_n = n
        th = th1
    l = np.zeros(a.shape[0], np.int64)
    for (_, _, r) in c[:best_n]:
        l[r] += 1
    return l, c, n_act, best_n


def schedule_early_stop_np(a, active, table: CostTable, mode="sps", cost="interp"):
    return _early_stop_np(a, active, table, mode, cost)[0]


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


def schedule_static_np(a, active, table: CostTable, mode="sps"):
    _, c, n_act, n = _early_stop_np(a, active, table, mode, "interp")
    b_idx = bucket_index_np(n_act + n, table)
    n_total = int(np.clip(int(np.asarray(table.buckets)[b_idx]) - n_act, 0, len(c)))
    l = np.zeros(np.asarray(a).shape[0], np.int64)
    for (_, _, r) in c[:n_total]:
        l[r] += 1
    return l, b_idx


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


def capacity_from_stale_np(a_stale, active, table: CostTable, mode="sps", cost="step"):
    return _early_stop_np(a_stale, active, table, mode, cost, retro=True)[3]


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


def schedule_production_np(a, active, a_stale, stale_valid, table: CostTable, default_k,
                           mode="sps", cost="step"):
    _, c = _cands_np(a, active)
    n_act = int(np.sum(np.asarray(active, bool)))
    k = capacity_from_stale_np(a_stale, active, table, mode, cost) if stale_valid else int(default_k)
    k = int(np.clip(k, 0, max(int(np.asarray(table.buckets)[-1]) - n_act, 0)))
    l = np.zeros(np.asarray(a).shape[0], np.int64)
    for (_, _, r) in c[:k]:
        l[r] += 1
    return l, bucket_index_np(n_act + int(l.sum()), table), k


# ----------------------------------------------------------------------------------------
# static threshold, fixed gamma, skip drafting
# ----------------------------------------------------------------------------------------

@jax.jit
def schedule_threshold(a, active, threshold):
    """Verify slot j iff a[r, i] >= threshold for all i <= j (prefix); inactive rows 0."""
    a = jnp.asarray(a, jnp.float32)
    ok = (a >= threshold) & jnp.asarray(active, bool)[:, None]
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def schedule_threshold_np(a, active, threshold):
    a = np.asarray(a)
    l = np.zeros(a.shape[0], np.int64)
    for r in range(a.shape[0]):
        if active[r]:
            while l[r] < a.shape[1] and a[r, l[r]] >= threshold:
                l[r] += 1
    return l


@partial(jax.jit, static_argnames=("G",))
def schedule_fixed(active, gamma, G):
    """Fixed-gamma verification: l_r = min(gamma, G) for active rows."""
    g = jnp.clip(jnp.asarray(gamma, jnp.int32), 0, G)
    return jnp.where(jnp.asarray(active, bool), g, 0).astype(jnp.int32)


def schedule_fixed_np(active, gamma, G):
    return np.where(np.asarray(active, bool), min(max(int(gamma), 0), G), 0)


@partial(jax.jit, static_argnames=("max_tokens", "mode", "cost"))
def speculation_pays(n_active, table: CostTable, max_tokens, mode="sps", cost="interp"):
    """Whether admitting any K in 1..max_tokens draft tokens, each with survival 1 (the best
    case), beats not drafting at all (``Theta_0 = n / T_verify(n)``, no draft time).
    False => skip drafting this round."""
    n = jnp.asarray(n_active, jnp.float32)
    th0 = n / verify_time(n, table, cost)
    k = jnp.arange(1, max_tokens + 1, dtype=jnp.float32)
    return jnp.any(theta(n + k, n + k, table, mode, cost) > th0)


def speculation_pays_np(n_active, table: CostTable, max_tokens, mode="sps", cost="interp"):
    th0 = n_active / verify_time_np(n_active, table, cost)
    return any(theta_np(n_active + k, n_active + k, table, mode, cost) > th0
               for k in range(1, max_tokens + 1))


@partial(jax.jit, static_argnames=("mode", "cost"))
def known_speculation_pays(a_known, active, table: CostTable, mode="latency", cost="step"):
    """Whether, on survivals already known (an earlier round's), some admission count K >= 1
    beats not drafting (``Theta_0 = n / T_verify(n)``, no draft time). Deciding from the past
    only, it cannot bias the output; False => skip drafting this round."""
    a, active, cand = _prep(a_known, active)
    sorted_a, n_cand, _ = _order(a, cand)
    n_act = jnp.sum(active).astype(jnp.int32)
    th = _theta_path(sorted_a, n_act, table, mode, cost)
    th = jnp.where((jnp.arange(th.shape[0]) >= 1) & (jnp.arange(th.shape[0]) <= n_cand), th, -jnp.inf)
    n = n_act.astype(jnp.float32)
    return jnp.max(th) > n / verify_time(n, table, cost)


def known_speculation_pays_np(a_known, active, table: CostTable, mode="latency", cost="step"):
    a, c = _cands_np(a_known, active)
    n = int(np.sum(np.asarray(active, bool)))
    th0 = n / verify_time_np(n, table, cost)
    tau, best = float(n), -np.inf
    for i, (na, _, _) in enumerate(c, start=1):
        tau -= na
        best = max(best, theta_np(tau, n + i, table, mode, cost))
    return bool(best > th0)
