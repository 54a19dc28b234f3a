"""The crossed bootstrap of tau over seeds and prompts: equal to a plain loop drawing the same
indices, the exact variance of crossed resampling, identical seeds replicating one seed exactly (which
the nested scheme fails), wider than a prompt-only bootstrap when seeds disagree, and one clear
error for bad shapes."""

import numpy as np
import pytest

from dspark_jax.recipe.stats import (
    crossed_bootstrap_ratio,
    crossed_bootstrap_tau,
    crossed_samples,
    prompt_bootstrap_tau,
    seed_taus,
)


def _data(S=3, P=40, offsets=(0.0, 0.0, 0.0), seed=0):
    rng = np.random.default_rng(seed)
    rounds = rng.integers(5, 30, (S, P)).astype(float)
    rate = np.clip(1.5 + np.asarray(offsets)[:, None] + 0.4 * rng.normal(size=(S, P)), 0.1, None)
    return np.round(rate * rounds), rounds


def _loop_tau(acc, rounds, seeds, prompts):
    """The variant's tau for drawn seeds reading the drawn prompts, one request at a time."""
    taus = []
    for s in seeds:
        a = sum(acc[s, p] for p in prompts)
        r = sum(rounds[s, p] for p in prompts)
        taus.append((a + r) / r)
    return np.mean(taus)


def _reference(acc, rounds, n, seed):
    """The crossed bootstrap written as loops: prompts drawn once per replicate, then the seeds."""
    S, P = acc.shape
    rng = np.random.default_rng(seed)
    pi = rng.integers(0, P, (n, P))
    si = rng.integers(0, S, (n, S))
    return np.array([_loop_tau(acc, rounds, si[b], pi[b]) for b in range(n)])


def _nested_samples(acc, rounds, n, seed):
    """The nested scheme (prompts drawn afresh for every drawn seed): wrong for a crossed design."""
    S, P = acc.shape
    rng = np.random.default_rng(seed)
    si, pi = rng.integers(0, S, (n, S)), rng.integers(0, P, (n, S, P))
    rows = si[..., None]
    return ((acc[rows, pi].sum(-1) + rounds[rows, pi].sum(-1)) / rounds[rows, pi].sum(-1)).mean(-1)


def test_matches_the_loop_reference():
    acc, rounds = _data(offsets=(0.0, 0.3, -0.2))
    got = crossed_samples(acc, rounds, n=300, seed=7)
    np.testing.assert_allclose(got, _reference(acc, rounds, 300, 7), rtol=1e-12)
    tau, lo, hi = crossed_bootstrap_tau(acc, rounds, n=300, seed=7)
    want = np.mean([(acc[s].sum() + rounds[s].sum()) / rounds[s].sum() for s in range(3)])
    assert tau == pytest.approx(want, rel=1e-12)
    np.testing.assert_allclose([lo, hi], np.percentile(got, [2.5, 97.5]), rtol=1e-12)
    np.testing.assert_allclose(seed_taus(acc, rounds), [(acc[s].sum() + rounds[s].sum()) / rounds[s].sum()
                                                        for s in range(3)])


def test_identical_seeds_give_the_one_seed_interval_which_the_nested_scheme_does_not():
    """Three copies of one seed carry no more information than that seed: the crossed replicates
    equal the one-seed replicates draw for draw. The nested scheme averages three independent prompt
    draws and shrinks the interval by about sqrt(3)."""
    acc, rounds = _data(S=1, P=40, offsets=(0.0,))
    copies = np.repeat(acc, 3, 0), np.repeat(rounds, 3, 0)
    np.testing.assert_allclose(crossed_samples(*copies, n=2000, seed=3), crossed_samples(acc, rounds, n=2000, seed=3),
                               rtol=1e-12)
    np.testing.assert_allclose(crossed_bootstrap_tau(*copies, seed=3), crossed_bootstrap_tau(acc, rounds, seed=3),
                               rtol=1e-12)
    one = np.percentile(crossed_samples(acc, rounds, n=4000, seed=3), [2.5, 97.5])
    nested = np.percentile(_nested_samples(*copies, n=4000, seed=3), [2.5, 97.5])
    assert (nested[1] - nested[0]) / (one[1] - one[0]) == pytest.approx(1 / np.sqrt(3), rel=0.1)


