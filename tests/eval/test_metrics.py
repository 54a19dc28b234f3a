"""The evaluation's statistics (eval/metrics.py) against hand-computed values and numpy references."""

import numpy as np
import pytest

from dspark_jax.eval.metrics import (
    bootstrap_tau,
    conditional_acceptance,
    conditional_support,
    fixed_length_sweep,
    fixed_verified_at,
    paired_tau_ratio,
    tau_by_group,
    threshold_sweep,
)


def test_conditional_acceptance_by_hand():
    # rounds: (accepted, verified length)
    acc = np.array([0, 1, 2, 2, 3])
    length = np.array([3, 3, 3, 2, 3])
    ca = conditional_acceptance(acc, length, 3)
    # k=1: #(acc>=1)=4 / #(acc>=0 & l>=1)=5; k=2: #(acc>=2)=3 / #(acc>=1 & l>=2)=4;
    # k=3: #(acc>=3)=1 / #(acc>=2 & l>=3)=2 (the round verified at length 2 cannot count)
    np.testing.assert_allclose(ca, [0.8, 0.75, 0.5])
    np.testing.assert_array_equal(conditional_support(acc, length, 3), [5, 4, 2])


def test_tau_by_group_splits_requests():
    acc, rounds = np.array([4, 0, 2, 0]), np.array([2, 2, 2, 2])
    out = tau_by_group(acc, rounds, ["a", "b", "a", "b"])
    assert list(out) == ["a", "b"]
    assert out["a"]["tau"] == (6 + 4) / 4 and out["b"]["tau"] == 1.0 and out["a"]["prompts"] == 2
    with pytest.raises(ValueError, match="one group label per request"):
        tau_by_group(acc, rounds, ["a"])


def test_threshold_sweep_replays_prefixes():
    z = np.array([[10.0, 10.0, -10.0], [10.0, -10.0, 10.0]])  # survival ~ [1,1,0], [1,0,0]
    acc = np.array([3, 1])
    rows = {r["threshold"]: r for r in threshold_sweep(z, acc, thresholds=(0.0, 0.5))}
    assert rows[0.0]["verified_per_round"] == 3 and rows[0.0]["tau"] == 3.0  # (3+1 + 1+1) / 2
    # threshold 0.5 verifies 2 and 1 drafts, accepting min(3,2)=2 and min(1,1)=1: share 3/3, tau 2.5
    assert rows[0.5]["verified_per_round"] == 1.5
    assert rows[0.5]["accepted_share"] == 1.0 and rows[0.5]["tau"] == 2.5


def test_fixed_lengths_and_the_verified_tokens_at_equal_tau():
    """Rounds accepting 3 and 1 of 3 at full length: length 1 gives tau 2, length 2 gives 2.5,
    length 3 gives 3. The threshold replay above reaches tau 2.5 verifying 1.5 a round, where
    fixed lengths need 2 (a confidence head that earns its keep); tau 2.25 needs a half-and-half
    mixture of lengths 1 and 2 (1.5 verified)."""
    fixed = fixed_length_sweep(np.array([3, 1]), 3)
    assert [(r["length"], r["tau"]) for r in fixed] == [(1, 2.0), (2, 2.5), (3, 3.0)]
    assert fixed_verified_at(2.5, fixed) == 2.0 and fixed_verified_at(2.25, fixed) == 1.5
    assert fixed_verified_at(1.0, fixed) == 0.0 and fixed_verified_at(1.5, fixed) == 0.5
    assert np.isnan(fixed_verified_at(3.1, fixed))
    # a flat stretch (length 2 already accepts everything): the shortest length reaching tau counts
    flat = fixed_length_sweep(np.array([2, 2]), 3)
    assert fixed_verified_at(3.0, flat) == 2.0


def test_bootstrap_tau_interval_contains_estimate_and_shrinks():
    rng = np.random.default_rng(0)
    rounds = rng.integers(5, 20, 400)
    acc = rng.binomial(rounds * 3, 0.5)
    tau, lo, hi = bootstrap_tau(acc, rounds)
    assert lo < tau < hi
    _, lo2, hi2 = bootstrap_tau(acc[:40], rounds[:40])
    assert hi2 - lo2 > hi - lo


def test_paired_ratio_cancels_prompt_difficulty():
    """Two drafters on prompts of very different difficulty, B accepting exactly 0.8 x A's drafts per
    round on every prompt: the paired interval is tight around A / B's tau ratio; resampling the
    drafters' prompts apart (the broken, unpaired variant) gives a far wider one."""
    rng = np.random.default_rng(0)
    rounds = np.full(60, 20.0)
    acc_a = rounds * rng.uniform(0.5, 5.0, 60)  # accepted drafts per round: 0.5 .. 5 by prompt
    acc_b = 0.8 * acc_a
    r, lo, hi = paired_tau_ratio(acc_a, rounds, acc_b, rounds)
    assert r == pytest.approx((acc_a.sum() + rounds.sum()) / (acc_b.sum() + rounds.sum()))
    assert lo <= r <= hi and hi - lo < 0.02
    ta = lambda i: (acc_a[i].sum(-1) + rounds[i].sum(-1)) / rounds[i].sum(-1)
    tb = lambda i: (acc_b[i].sum(-1) + rounds[i].sum(-1)) / rounds[i].sum(-1)
    i, j = rng.integers(0, 60, (2, 2000, 60))
    unpaired = ta(i) / tb(j)
    assert np.percentile(unpaired, 97.5) - np.percentile(unpaired, 2.5) > 5 * (hi - lo)
    with pytest.raises(ValueError, match="same requests"):
        paired_tau_ratio(acc_a, rounds, acc_b[:10], rounds[:10])
