"""The TPU compiler's time estimate with loops counted as they run (parallel/tpu_cost.py): a layer
scan must cost what the same layers unrolled cost, which `optimal_seconds` (loop bodies once)
gets wrong by the trip count."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dspark_jax.parallel.tpu_cost import hlo_cycles, program_cost

HLO = """HloModule m

%fused (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %e = f32[8]{0} exponential(%p), backend_config={"estimated_cycles":"999"}
}

%body (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %t = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %one = s32[] constant(1)
  %n = s32[] add(%i, %one)
  %x = f32[8]{0} get-tuple-element(%t), index=1
  %f = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused, backend_config={"estimated_cycles":"100"}
  %ar = f32[8]{0} all-reduce(%f), to_apply=%add
  ROOT %r = (s32[], f32[8]{0}) tuple(%n, %ar)
}

%cond (t: (s32[], f32[8])) -> pred[] {
  %t = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %bound = s32[] constant(36)
  ROOT %lt = pred[] compare(%i, %bound), direction=LT
}

%small (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %c = f32[8]{0} copy(%p), backend_config={"estimated_cycles":"5"}
}

%big (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %c = f32[8]{0} copy(%p), backend_config={"estimated_cycles":"70"}
}

ENTRY %main (x: f32[8], b: s32[]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %b = s32[] parameter(1)
  %zero = s32[] constant(0)
  %pre = f32[8]{0} copy(%x), backend_config={"estimated_cycles":"10"}
  %t = (s32[], f32[8]{0}) tuple(%zero, %pre)
  %w = (s32[], f32[8]{0}) while(%t), condition=%cond, body=%body
  %y = f32[8]{0} get-tuple-element(%w), index=1
  ROOT %c = f32[8]{0} conditional(%b, %y, %y), branch_computations={%small, %big}
}
"""


def test_loop_bodies_count_trip_count_times_and_conditionals_their_costliest_branch():
    h = hlo_cycles(HLO)
    # 10 before the loop, 36 x the fusion's 100 (its inner 999 is not entered), then the 70 branch
    assert h["cycles"] == 10 + 36 * 100 + 70
    assert h["once_cycles"] == 10 + 100 + 5 + 70
    assert h["loops"] == [("body", 36)]
    assert h["collectives"] == 36 and h["collective_bytes"] == 36 * 8 * 4
    assert h["unknown_loops"] == []


def test_a_loop_without_a_constant_bound_is_counted_once_and_reported():
    text = HLO.replace("%bound = s32[] constant(36)\n  ROOT %lt = pred[] compare(%i, %bound)",
                       "%bound = s32[] get-tuple-element(%t), index=0\n  ROOT %lt = pred[] compare(%i, %bound)")
    h = hlo_cycles(text)
    assert h["cycles"] == 10 + 100 + 70 and h["unknown_loops"] == ["body"]


@pytest.fixture(scope="module")
def v6e_chip():
    pytest.importorskip("libtpu", reason="the TPU compiler ships in libtpu: pip install -e '.[aot]'")
    from dspark_jax.parallel.topology import slice_devices

    return slice_devices("v6e-1")[0]


def test_a_layer_scan_costs_what_its_unrolled_layers_cost_on_tpu(v6e_chip):
    rep = NamedSharding(Mesh(np.array([v6e_chip]), ("x",)), P())
    x = jax.ShapeDtypeStruct((8, 2048), jnp.bfloat16, sharding=rep)
    w = jax.ShapeDtypeStruct((12, 2048, 2048), jnp.bfloat16, sharding=rep)

    def scanned(x, w):
        return jax.lax.scan(lambda c, wi: ((c @ wi).astype(c.dtype), None), x, w)[0]

    def unrolled(x, w):
        for i in range(w.shape[0]):
            x = (x @ w[i]).astype(x.dtype)
        return x

    s, u = (program_cost(jax.jit(f).lower(x, w).compile(), v6e_chip) for f in (scanned, unrolled))
    assert s.loops and s.loops[0][1] == 12
    assert 0.8 < s.seconds / u.seconds < 1.25
    # what the compiler's own figure does with the scan: one layer's worth (the broken variant)
    assert s.optimal_seconds < u.optimal_seconds / 6
    # weight-read bound: 12 x 8 MiB of bf16 weights at v6e's 1.64 TB/s is about 61 us; the cycle model at the
    # compute-bound clock is within the clock's uncertainty of it (module doc), not orders of magnitude off
    assert 0.8 < s.seconds / (12 * 2048 * 2048 * 2 / 1.64e12) < 3.0


KERNEL = ('  %k = f32[8]{0} custom-call(%x), custom_call_target="tpu_custom_call", backend_config={'
          '"custom_call_config":{"body":"...","cost_estimate":{"flops":"400","transcendentals":"2",'
          '"bytes_accessed":"300","remote_bytes_transferred":"0"}}}\n')


def test_a_kernel_call_is_priced_from_its_declared_estimate_as_often_as_it_runs():
    text = HLO.replace("  %ar = f32[8]{0} all-reduce(%f)", KERNEL + "  %ar = f32[8]{0} all-reduce(%k)")
    seen = []
    h = hlo_cycles(text, lambda f, t, b: seen.append((f, t, b)) or 7)
    assert seen == [(400, 2, 300)]  # the body is parsed once ...
    assert h["kernels"] == 36 and h["cycles"] == 10 + 36 * (100 + 7) + 70  # ... and runs 36 times
    assert hlo_cycles(text)["cycles"] == 10 + 36 * 100 + 70  # no pricer: counted, not priced


def test_a_pallas_kernel_in_a_layer_scan_is_priced_by_its_estimate_times_the_layers(v6e_chip):
    """The compiler gives a Mosaic call no cycles; its declared bytes at the rate the compiler
    itself prices declared bytes (v6e: about its 1.64 TB/s HBM) make the time, once per layer."""
    from jax.experimental import pallas as pl

    from dspark_jax.parallel.tpu_cost import kernel_rates

    rep = NamedSharding(Mesh(np.array([v6e_chip]), ("x",)), P())
    declared = 64 * 2**20

    def double(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    def layers(x):
        call = pl.pallas_call(double, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              cost_estimate=pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=declared))
        return jax.lax.scan(lambda c, _: (call(c), None), x, None, length=12)[0]

    x = jax.ShapeDtypeStruct((8, 128), jnp.float32, sharding=rep)
    c = program_cost(jax.jit(layers).lower(x).compile(), v6e_chip)
    _, bytes_per_s, _ = kernel_rates(v6e_chip)
    assert 1.4e12 < bytes_per_s < 1.8e12
    assert c.kernels == 12
    assert 12 * declared / bytes_per_s <= c.seconds < 12 * declared / bytes_per_s + 20e-6  # + the loop's own few cycles


def test_a_sparsecore_call_counts_its_collectives_not_its_cycles():
    """TPU7x runs its all-reduces on the SparseCores: `call-start` on another execution thread. Its
    collectives are counted (and priced by a given model); its cycles overlap the caller's."""
    sc = ('%sc (p: f32[8]) -> f32[8] {\n  %p = f32[8]{0} parameter(0)\n'
          '  ROOT %ar2 = f32[8]{0} all-reduce(%p), replica_groups=[1,8]<=[8], to_apply=%add, '
          'backend_config={"estimated_cycles":"500"}\n}\n')
    start = ('  %cs = ((f32[8]{0}), f32[8]{0}) call-start(%pre), async_execution_thread="sparsecore", '
             'to_apply=%sc\n')
    anchor = "  %t = (s32[], f32[8]{0}) tuple(%zero, %pre)"
    text = HLO.replace("ENTRY %main", sc + "ENTRY %main").replace(anchor, start + anchor)
    base, h = hlo_cycles(HLO), hlo_cycles(text, collective_seconds=lambda op, nbytes, line: 1e-6)
    assert h["collectives"] == base["collectives"] + 1 == 37
    assert h["cycles"] == base["cycles"]  # the SparseCore's 500 cycles are not the TensorCore's
    assert h["collective_seconds"] == pytest.approx(37e-6)
