"""Numpy references of the prefix scheduler (`dspark_jax.scheduler.prefix`): plain loops in
float64, one per compiled JAX function and with its signature, that the tests compare the
compiled versions with. The conventions (candidate order, B, tau, Theta, cost modes) are the
ones in prefix.py's module docstring. `schedule_retroactive_lossy_np` is the reference of
`schedule_retroactive_lossy`, the deliberately lossy variant the tests inject (Algorithm 1
without its early stop).
"""

from __future__ import annotations

import numpy as np

from dspark_jax.scheduler.prefix import CostTable

__all__ = [
    "prefix_survival_np", "bucket_index_np", "verify_time_np", "theta_np", "greedy_rank_np",
    "schedule_early_stop_np", "schedule_retroactive_lossy_np", "schedule_static_np", "capacity_from_stale_np",
    "schedule_production_np", "schedule_threshold_np", "plain_time_np", "speculation_pays_np",
    "known_speculation_pays_np", "settled_no_np", "running_survivals_np", "fixed_verdict_np",
]


# ----------------------------------------------------------------------------------------
# survival and cost model
# ----------------------------------------------------------------------------------------

def prefix_survival_np(conf_logits, temperatures=None):
    z = np.asarray(conf_logits, np.float64)
    if temperatures is not None:
        z = z / np.asarray(temperatures, np.float64)
    return np.cumprod(1.0 / (1.0 + np.exp(-z)), axis=-1)


def bucket_index_np(B, table: CostTable):
    for i, b in enumerate(np.asarray(table.buckets)):
        if B <= b:
            return i
    return len(table.buckets) - 1


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


def plain_time_np(n, table: CostTable, cost: str = "interp"):
    """A round that drafts nothing at n active slots: T_verify(n) plus the table's skip_extra."""
    extra = 0.0 if table.skip_extra is None else float(table.skip_extra)
    return verify_time_np(n, table, cost) + extra


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
# Algorithm 1 (early stop) and its lossy retroactive variant
# ----------------------------------------------------------------------------------------

def _early_stop_np(a, active, table, mode, cost, retro=False):
    """`retro`: argmax over all prefixes (the lossy variant) instead of the early stop."""
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


def schedule_retroactive_lossy_np(a, active, table: CostTable, mode="sps", cost="interp"):
    return _early_stop_np(a, active, table, mode, cost, retro=True)[0]


# ----------------------------------------------------------------------------------------
# static-shape variant (docs/method.md §3.1)
# ----------------------------------------------------------------------------------------

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

def capacity_from_stale_np(a_stale, active, table: CostTable, mode="sps", cost="step"):
    return _early_stop_np(a_stale, active, table, mode, cost, retro=True)[3]


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
# static threshold, skip drafting
# ----------------------------------------------------------------------------------------

def schedule_threshold_np(a, active, threshold):
    a = np.asarray(a)
    l = np.zeros(a.shape[0], np.int64)
    for r in range(a.shape[0]):
        if active[r]:
            while l[r] < a.shape[1] and a[r, l[r]] >= threshold:
                l[r] += 1
    return l


def speculation_pays_np(n_active, table: CostTable, max_tokens, mode="sps", cost="interp"):
    th0 = n_active / plain_time_np(n_active, table, cost)
    return any(theta_np(n_active + k, n_active + k, table, mode, cost) > th0
               for k in range(1, max_tokens + 1))


def known_speculation_pays_np(a_known, active, table: CostTable, mode="latency", cost="step"):
    a, c = _cands_np(a_known, active)
    n = int(np.sum(np.asarray(active, bool)))
    th0 = n / plain_time_np(n, table, cost)
    tau, best = float(n), -np.inf
    for i, (na, _, _) in enumerate(c, start=1):
        tau -= na
        best = max(best, theta_np(tau, n + i, table, mode, cost))
    return bool(best > th0)


def settled_no_np(a_fresh, active, table: CostTable, z=2.0, mode="latency", cost="step"):
    a, c = _cands_np(a_fresh, active)
    act = np.asarray(active, bool)
    n = int(act.sum())
    if n < 2:
        return False
    tau, best = float(n), -np.inf
    for i, (na, _, _) in enumerate(c, start=1):
        tau -= na
        best = max(best, theta_np(tau, n + i, table, mode, cost))
    rho = best / (n / plain_time_np(n, table, cost))
    t = 1.0 + a[act].sum(axis=1)
    se = t.std(ddof=1) / (t.mean() * np.sqrt(n))
    return bool(1.0 - rho > z * se)


def running_survivals_np(counts):
    at_risk, accepted = (np.asarray(c, np.float64) for c in counts)
    s, prod = [], 1.0
    for n, a in zip(at_risk, accepted):
        prod *= (a + 1.0) / (n + 2.0)
        s.append(prod)
    return np.asarray(s), float(at_risk[0])


def fixed_verdict_np(s, rows, n, gamma, table: CostTable, z=2.0, mode="latency", cost="step"):
    """(pays, settled_no, gain) of a round where n slots each verify gamma drafts, survivals s."""
    if n == 0 or gamma == 0:
        return False, False, 0.0
    s = [float(x) if k < gamma else 0.0 for k, x in enumerate(s)]
    # the accepted count X per row: P(X = k) = s_k - s_{k+1} (s_0 = 1)
    ext = [1.0, *s, 0.0]
    p = [ext[k] - ext[k + 1] for k in range(len(s) + 1)]
    mean = sum(k * pk for k, pk in enumerate(p))
    var = sum((k - mean) ** 2 * pk for k, pk in enumerate(p))
    tau = n * (1.0 + mean)
    th = theta_np(tau, n * (1 + gamma), table, mode, cost)
    plain = plain_time_np(n, table, cost)
    th0 = n / plain
    gain = tau / th0 - tau / th
    se = np.sqrt(var / rows) / (1.0 + mean) if rows >= 2 else 0.0
    return bool(th > th0), bool(rows >= 2 and 1.0 - th / th0 > z * se), float(gain)
