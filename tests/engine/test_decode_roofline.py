"""The decode step reads each weight once, shown by the TPU compiler (no TPU needed).

A Qwen3-8B-shaped target (its widths, fewer layers to keep the compile short) compiled for a v6e-8
slice: the target-only step at 8 slots x 2048 tokens must stay within a bound of the compiler's own
price for reading its weights and KV once (each weight product compiled bare, engine/read_once.py).
The same step with the layers under `lax.scan` over stacked weights (each layer's weights sliced
out of the stack and copied before its products read them) exceeds the bound: the test catches a
change that brings the weight copies back. And a one-slot step is no dearer than an eight-slot one
(rows padded to the chip's tile). On v5p no weight is copied into another layout by the step.
The draft stays near its own read-once price and the round at its full bucket near the step
(engine/round_price.py)."""

import dataclasses
import re

import jax
import pytest
from flax import nnx

from dspark_jax.config import from_cli
from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.engine.config import EngineConfig
from dspark_jax.engine.plan import abstract_engine, plan_mesh
from dspark_jax.engine.predict import _abstract_args, _round_compiled, _round_cost
from dspark_jax.engine.read_once import kv_bytes_per_chip, product_shapes, read_once_seconds
from dspark_jax.engine.round import draft_part, round_step
from dspark_jax.parallel.tpu_cost import program_cost
from dspark_jax.target.merged import MergeChoice

pytest.importorskip("libtpu", reason="the TPU compiler ships in libtpu: pip install -e '.[aot]'")

LAYERS, SLOTS, CONTEXT, SLICE = 4, 8, 2048, "v6e-8"
# the step over the read-once price at these shapes (libtpu 0.0.42; each product group priced at
# the cheaper of its parts and its merged product): 1.51 with the layers unrolled over merged
# per-layer weights, 2.59 with the weights copied out of a stack under `lax.scan`
BOUND = 1.8


@pytest.fixture(scope="module")
def qwen3_8b_short():
    cfg = from_cli(["configs/qwen3_8b_dspark.yaml", f"target.model.num_layers={LAYERS}",
                    "drafter.target_layer_ids=[0,1,2]", "drafter.num_layers=1"])
    return dataclasses.replace(cfg, target=dataclasses.replace(cfg.target, dtype="bfloat16"))


def _engine(cfg, slots, cache_reads="auto"):
    mesh = plan_mesh((1, 1, 8), SLICE)
    config = EngineConfig(policy="fixed",
                          num_slots=slots, max_len=CONTEXT, buckets=(slots,), paged_attention=cache_reads)
    ab = abstract_engine(cfg, mesh, config, drafter=False)
    return ab, ab.eng.control(SamplingParams(0.0, 0, 1.0))


def _floor(cfg, ab, slots):
    m = cfg.target.model
    kv = kv_bytes_per_chip(m, slots=slots, context=CONTEXT, tensor=8)
    return read_once_seconds(m, ab.mesh.devices.flat[0], rows=max(slots, 8), tensor=8, kv_bytes_per_chip=kv)


def test_attention_reads_the_cache_once(qwen3_8b_short):
    """At 64 slots the cache is a third of what a step reads. The kernel backend (chosen for TPU)
    keeps the step within 1.75x of the read-once price (1.54 at libtpu 0.0.42); the reference,
    which XLA:TPU compiles into a score pass and a value pass over every position of every row,
    costs at least 0.8 of a cache read more (1.17 of one; 1.95x the price), so a change that
    brings the whole-cache reads back fails here."""
    ab, ctl = _engine(qwen3_8b_short, 64)
    floor = _floor(qwen3_8b_short, ab, 64)
    step = _round_cost(ab, 64, ctl).seconds
    assert step <= 1.75 * floor["total"], f"64-slot step {1e3 * step:.3f} ms > 1.75 x {1e3 * floor['total']:.3f} ms"
    ab_ref, ctl_ref = _engine(qwen3_8b_short, 64, "reference")
    reference = _round_cost(ab_ref, 64, ctl_ref).seconds
    assert reference - step >= 0.8 * floor["kv"], (reference, step, floor["kv"])


