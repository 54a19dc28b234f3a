"""The survivals of past rounds' acceptance and the verdict on a fixed-length round
(`prefix.running_survivals`, `prefix.fixed_verdict`): what the "acceptance" skip rule decides on
for drafters without a confidence head, against the numpy references."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_jax.scheduler import prefix
from tests.scheduler import prefix_reference as numpy_ref

BUCKETS = (3, 6, 12)


def test_running_survivals_match_the_reference_and_never_rise():
    rng = np.random.default_rng(0)
    for _ in range(40):
        at_risk = np.sort(rng.uniform(0, 30, 4))[::-1] * (rng.random(4) < 0.8)
        accepted = at_risk * rng.uniform(0, 1, 4)
        s, rows = prefix.running_survivals(np.stack([at_risk, accepted]).astype(np.float32))
        want, want_rows = numpy_ref.running_survivals_np((at_risk, accepted))
        np.testing.assert_allclose(np.asarray(s), want, rtol=1e-5, atol=1e-7)
        assert float(rows) == pytest.approx(want_rows, rel=1e-6)
        assert np.all(np.diff(np.asarray(s)) <= 1e-7)


def test_a_drafter_never_accepted_promises_little():
    """Twelve rows, no draft accepted: the conditional prior gives s_k = (1/14) (1/2)^(k-1),
    about 0.14 drafts a round at gamma 7; a prior per position, (0 + 1) / (12 + 2) each, would
    promise 0.5 (and on a 1-slot CPU table that made drafting look worth it)."""
    counts = np.array([[12.0] + [0.0] * 6, [0.0] * 7], np.float32)
    s, rows = prefix.running_survivals(counts)
    np.testing.assert_allclose(np.asarray(s), [(1 / 14) * 0.5 ** k for k in range(7)], rtol=1e-6)
    assert float(np.sum(s)) < 0.15 and float(rows) == 12.0


def test_fixed_verdict_matches_the_reference():
    rng = np.random.default_rng(1)
    seen = set()
    for _ in range(80):
        tv = np.cumsum(rng.uniform(0.2, 1.0, 3))
        t_draft = float(rng.uniform(0.0, 0.8))
        extra = 0.0 if rng.random() < 0.5 else float(rng.uniform(0, 0.3))
        table = prefix.make_table(BUCKETS, t_verify=tv, t_draft=t_draft, skip_extra=extra)
        tab_np = prefix.make_table(BUCKETS, t_verify=tv, t_draft=t_draft, skip_extra=extra, as_numpy=True)
        s = np.minimum.accumulate(rng.uniform(0, 1, 3) ** rng.uniform(0.3, 3))
        rows, n, gamma = float(rng.uniform(0, 40)), int(rng.integers(0, 4)), int(rng.integers(0, 4))
        if n * (1 + gamma) > BUCKETS[-1]:
            continue
        for mode in ("sps", "latency"):
            v = prefix.fixed_verdict(s.astype(np.float32), np.float32(rows), n, gamma, table, mode=mode)
            pays, settled, gain = numpy_ref.fixed_verdict_np(s, rows, n, gamma, tab_np, mode=mode)
            assert (bool(v.pays), bool(v.settled_no)) == (pays, settled), (s, rows, n, gamma, mode)
            assert float(v.gain) == pytest.approx(gain, rel=1e-4, abs=1e-5)
            assert float(v.low) <= float(v.gain) + 1e-6
            seen.add((pays, settled))
    assert {(True, False), (False, False), (False, True)} <= seen


def test_the_fixed_round_is_priced_not_the_best_admission():
    """The engine verifies gamma drafts a slot: a round of 3 slots x 3 drafts lands in the
    12-token bucket (2.2 steps), where one draft a slot (6 tokens, 1.15) would pay. The verdict
    over the best admission count (`prefix.verdict`, the confidence head's) says it pays; the
    fixed-length verdict says it does not."""
    table = prefix.make_table(BUCKETS, t_verify=(1.0, 1.15, 2.2), t_draft=0.1)
    s = np.array([0.9, 0.2, 0.1], np.float32)
    act = np.ones(3, bool)
    assert bool(prefix.verdict(np.tile(s, (3, 1)), act, table).pays)
    assert not bool(prefix.fixed_verdict(s, np.float32(30.0), 3, 3, table).pays)
    assert bool(prefix.fixed_verdict(s, np.float32(30.0), 3, 1, table).pays)


def test_evidence_over_rounds_settles_one_slot():
    """One slot: a "no" settles once enough rows say it by more than the estimate's error; the
    same survivals from two rows do not settle it."""
    table = prefix.make_table(BUCKETS, t_verify=(1.0, 1.15, 2.2), t_draft=0.6)
    s, rows = prefix.running_survivals(np.array([[40.0, 4.0, 0.0], [4.0, 1.0, 0.0]], np.float32))
    assert float(rows) == 40.0
    v_few = prefix.fixed_verdict(s, np.float32(2.0), 1, 2, table)
    v_many = prefix.fixed_verdict(s, rows, 1, 2, table)
    assert not bool(v_few.pays) and not bool(v_many.pays)
    assert bool(v_many.settled_no) and not bool(v_few.settled_no)
    assert float(v_few.low) < float(v_many.low) < float(v_many.gain) < 0.0