def test_variance_is_the_crossed_formula():
    """With one round per request tau = 1 + the mean of acc over the drawn seeds x drawn prompts.
    Writing acc[s, p] = m + a_s + b_p + g_sp (the grid's two-way decomposition), the replicate's
    variance is exactly var(a) / S + var(b) / P + var(g) / (S P). 20000 replicates estimate it within
    about 1 % (standard error sqrt(2 / n)); the tolerance is 6 %, over five standard errors. The
    nested scheme's variance, (var(a) + (var(b) + var(g)) / P) / S, is a third lower on this grid."""
    rng = np.random.default_rng(3)
    S, P = 3, 25
    acc = (rng.poisson(2.0, (S, P)) + np.array([[0.0], [1.5], [3.0]]) + 4.0 * rng.normal(size=P)).astype(float)
    rounds = np.ones((S, P))
    m = acc.mean()
    a, b = acc.mean(1) - m, acc.mean(0) - m
    g = acc - m - a[:, None] - b[None, :]
    want = a.var() / S + b.var() / P + g.var() / (S * P)
    boot = crossed_samples(acc, rounds, n=20000, seed=1)
    assert boot.var() == pytest.approx(want, rel=0.06)
    assert boot.mean() == pytest.approx(1 + m, abs=4 * np.sqrt(want / 20000))
    nested = (a.var() + (b.var() + g.var()) / P) / S
    assert nested < 0.7 * want


def test_wider_than_prompt_only_when_seeds_disagree():
    acc, rounds = _data(offsets=(-0.5, 0.0, 0.5))
    _, lo_h, hi_h = crossed_bootstrap_tau(acc, rounds, seed=0)
    _, lo_p, hi_p = prompt_bootstrap_tau(acc, rounds, seed=0)
    assert hi_h - lo_h > 2.0 * (hi_p - lo_p)
    # seeds that agree exactly: the seed level adds nothing, draw for draw
    same = np.repeat(acc[:1], 3, 0), np.repeat(rounds[:1], 3, 0)
    np.testing.assert_allclose(crossed_bootstrap_tau(*same, seed=0), prompt_bootstrap_tau(*same, seed=0), rtol=1e-12)


def test_ratio_shares_one_prompt_draw_and_resamples_each_variants_seeds():
    acc, rounds = _data(offsets=(0.0, 0.2, -0.1))
    r, lo, hi = crossed_bootstrap_ratio(acc, rounds, acc, rounds, seed=0)
    assert r == pytest.approx(1.0) and lo < 1.0 < hi  # the same drafters: only the seed draws differ
    a2, r2 = _data(S=2, offsets=(0.4, 0.6), seed=5)
    n = 200
    rng = np.random.default_rng(4)
    pi, s1, s2 = rng.integers(0, 40, (n, 40)), rng.integers(0, 3, (n, 3)), rng.integers(0, 2, (n, 2))
    want = [_loop_tau(acc, rounds, s1[b], pi[b]) / _loop_tau(a2, r2, s2[b], pi[b]) for b in range(n)]
    _, lo, hi = crossed_bootstrap_ratio(acc, rounds, a2, r2, n=n, seed=4)
    np.testing.assert_allclose([lo, hi], np.percentile(want, [2.5, 97.5]), rtol=1e-12)
    # a variant whose every request's accepted + rounds is 1.2x the other's has tau 1.2x on any prompt
    # set: read by both, the shared prompt draw gives exactly 1.2, where separate draws would not
    b_acc, b_rounds = 1.2 * acc + 0.2 * rounds, rounds
    r, lo, hi = crossed_bootstrap_ratio(b_acc[:1], b_rounds[:1], acc[:1], rounds[:1], seed=0)
    np.testing.assert_allclose([r, lo, hi], 1.2, rtol=1e-12)


def test_bad_shapes_are_one_clear_error():
    with pytest.raises(ValueError, match=r"\[seeds, prompts\]"):
        crossed_bootstrap_tau(np.ones(5), np.ones(5))
    with pytest.raises(ValueError, match="same prompts"):
        crossed_bootstrap_ratio(np.ones((2, 5)), np.ones((2, 5)), np.ones((2, 4)), np.ones((2, 4)))