def _stacked_step(ab, ctl):
    """The broken variant: the target's weights stacked, the layers under `lax.scan`."""
    spec = dataclasses.replace(ab.eng.spec, buckets=(SLOTS,))
    _, dt, st = _abstract_args(ab)

    def one_round(ts, dt, s):
        return round_step(spec, nnx.merge(ab.tg, ts).arrays(), dt, s, ctl)

    with jax.set_mesh(ab.mesh):
        jitted = jax.jit(one_round, in_shardings=(ab.t_sh, ab.dt_sh, ab.state_sh),
                         out_shardings=(ab.state_sh, None), donate_argnums=(2,))
        compiled = jitted.lower(ab.tstate, dt, st).compile()
    return program_cost(compiled, ab.mesh.devices.flat[0]).seconds


def test_product_shapes_split_over_tensor(qwen3_8b_short):
    """The products the step runs: merged on v6e-8 (one KV head a chip), unmerged when asked."""
    m = qwen3_8b_short.target.model
    shapes = product_shapes(m, 8)
    assert shapes["qkv_proj"] == ((512 + 2 * 128, 4096), LAYERS) and "q_proj" not in shapes
    assert shapes["gate_up_proj"] == ((2, 4096, 1536), LAYERS) and shapes["down_proj"] == ((1536, 4096), LAYERS)
    assert shapes["lm_head"] == ((4096, 151936 // 8), 1)
    parts = product_shapes(m, 8, MergeChoice(False, False))
    assert parts["q_proj"] == ((4096, 512), LAYERS) and parts["k_proj"] == ((4096, 128), LAYERS)
    assert parts["gate_proj"] == ((4096, 1536), LAYERS) and "qkv_proj" not in parts


def test_decode_step_reads_each_weight_once(qwen3_8b_short):
    ab, ctl = _engine(qwen3_8b_short, SLOTS)
    floor = _floor(qwen3_8b_short, ab, SLOTS)["total"]
    step = _round_cost(ab, SLOTS, ctl).seconds
    assert step <= BOUND * floor, f"target-only step {1e3 * step:.3f} ms > {BOUND} x read-once {1e3 * floor:.3f} ms"
    stacked = _stacked_step(ab, ctl)
    assert stacked > BOUND * floor, "the bound does not catch weights copied out of a stack"
    assert stacked > 1.2 * step


def test_one_slot_no_dearer_than_eight(qwen3_8b_short):
    ab1, ctl1 = _engine(qwen3_8b_short, 1)
    ab8, ctl8 = _engine(qwen3_8b_short, 8)
    assert ab1.eng.buckets == (8,)  # one token's row padded to the TPU's 8-row tile
    assert _round_cost(ab1, 1, ctl1).seconds <= 1.02 * _round_cost(ab8, 8, ctl8).seconds


def test_no_weight_is_copied_on_v5p(qwen3_8b_short):
    """v5p-8, tensor 4, 8 slots: the compiler copied the merged q/k/v weight into [N, H] every step
    while it was held input-major ([H, N]: `copy bf16[1536,4096]`); held output-major
    (target/merged.py) no copy in the step has the shape of a chip's share of a weight, either way
    round. A change that brings back a per-step weight relayout fails here."""
    ab = abstract_engine(qwen3_8b_short, plan_mesh((1, 1, 4), "v5p-8"),
                         EngineConfig(policy="fixed",
                                      num_slots=SLOTS, max_len=CONTEXT, buckets=(SLOTS,)), drafter=False)
    hlo = _round_compiled(ab, SLOTS, ab.eng.control(SamplingParams(0.0, 0, 1.0))).as_text()
    weights = {shape for shape, _ in product_shapes(qwen3_8b_short.target.model, 4).values()}
    weights |= {s[:-2] + s[-2:][::-1] for s in weights}  # and their transposes
    copies = {tuple(int(x) for x in m.split(",")) for m in re.findall(r"= bf16\[([\d,]+)\]\{[^}]*\} copy\(", hlo)}
    assert copies, "no copy found at all: the HLO text format changed and this test sees nothing"
    assert not copies & weights, f"weights copied every step: {sorted(copies & weights)}"


def test_draft_keeps_the_vocabulary_split(qwen3_8b_short):
    """v6e-8, 64 slots: the sequential head's V-wide work (the LM head's logits, the draft
    distributions, the sampling noise) stays split over tensor as the LM head's output is. With
    the logits gathered whole, every chip built [64, 151936] float32 arrays each of the head's
    gamma steps (the one-hot of a greedy row, the distributions' transpose): the full Qwen3-8B
    draft was priced 7.42 ms, 1.90 ms split (docs/performance.md, item 13)."""
    mesh = plan_mesh((1, 1, 8), SLICE)
    ab = abstract_engine(qwen3_8b_short, mesh, EngineConfig(policy="fixed", num_slots=64, max_len=CONTEXT),
                         drafter_in_target_dtype=True)
    ctl = ab.eng.control(SamplingParams(0.0, 0, 1.0))
    spec = ab.eng.spec

    def draft_only(dt, s):
        return draft_part(spec, dt, s, ctl.sampling)

    with jax.set_mesh(ab.mesh):
        _, dt, st = _abstract_args(ab)
        jitted = jax.jit(draft_only, in_shardings=(ab.dt_sh, ab.state_sh))
        hlo = jitted.lower(dt, st).compile().as_text()
    vocab = qwen3_8b_short.target.model.vocab_size
    assert re.search(rf"f32\[[\d,]*{vocab // 8}\]", hlo), "no split V-wide array: the HLO format changed"
    whole = sorted(set(re.findall(rf"f32\[[\d,]*,{vocab}\]", hlo)))
    assert not whole, f"V-wide float32 arrays gathered whole in the draft: {whole}"


# the 4-layer target with a one-layer DSpark drafter (libtpu 0.0.42.1), predicted: draft / its
# read-once price 1.41 at 1 slot and 1.25 at 64 (3.6 and 2.3 at 203511f: the drafter's weights
# copied out of their stack, 1- and 7-row products on the vector unit, the feature projection
# whole on every chip, the per-row head); the round at its full bucket / the step 2.05 and 2.93
# (3.60 and 4.68 at 203511f); the round that skips drafting / the step 1.11 and 1.07
ROUND_BOUNDS = {1: dict(draft=1.6, full=2.4, skip=1.2), 64: dict(draft=1.5, full=3.4, skip=1.2)}


@pytest.mark.parametrize("slots", sorted(ROUND_BOUNDS))
def test_draft_and_round_near_their_floors(qwen3_8b_short, slots):
    from dspark_jax.engine.round_price import price_rounds

    full = slots * 8  # gamma 7
    rp = price_rounds(qwen3_8b_short, SLICE, (1, 1, 8), slots=slots, context=CONTEXT, top=1, buckets=(full,))
    bound = ROUND_BOUNDS[slots]
    assert rp.draft.ratio <= bound["draft"], f"draft {rp.draft.ratio:.2f}x its read-once price"
    assert rp.full.seconds <= bound["full"] * rp.step.seconds, rp.summary()
    assert rp.skip.seconds <= bound["skip"] * rp.step.seconds, rp.summary()
    for p in rp.programs:  # every program beside its floors: the HBM floor from the datasheet's bandwidth
        assert p.nbytes > 0 and p.hbm_s == pytest.approx(p.nbytes / 1638e9)
        assert 0 <= p.declared_s < p.seconds and p.collectives > 0 and p.collective_s > 0
