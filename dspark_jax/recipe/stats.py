"""Accepted length tau over training seeds and prompts together: the bootstrap of a crossed design.

A variant is trained with S seeds and each drafter decodes the same P prompts; request (s, p)
has `accepted[s, p]` accepted drafts over `rounds[s, p]` rounds. A seed's tau is
(sum accepted + sum rounds) / sum rounds over its prompts; the variant's tau is the mean of its
seeds' taus (a seed is a unit of replication: each counts once, whatever its rounds).

Seeds and prompts are crossed, not nested: every seed decodes the same prompts, so a prompt that is
hard for one seed is hard for all of them. A replicate therefore draws the P prompts once, with
replacement, and that one draw is read by every seed it draws (S with replacement) and, in a ratio,
by both variants. Drawing prompts afresh for each drawn seed (as for prompts nested in seeds)
averages a prompt's repeated effect over independent draws and gives an interval too narrow by up
to the square root of the seed count (docs/study.md, "Intervals"). With one round per request the
replicate's variance is exactly var_seed / S + var_prompt / P + var_interaction / (S P), the three
the population variances of the grid's two-way decomposition (tests/recipe/test_stats.py).
"""

from __future__ import annotations

import numpy as np

__all__ = ["seed_taus", "crossed_samples", "crossed_bootstrap_tau", "crossed_bootstrap_ratio",
           "prompt_bootstrap_tau"]


def _check(accepted, rounds) -> tuple[np.ndarray, np.ndarray]:
    a, r = np.asarray(accepted, float), np.asarray(rounds, float)
    if a.ndim != 2 or a.shape != r.shape or 0 in a.shape:
        raise ValueError(f"accepted and rounds must be [seeds, prompts] arrays of the same non-empty shape, got "
                         f"{a.shape} and {r.shape}")
    return a, r


def _tau(a, r):
    """tau over the last axis (prompts)."""
    return (a.sum(-1) + r.sum(-1)) / np.maximum(r.sum(-1), 1.0)


def _replicates(a, r, seeds, prompts):
    """[n] replicated variant taus: drawn seeds [n, S] each read the replicate's prompts [n, P]."""
    rows, cols = seeds[..., None], prompts[:, None, :]
    return _tau(a[rows, cols], r[rows, cols]).mean(-1)


def seed_taus(accepted, rounds) -> np.ndarray:
    """[S]: each seed's tau over its prompts."""
    a, r = _check(accepted, rounds)
    return _tau(a, r)


def crossed_samples(accepted, rounds, n: int = 4000, seed: int = 0) -> np.ndarray:
    """[n] replicates of the variant's tau: P prompts drawn with replacement (indices [n, P], drawn
    first), then S seeds with replacement (indices [n, S]), every drawn seed reading the same
    prompts. Prompts are drawn first so that a variant whose seeds are identical replicates exactly
    what one seed alone gives."""
    a, r = _check(accepted, rounds)
    S, P = a.shape
    rng = np.random.default_rng(seed)
    pi = rng.integers(0, P, (n, P))
    si = rng.integers(0, S, (n, S))
    return _replicates(a, r, si, pi)


def crossed_bootstrap_tau(accepted, rounds, n: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """(mean over seeds of each seed's tau, 2.5 and 97.5 percentiles of the crossed bootstrap)."""
    boot = crossed_samples(accepted, rounds, n, seed)
    return float(seed_taus(accepted, rounds).mean()), float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))


def crossed_bootstrap_ratio(acc_a, rounds_a, acc_b, rounds_b, n: int = 4000,
                            seed: int = 0) -> tuple[float, float, float]:
    """tau_a / tau_b (each the mean of its seeds' taus) and its crossed 95 % interval.

    The two variants' seeds are independent replicates: each draws its own seeds. Both decode the
    same prompts, so one prompt draw per replicate is read by every seed of both (paired over
    prompts: a prompt's difficulty cancels in the ratio). Variants may have different seed counts."""
    a1, r1 = _check(acc_a, rounds_a)
    a2, r2 = _check(acc_b, rounds_b)
    if a1.shape[1] != a2.shape[1]:
        raise ValueError(f"a ratio needs both variants on the same prompts: {a1.shape[1]} and {a2.shape[1]} prompts")
    (S1, P), S2 = a1.shape, a2.shape[0]
    rng = np.random.default_rng(seed)
    pi = rng.integers(0, P, (n, P))
    s1 = rng.integers(0, S1, (n, S1))
    s2 = rng.integers(0, S2, (n, S2))
    boot = _replicates(a1, r1, s1, pi) / _replicates(a2, r2, s2, pi)
    est = _tau(a1, r1).mean() / _tau(a2, r2).mean()
    return float(est), float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))


def prompt_bootstrap_tau(accepted, rounds, n: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """The same statistic with the seeds held fixed: only the prompts are resampled (one draw shared
    by the seeds), so the interval says nothing about another training run."""
    a, r = _check(accepted, rounds)
    S, P = a.shape
    pi = np.random.default_rng(seed).integers(0, P, (n, P))
    boot = _replicates(a, r, np.broadcast_to(np.arange(S), (n, S)), pi)
    return float(_tau(a, r).mean()), float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))
