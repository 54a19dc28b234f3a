"""The skip rule prices plain decoding as what a round without a draft costs.

`prefix.plain_time(n) = T_verify(n) + skip_extra`, where `costs.skip_extra` is read from the
cost file: its skipped round `t_skip` where it has one (and, for a predicted table, where that
priced the engine's round without a draft), else no less than its target-only step
`t_target_step`, both at the table's slot count R, minus `t_verify(R)`. A measured or predicted
`t_verify(b)` is a round minus the draft timed alone, and the draft alone costs more than it adds
to a round, so `t_verify(R)` under-prices plain decoding: with it the rule skipped rounds where
drafting still paid. The compiled functions are checked against plain-loop numpy references
(tests/scheduler/prefix_reference.py), and on a table shaped like the predicted Qwen3-8B v6e-8
table at R = 256 the decision must be the one plain_time gives, not the one t_verify(R) gave.
"""

from __future__ import annotations

import numpy as np
import pytest

from dspark_jax.scheduler import prefix
from dspark_jax.scheduler.costs import (
    SKIPPED_ROUND,
    load_cost_table,
    save_cost_file,
    skip_extra,
    skipped_round_price,
    with_overhead,
)
from dspark_jax.scheduler.simulate import _best_case_pays, _settled_no, _stale_skip, skipped_round_cost
from tests.scheduler import prefix_reference as numpy_ref

# the predicted Qwen3-8B v6e-8 table at R = 256 (docs/tpu_predictions_figures), in ms: verifying
# 256 tokens reads 11.5 ms, the round without a draft costs 20.3, the target-only step 17.1
R, G = 256, 7
V6E = dict(buckets=[256, 512, 1024, 2048], t_verify=[11.46e-3, 15.51e-3, 20.78e-3, 29.95e-3], t_draft=32.55e-3)
T_SKIP, T_TARGET = 20.33e-3, 17.09e-3


def _cost(**extra):
    return {**V6E, "engine": {"num_slots": R, "gamma": G}, **extra}


def test_skip_extra_reads_the_skipped_round_else_the_target_step():
    assert skip_extra(_cost(t_skip=T_SKIP, t_target_step=T_TARGET)) == pytest.approx(T_SKIP - 11.46e-3)
    assert skip_extra(_cost(t_target_step=T_TARGET)) == pytest.approx(T_TARGET - 11.46e-3)
    assert skip_extra(_cost(t_target_step=5e-3)) == 0.0  # no less than t_verify(R) either
    assert skip_extra(_cost()) == 0.0  # a table pricing neither: t_verify(R) is all it knows
    assert skip_extra({**V6E, "t_skip": T_SKIP}) == 0.0  # no slot count: no R to price it at
    # a table at R = 8 whose buckets start below R: t_verify(R) interpolated
    d = {"buckets": [1, 16], "t_verify": [1.0, 2.5], "t_draft": 2.0, "engine": {"num_slots": 8}, "t_skip": 3.0}
    assert skip_extra(d) == pytest.approx(3.0 - (1.0 + 7 * 1.5 / 15))
    # no more than the draft: a round that skips drafting does less than one that drafts in its bucket
    assert skip_extra({**d, "t_draft": 0.1}) == pytest.approx(0.1)
    # a predicted table says which program its skip@R priced: t_skip is read only where that is the
    # engine's round without a draft (round.plain_round); an older skipped round (rejection and the
    # drafter update over the whole block) is not what the engine runs, so the target-only step prices it
    old = _cost(t_skip=T_SKIP, t_target_step=T_TARGET, programs={f"skip@{R}": {"seconds": T_SKIP}})
    assert skipped_round_price(old) == T_TARGET and skip_extra(old) == pytest.approx(T_TARGET - 11.46e-3)
    new = _cost(t_skip=T_SKIP, t_target_step=T_TARGET, programs={f"skip@{R}": {"program": SKIPPED_ROUND}})
    assert skipped_round_price(new) == T_SKIP
    assert skipped_round_price(_cost()) is None
    # an overhead added to every round reaches the skipped round too
    assert skip_extra(with_overhead(_cost(t_skip=T_SKIP), 4e-3, "test")) == pytest.approx(T_SKIP - 11.46e-3)


def test_a_loaded_table_carries_it(tmp_path):
    p = save_cost_file(tmp_path / "c.json", V6E["buckets"], V6E["t_verify"], V6E["t_draft"], backend="tpu",
                       device_kind="v6e-8", provenance="test", engine={"num_slots": R}, t_skip=T_SKIP)
    for as_numpy in (False, True):
        t = load_cost_table(p, as_numpy=as_numpy)
        assert float(t.skip_extra) == pytest.approx(T_SKIP - 11.46e-3, rel=1e-5)
        assert float(prefix.plain_time(R, t)) == pytest.approx(T_SKIP, rel=1e-5)


def _tables(rng, n=40):
    for _ in range(n):
        b = np.sort(rng.choice(np.arange(3, 64), 4, replace=False))
        tv = np.cumsum(rng.uniform(0.01, 1.0, 4))
        yield (b, tv, float(rng.uniform(0, 1)), float(rng.choice([0.0, rng.uniform(0, 2)])))


