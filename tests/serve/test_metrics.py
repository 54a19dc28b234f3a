"""/metrics' round counters: rounds by the longest verification length a slot got, rounds that
skipped drafting, and the scheduler's cost table as the rounds keep it."""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client", reason="prometheus_client not installed (pip install -e .[serve])")


def _value(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_rounds_are_counted_by_verified_length_and_skips():
    from dspark_jax.engine.live_costs import LiveTable
    from dspark_jax.scheduler.prefix import make_table
    from dspark_jax.serve.metrics import ServerMetrics

    m = ServerMetrics(4)
    m.round(0.01, [2, 0], [3, 1], [True, True], 4, drafted=True)
    m.round(0.01, [0, 0], [0, 0], [True, True], 4, drafted=False)
    m.round(0.01, [1, 0], [4, 2], [True, False], 4, drafted=True)  # slot 1 holds no request
    m.cost_table(LiveTable(make_table((2, 4), t_verify=[1e-3, 2e-3], as_numpy=True), (2, 4)))
    text = m.render(0, 2).decode()
    assert _value(text, 'dspark_rounds_total{verified_length="3"}') == 1
    assert _value(text, 'dspark_rounds_total{verified_length="4"}') == 1
    assert _value(text, 'dspark_rounds_total{verified_length="0"}') == 1
    assert _value(text, "dspark_skipped_rounds_total") == 1
    assert _value(text, 'dspark_cost_table_verify_seconds{bucket="4"}') == pytest.approx(2e-3)
