"""Where a compiled program's estimated time goes (parallel/tpu_breakdown.py): loop bodies weighted
by their trip count, the same instruction of every iteration in one group, every branch of a
conditional listed; on the synthetic program of test_tpu_cost, checked number by number."""

from dspark_jax.parallel.tpu_breakdown import instruction_breakdown
from tests.parallel.test_tpu_cost import HLO


def test_groups_weighted_by_trip_count():
    rows = instruction_breakdown(HLO, clock_hz=1.0, top=10)
    got = {(group, kind): s for s, group, kind in rows}
    assert got[("f", "f32[8]{0}")] == 36 * 100  # the loop body's fusion, 36 trips
    assert got[("pre", "f32[8]{0}")] == 10
    assert got[("c", "f32[8]{0}")] == 5 + 70  # both branches' copies (same name and type: one group)
    assert rows[0][1] == "f"  # costliest first
    assert sum(s for s, _, _ in rows) == 36 * 100 + 10 + 75


def test_top_and_clock():
    rows = instruction_breakdown(HLO, clock_hz=100.0, top=1)
    assert rows == [(36.0, "f", "f32[8]{0}")]


def test_pallas_calls_are_priced_from_their_declared_cost():
    hlo = HLO.replace('  %pre = f32[8]{0} copy(%x), backend_config={"estimated_cycles":"10"}',
                      '  %pre = f32[8]{0} custom-call(%x), custom_call_target="tpu_custom_call", backend_config='
                      '{"cost_estimate":{"flops":"4","transcendentals":"0","bytes_accessed":"64"}}')
    assert "pre" not in {g for _, g, _ in instruction_breakdown(hlo, 1.0)}  # no pricer: left out
    rows = instruction_breakdown(hlo, 1.0, kernel_cycles=lambda f, t, b: f + b)
    assert ("pre", 68.0) in {(g, s) for s, g, _ in rows}