def test_compiled_pricing_equals_the_numpy_reference():
    """plain_time, the best-case rule and the known-survivals rule against their references, on
    random tables with and without a skipped-round price beyond t_verify."""
    rng = np.random.default_rng(7)
    seen = set()
    for b, tv, td, extra in _tables(rng):
        tab = prefix.make_table(b, t_verify=tv, t_draft=td, skip_extra=extra)
        tnp = prefix.make_table(b, t_verify=tv, t_draft=td, skip_extra=extra, as_numpy=True)
        n = int(rng.integers(1, 4))  # few shapes: each compiles once
        for cost in ("interp", "step"):
            assert float(prefix.plain_time(n, tab, cost)) == pytest.approx(numpy_ref.plain_time_np(n, tnp, cost),
                                                                           rel=1e-5)
        for mode in ("sps", "latency"):
            want = numpy_ref.speculation_pays_np(n, tnp, 3 * n, mode=mode)
            assert bool(prefix.speculation_pays(n, tab, 3 * n, mode=mode)) == want
            assert _best_case_pays(n, tnp, td, 3 * n, mode) == want
            a = np.cumprod(rng.uniform(0, 1, (n, 3)) ** rng.uniform(0.2, 3), axis=1)
            act = np.ones(n, bool)
            want = numpy_ref.known_speculation_pays_np(a, act, tnp, mode=mode)
            assert bool(prefix.known_speculation_pays(a, act, tab, mode=mode)) == want
            assert bool(_stale_skip(a[None], n, tnp, td, "step", mode)[0]) == (not want)
            seen.add(want)
    assert seen == {True, False}


def test_the_rule_weighs_drafting_against_the_skipped_round_not_t_verify():
    """On the v6e-8 table: with every draft surviving, drafting all 7 tokens of each of 256 slots
    gives 2048 tokens in 62.5 ms (32.8 per ms); a round without a draft gives 256 in 20.3 ms (12.6
    per ms). Priced at t_verify(256) = 11.5 ms (22.3 per ms), plain decoding looked faster than it
    is, and with survivals 0.86^j (4 of the 7 drafts of a slot accepted on average: 20.5 tokens per
    ms) the rule skipped where drafting pays 1.6x a round without a draft."""
    for extra, want_best, want_known in ((T_SKIP - 11.46e-3, True, True), (0.0, True, False)):
        tab = prefix.make_table(**V6E, skip_extra=extra)
        tnp = prefix.make_table(**V6E, skip_extra=extra, as_numpy=True)
        a = np.cumprod(np.full((R, G), 0.86), axis=1)
        assert bool(prefix.speculation_pays(R, tab, R * G, mode="latency")) is want_best
        assert bool(prefix.known_speculation_pays(a, np.ones(R, bool), tab, mode="latency")) is want_known
        assert numpy_ref.known_speculation_pays_np(a, np.ones(R, bool), tnp, mode="latency") is want_known
    # the skip rule's price is what the simulator charges a skipped round, and t_skip at R
    cost = _cost(t_skip=T_SKIP, t_target_step=T_TARGET)
    assert skipped_round_cost(cost, R, charge="step") == pytest.approx(T_SKIP)
    tab = prefix.make_table(**V6E, skip_extra=skip_extra(cost))
    assert float(prefix.plain_time(R, tab, "step")) == pytest.approx(T_SKIP, rel=1e-5)
    assert skipped_round_cost(_cost(t_target_step=T_TARGET), R) == pytest.approx(T_TARGET)


def test_a_settled_no_equals_its_reference():
    """`prefix.settled_no` (no more probes at this load): fresh survivals say no admission count
    pays by more than z standard errors of the tokens they promise; never from one slot. The
    compiled function, the simulator's and the numpy reference agree."""
    rng = np.random.default_rng(11)
    seen = set()
    for b, tv, td, extra in _tables(rng, 30):
        tab = prefix.make_table(b, t_verify=tv, t_draft=td, skip_extra=extra)
        tnp = prefix.make_table(b, t_verify=tv, t_draft=td, skip_extra=extra, as_numpy=True)
        n = int(rng.integers(1, 4))
        a = np.cumprod(rng.uniform(0, 1, (n, 3)) ** rng.uniform(0.2, 3), axis=1)
        for z in (0.0, 2.0):
            want = numpy_ref.settled_no_np(a, np.ones(n, bool), tnp, z=z)
            assert bool(prefix.settled_no(a, np.ones(n, bool), tab, z)) == want
            assert _settled_no(a, n, tnp, td, "step", z=z) == want
            seen.add(want)
        assert not numpy_ref.settled_no_np(a[:1], np.ones(1, bool), tnp, z=0.0)  # one slot: never
    assert seen == {True, False}
    # the same survivals settle with many slots and not with few: the error shrinks as 1 / sqrt(n)
    tab = prefix.make_table(**V6E, skip_extra=T_TARGET - 11.46e-3)
    a = np.cumprod(np.where(np.arange(R)[:, None] % 2, 0.5, 0.7) * np.ones((R, G)), axis=1)
    for n, settles in ((R, True), (4, False)):
        act = np.arange(R) < n
        assert not bool(prefix.known_speculation_pays(a, act, tab)) and bool(prefix.settled_no(a, act, tab)) is settles
