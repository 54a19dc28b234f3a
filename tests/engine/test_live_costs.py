"""The cost table that follows the load (engine/live_costs.py): the medians of the rounds' recent
times per bucket rebuild the table, what the rounds never reach keeps its measured price, and outliers
(a compile) are left out."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_jax.engine.live_costs import LiveTable
from dspark_jax.scheduler.prefix import make_table

PRICED = (4, 8, 16)
COMPILED = (4, 8, 16, 32)  # 32: a chunk-only bucket, never priced


def _live(**kw):
    table = make_table(PRICED, t_verify=[1e-3, 2e-3, 4e-3], t_draft=1e-3, skip_extra=5e-4, as_numpy=True)
    return LiveTable(table, COMPILED, **kw)


def test_a_busier_machine_moves_the_buckets_it_ran():
    live = _live(every=8)
    live.observe(1, True, 25e-3)  # one slow round (under the outlier bound): the median ignores it
    for _ in range(6):  # drafted rounds at bucket 8 take 2x what the table says (draft 1 + verify 2 ms -> 6 ms)
        live.observe(1, True, 6e-3)
        assert live.refreshed() is None  # not before `every` rounds
    live.observe(1, True, 6e-3)
    t = live.refreshed()
    assert t is not None and live.updates == 1
    # the draft stays as measured; bucket 16, which no round reached, rises with 8 (priced below it,
    # it would take every round of 5 to 8 tokens)
    np.testing.assert_allclose(np.asarray(t.t_verify), [1e-3, 5e-3, 5e-3], rtol=1e-6)
    assert float(np.asarray(t.t_draft)) == pytest.approx(1e-3) and live.changes() == "8: 2 -> 5 ms, 16: 4 -> 5 ms"


def test_skipped_rounds_price_plain_decoding_and_outliers_are_left_out():
    live = _live(every=4)
    live.observe(0, False, 5.0)  # a compile: far beyond the table's price, not counted
    live.observe(3, True, 1e-3)  # the chunk-only bucket: not priced
    assert live.rounds == 0
    for _ in range(4):
        live.observe(0, False, 1.8e-3)  # plain rounds at bucket 4: 1 ms verify + 0.8 ms beyond
    t = live.refreshed()
    assert float(np.asarray(t.skip_extra)) == pytest.approx(0.8e-3)
    assert live.changes() == "skipped round's extra: 0.5 -> 0.8 ms"
    np.testing.assert_allclose(np.asarray(t.t_verify), [1e-3, 2e-3, 4e-3], rtol=1e-6)


def test_a_table_within_its_noise_is_not_rebuilt():
    live = _live(every=4)
    for _ in range(4):  # 4.1 ms verify against 4: 2.5 %, under the 5 % that counts as moved
        live.observe(2, True, 5.1e-3)
    assert live.refreshed() is None and live.updates == 0 and live.changes() == "unchanged"


def test_the_rebuilt_table_keeps_the_measured_order_of_the_buckets():
    live = _live(every=8)
    for _ in range(4):  # both reached: 16's window says 2.5 ms, 8's 3 ms (one busy window)
        live.observe(1, True, 4e-3)
        live.observe(2, True, 3.5e-3)
    t = live.refreshed()
    # 8 takes 16's price: a round of 5 to 8 tokens stays in bucket 8 (ties go to the smaller bucket)
    np.testing.assert_allclose(np.asarray(t.t_verify), [1e-3, 2.5e-3, 2.5e-3], rtol=1e-6)
    # a measured inversion (a larger bucket cheaper in every sweep: scheduler/costs.py) stays free
    inverted = make_table(PRICED, t_verify=[1e-3, 4e-3, 2e-3], t_draft=1e-3, as_numpy=True)
    live = LiveTable(inverted, COMPILED, every=4)
    for _ in range(4):
        live.observe(1, True, 6e-3)  # 8 reached: 5 ms; 16 stays at 2 ms below it
    np.testing.assert_allclose(np.asarray(live.refreshed().t_verify), [1e-3, 5e-3, 2e-3], rtol=1e-6)


def test_a_skipped_round_is_never_priced_above_a_drafting_one():
    live = _live(every=4)
    for _ in range(4):  # skipped rounds at bucket 4 in a busy window: 4 ms beyond its 1 ms verify
        live.observe(0, False, 5e-3)
    # at most the draft (1 ms): a round that skips drafting does less than one that drafts there,
    # and a larger extra would make drafting that cannot pay look cheaper than not drafting
    assert float(np.asarray(live.refreshed().skip_extra)) == pytest.approx(1e-3)
