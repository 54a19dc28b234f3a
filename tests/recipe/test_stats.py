"""The hierarchical bootstrap of tau over seeds and prompts: equal to a plain numpy loop drawing
the same indices, the exact variance of the two-level resampling, wider than a prompt-only
bootstrap when seeds disagree, and one clear error for bad shapes."""

import numpy as np
import pytest

from dspark_jax.recipe.stats import (
    hier_bootstrap_ratio,
    hier_bootstrap_tau,
    hier_samples,
    prompt_bootstrap_tau,
    seed_taus,
)


def _data(S=3, P=40, offsets=(0.0, 0.0, 0.0), seed=0):
    rng = np.random.default_rng(seed)
    rounds = rng.integers(5, 30, (S, P)).astype(float)
    rate = np.clip(1.5 + np.asarray(offsets)[:, None] + 0.4 * rng.normal(size=(S, P)), 0.1, None)
    return np.round(rate * rounds), rounds


def _reference(acc, rounds, n, seed):
    """The two-level bootstrap written as loops: the same index draws, one replicate at a time."""
    S, P = acc.shape
    rng = np.random.default_rng(seed)
    si = rng.integers(0, S, (n, S))
    pi = rng.integers(0, P, (n, S, P))
    out = np.empty(n)
    for b in range(n):
        taus = []
        for k in range(S):
            s = si[b, k]
            a = sum(acc[s, pi[b, k, j]] for j in range(P))
            r = sum(rounds[s, pi[b, k, j]] for j in range(P))
            taus.append((a + r) / r)
        out[b] = np.mean(taus)
    return out


def test_matches_the_loop_reference():
    acc, rounds = _data(offsets=(0.0, 0.3, -0.2))
    got = hier_samples(acc, rounds, n=300, seed=7)
    np.testing.assert_allclose(got, _reference(acc, rounds, 300, 7), rtol=1e-12)
    tau, lo, hi = hier_bootstrap_tau(acc, rounds, n=300, seed=7)
    want = np.mean([(acc[s].sum() + rounds[s].sum()) / rounds[s].sum() for s in range(3)])
    assert tau == pytest.approx(want, rel=1e-12)
    np.testing.assert_allclose([lo, hi], np.percentile(got, [2.5, 97.5]), rtol=1e-12)
    np.testing.assert_allclose(seed_taus(acc, rounds), [(acc[s].sum() + rounds[s].sum()) / rounds[s].sum()
                                                        for s in range(3)])


def test_variance_is_the_two_level_formula():
    """With one round per request tau_s = 1 + mean_p acc[s, p], and the replicate's variance is
    exactly (var_s(m_s) + mean_s(v_s) / P) / S (m_s, v_s: seed s's mean and population variance).
    20000 replicates estimate it within about 1 % (standard error sqrt(2 / n)); the tolerance is
    6 %, over five standard errors."""
    rng = np.random.default_rng(3)
    S, P = 3, 25
    acc = rng.poisson(2.0, (S, P)).astype(float) + np.array([[0.0], [1.5], [3.0]])
    rounds = np.ones((S, P))
    boot = hier_samples(acc, rounds, n=20000, seed=1)
    m, v = acc.mean(1), acc.var(1)
    want = (m.var() + v.mean() / P) / S
    assert boot.var() == pytest.approx(want, rel=0.06)
    assert boot.mean() == pytest.approx(1 + m.mean(), abs=4 * np.sqrt(want / 20000))


def test_wider_than_prompt_only_when_seeds_disagree():
    acc, rounds = _data(offsets=(-0.5, 0.0, 0.5))
    _, lo_h, hi_h = hier_bootstrap_tau(acc, rounds, seed=0)
    _, lo_p, hi_p = prompt_bootstrap_tau(acc, rounds, seed=0)
    assert hi_h - lo_h > 2.0 * (hi_p - lo_p)
    # seeds that agree exactly: the seed level adds nothing (same distribution, up to Monte Carlo noise)
    same = np.repeat(acc[:1], 3, 0), np.repeat(rounds[:1], 3, 0)
    _, lo_h, hi_h = hier_bootstrap_tau(*same, seed=0)
    _, lo_p, hi_p = prompt_bootstrap_tau(*same, seed=0)
    assert hi_h - lo_h == pytest.approx(hi_p - lo_p, rel=0.15)


def test_ratio_pairs_prompts_and_resamples_each_variants_seeds():
    acc, rounds = _data(offsets=(0.0, 0.2, -0.1))
    r, lo, hi = hier_bootstrap_ratio(acc, rounds, acc, rounds, seed=0)
    assert r == pytest.approx(1.0) and lo < 1.0 < hi  # the same drafters: only the seed draws differ
    # loop reference of the paired draw: a's seeds, b's seeds, then prompts shared by the k-th seeds
    a2, r2 = _data(S=2, offsets=(0.4, 0.6), seed=5)
    n = 200
    rng = np.random.default_rng(4)
    s1, s2, pi = rng.integers(0, 3, (n, 3)), rng.integers(0, 2, (n, 2)), rng.integers(0, 40, (n, 3, 40))
    t = lambda a, rr, s, p: np.mean([(a[s[k], p[k]].sum() + rr[s[k], p[k]].sum()) / rr[s[k], p[k]].sum()
                                     for k in range(len(s))])
    want = [t(acc, rounds, s1[b], pi[b]) / t(a2, r2, s2[b], pi[b][:2]) for b in range(n)]
    _, lo, hi = hier_bootstrap_ratio(acc, rounds, a2, r2, n=n, seed=4)
    np.testing.assert_allclose([lo, hi], np.percentile(want, [2.5, 97.5]), rtol=1e-12)


def test_bad_shapes_are_one_clear_error():
    with pytest.raises(ValueError, match=r"\[seeds, prompts\]"):
        hier_bootstrap_tau(np.ones(5), np.ones(5))
    with pytest.raises(ValueError, match="same prompts"):
        hier_bootstrap_ratio(np.ones((2, 5)), np.ones((2, 5)), np.ones((2, 4)), np.ones((2, 4)))
