"""The evaluation's statistics as pure numpy functions: tau with bootstrap intervals (alone, per
group, and the paired ratio of two drafters), conditional acceptance per draft position, and the
static-threshold replay."""

from __future__ import annotations

import numpy as np

from dspark_jax.calibration.sts import survival

__all__ = ["THRESHOLDS", "bootstrap_tau", "paired_tau_ratio", "conditional_acceptance", "conditional_support",
           "tau_by_group", "threshold_sweep"]

THRESHOLDS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def bootstrap_tau(accepted: np.ndarray, rounds: np.ndarray, n: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """tau = (sum accepted + sum rounds) / sum rounds over requests, and its 95 % percentile interval."""
    accepted, rounds = np.asarray(accepted, float), np.asarray(rounds, float)
    tau = (accepted.sum() + rounds.sum()) / max(rounds.sum(), 1.0)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(rounds), (n, len(rounds)))
    a, r = accepted[idx].sum(1), rounds[idx].sum(1)
    boot = (a + r) / np.maximum(r, 1.0)
    return float(tau), float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))


def paired_tau_ratio(acc_a, rounds_a, acc_b, rounds_b, n: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """tau_a / tau_b over the same requests, and its 95 % percentile interval from resampling the
    requests once for both (paired: the prompts' difficulty cancels in the ratio)."""
    acc_a, rounds_a, acc_b, rounds_b = (np.asarray(x, float) for x in (acc_a, rounds_a, acc_b, rounds_b))
    if not (len(acc_a) == len(rounds_a) == len(acc_b) == len(rounds_b)):
        raise ValueError("a paired ratio needs both drafters' totals on the same requests")
    tau = lambda a, r: (a.sum(-1) + r.sum(-1)) / np.maximum(r.sum(-1), 1.0)
    idx = np.random.default_rng(seed).integers(0, len(acc_a), (n, len(acc_a)))
    boot = tau(acc_a[idx], rounds_a[idx]) / tau(acc_b[idx], rounds_b[idx])
    return (float(tau(acc_a, rounds_a) / tau(acc_b, rounds_b)), float(np.percentile(boot, 2.5)),
            float(np.percentile(boot, 97.5)))


def conditional_acceptance(accepted: np.ndarray, length: np.ndarray, G: int) -> np.ndarray:
    """[G]: position k = j+1: #(accepted >= k) / #(accepted >= k-1 and length >= k)."""
    accepted, length = np.asarray(accepted), np.asarray(length)
    out = np.full((G,), np.nan)
    den = conditional_support(accepted, length, G)
    for k in range(1, G + 1):
        if den[k - 1]:
            out[k - 1] = np.sum(accepted >= k) / den[k - 1]
    return out


def conditional_support(accepted: np.ndarray, length: np.ndarray, G: int) -> np.ndarray:
    """[G] int: the denominators of `conditional_acceptance` (rounds that reached position k),
    so plots can tell a measured rate from one resting on a handful of rounds."""
    accepted, length = np.asarray(accepted), np.asarray(length)
    return np.asarray([int(np.sum((accepted >= k - 1) & (length >= k))) for k in range(1, G + 1)], np.int64)


def tau_by_group(accepted, rounds, groups, seed: int = 0) -> dict:
    """{label: {"tau", "ci95", "prompts"}} over the requests of each group label (in first-seen order)."""
    acc, rnd, g = np.asarray(accepted), np.asarray(rounds), np.asarray(groups)
    if not (len(acc) == len(rnd) == len(g)):
        raise ValueError(f"one group label per request needed: {len(g)} labels for {len(acc)} requests")
    out = {}
    for label in dict.fromkeys(g.tolist()):
        m = g == label
        t, lo, hi = bootstrap_tau(acc[m], rnd[m], seed=seed)
        out[label] = {"tau": t, "ci95": [lo, hi], "prompts": int(m.sum())}
    return out


def threshold_sweep(conf_logits, accepted, temps=None, thresholds=THRESHOLDS) -> list[dict]:
    """Static thresholds on prefix survival, replayed exactly on full-gamma rounds: a round
    verifying l drafts accepts min(k, l) of them when k were accepted at full gamma."""

    a = survival(conf_logits, temps)
    acc = np.asarray(accepted)
    rows = []
    for th in thresholds:
        l = np.sum(np.cumprod(a >= th, axis=1), axis=1)
        got = np.minimum(acc, l)
        rows.append({"threshold": float(th), "verified_per_round": float(l.mean()),
                     "accepted_share": float(got.sum() / max(l.sum(), 1)), "tau": float((got + 1).mean())})
    return rows
