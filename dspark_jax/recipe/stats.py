"""Accepted length tau over training seeds and prompts together: the hierarchical bootstrap.

A variant is trained with S seeds and each drafter decodes the same P prompts; request (s, p)
has `accepted[s, p]` accepted drafts over `rounds[s, p]` rounds. A seed's tau is
(sum accepted + sum rounds) / sum rounds over its prompts; the variant's tau is the mean of its
seeds' taus (a seed is a unit of replication: each counts once, whatever its rounds).

The interval resamples both levels: S seeds with replacement, then for each drawn seed P of its
prompts with replacement, and takes the 2.5 / 97.5 percentiles of the replicated statistic. A
prompt-only bootstrap (seeds fixed) is narrower when seeds disagree: it treats the seeds drawn as
the only ones there are.
"""

from __future__ import annotations

import numpy as np

__all__ = ["seed_taus", "hier_samples", "hier_bootstrap_tau", "hier_bootstrap_ratio", "prompt_bootstrap_tau"]


def _check(accepted, rounds) -> tuple[np.ndarray, np.ndarray]:
    a, r = np.asarray(accepted, float), np.asarray(rounds, float)
    if a.ndim != 2 or a.shape != r.shape or 0 in a.shape:
        raise ValueError(f"accepted and rounds must be [seeds, prompts] arrays of the same non-empty shape, got "
                         f"{a.shape} and {r.shape}")
    return a, r


def _tau(a, r):
    """tau over the last axis (prompts)."""
    return (a.sum(-1) + r.sum(-1)) / np.maximum(r.sum(-1), 1.0)


def seed_taus(accepted, rounds) -> np.ndarray:
    """[S]: each seed's tau over its prompts."""
    a, r = _check(accepted, rounds)
    return _tau(a, r)


def hier_samples(accepted, rounds, n: int = 4000, seed: int = 0) -> np.ndarray:
    """[n] replicates of the variant's tau: S seeds drawn with replacement (indices [n, S], drawn
    first), then P prompts with replacement for each drawn seed (indices [n, S, P])."""
    a, r = _check(accepted, rounds)
    S, P = a.shape
    rng = np.random.default_rng(seed)
    si = rng.integers(0, S, (n, S))
    pi = rng.integers(0, P, (n, S, P))
    rows = si[..., None]
    return _tau(a[rows, pi], r[rows, pi]).mean(-1)


def hier_bootstrap_tau(accepted, rounds, n: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """(mean over seeds of each seed's tau, 2.5 and 97.5 percentiles of the two-level bootstrap)."""
    boot = hier_samples(accepted, rounds, n, seed)
    return float(seed_taus(accepted, rounds).mean()), float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))


def hier_bootstrap_ratio(acc_a, rounds_a, acc_b, rounds_b, n: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """tau_a / tau_b (each the mean of its seeds' taus) and its two-level 95 % interval.

    The two variants' seeds are independent replicates: each draws its own seeds. Both decode the
    same prompts, so the k-th drawn seed of each reads the same resampled prompts (paired over
    prompts: a prompt's difficulty cancels in the ratio). Variants may have different seed counts;
    then the prompt draws of the larger count are shared by the smaller one's first seeds."""
    a1, r1 = _check(acc_a, rounds_a)
    a2, r2 = _check(acc_b, rounds_b)
    if a1.shape[1] != a2.shape[1]:
        raise ValueError(f"a ratio needs both variants on the same prompts: {a1.shape[1]} and {a2.shape[1]} prompts")
    (S1, P), S2 = a1.shape, a2.shape[0]
    rng = np.random.default_rng(seed)
    s1 = rng.integers(0, S1, (n, S1))
    s2 = rng.integers(0, S2, (n, S2))
    pi = rng.integers(0, P, (n, max(S1, S2), P))
    t1 = _tau(a1[s1[..., None], pi[:, :S1]], r1[s1[..., None], pi[:, :S1]]).mean(-1)
    t2 = _tau(a2[s2[..., None], pi[:, :S2]], r2[s2[..., None], pi[:, :S2]]).mean(-1)
    boot = t1 / t2
    est = _tau(a1, r1).mean() / _tau(a2, r2).mean()
    return float(est), float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))


def prompt_bootstrap_tau(accepted, rounds, n: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """The same statistic with the seeds held fixed: only prompts are resampled (within each seed)."""
    a, r = _check(accepted, rounds)
    S, P = a.shape
    pi = np.random.default_rng(seed).integers(0, P, (n, S, P))
    rows = np.arange(S)[None, :, None]
    boot = _tau(a[rows, pi], r[rows, pi]).mean(-1)
    return float(_tau(a, r).mean()), float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))
