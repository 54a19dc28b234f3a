"""The predicted half of `bench roofline --topology SLICE`: the engine's decode programs compiled
for a Cloud TPU slice on this machine (no TPU) and timed by the XLA:TPU cost model
(engine/predict.py), each beside its roofline at the rates the same compiler prices a chip at
(`tpu_cost.kernel_rates`: HBM bytes/s and matmul FLOPs/s per device) over one chip's bytes and
FLOPs (each weight's shard, its share of the KV and of the tokens).

Every time here is the compiler's estimate, not a measurement: collectives, host overhead and
launch latency are not in it (docs/tpu_predictions.md). The caches' fill only changes the
roofline: the compiled dense attention reads the whole cache whatever its lengths.
"""

from __future__ import annotations

import dataclasses
import time

import jax
from flax import nnx

from dspark_jax.bench import roofline_model as rm
from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.engine.buckets import bucket_for
from dspark_jax.engine.config import EngineConfig
from dspark_jax.engine.plan import abstract_engine, plan_mesh
from dspark_jax.engine.predict import _abstract_args, _draft_cost, _round_cost
from dspark_jax.parallel.tpu_cost import kernel_rates, program_cost
from dspark_jax.scheduler.costs import bucket_plan

__all__ = ["predict_programs", "PREDICTED"]

PREDICTED = "predicted (XLA:TPU cost model)"


def _prefill_compiled(ab, width: int):
    """The engine's prefill program (prompts of `width` tokens in every slot) compiled for the slice."""
    eng, rep = ab.eng, jax.sharding.NamedSharding(ab.mesh, jax.sharding.PartitionSpec())
    prefill_fn = eng._prefill.__wrapped__
    sds = jax.ShapeDtypeStruct
    R = eng.R
    keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), R))
    join_args = (sds((R, width), jax.numpy.int32, sharding=rep), sds((R,), jax.numpy.int32, sharding=rep),
                 sds((R,), bool, sharding=rep), sds(keys.shape, keys.dtype, sharding=rep),
                 sds((R,), jax.numpy.int32, sharding=rep))

    tp, dt, st = _abstract_args(ab)
    with jax.set_mesh(ab.mesh):
        return jax.jit(prefill_fn, in_shardings=(ab.tp_sh, ab.dt_sh, ab.state_sh, *([None] * 5)),
                       out_shardings=ab.state_sh, donate_argnums=(2,)).lower(tp, dt, st, *join_args).compile()


def _shapes(ab) -> rm.ModelShapes:
    """The abstract engine's shapes. The drafter's weights are counted in the dtype its programs
    compute in: an Engine casts them once when it is built (`drafter.arrays()`), while the
    programs priced here take the frozen embedding and LM head as stored (float32) and cast them
    inside, time the roofline does not grant them."""
    drafter = {}
    if ab.eng.G:
        stored = {**rm.named_leaves(ab.dparams, ab.dp_sh), **rm.named_leaves(ab.dfrozen, ab.dfz_sh)}
        taken = rm.named_leaves(jax.eval_shape(lambda dp, dfz: nnx.merge(ab.dg, dp, dfz).arrays(), ab.dparams,
                                               ab.dfrozen))
        drafter = {n: _in_dtype(leaf, taken[n].nbytes / taken[n].elems) for n, leaf in stored.items()}
    return rm.model_shapes(ab.eng.spec, ab.tp, drafter, ab.state, ab.state_sh)


def _in_dtype(leaf: rm.Leaf, item: float) -> rm.Leaf:
    old = leaf.nbytes / leaf.elems
    return rm.Leaf(leaf.elems, int(leaf.elems * item), leaf.chip_elems, int(leaf.chip_elems * item),
                   int(leaf.row_bytes / old * item))


def predict_programs(cfg, *, slots: int, context: int, topology: str, mesh_shape, fill: float, prompt: int,
                     temperature: float = 0.0, say=print) -> dict:
    """The decode programs of `cfg`'s engine of `slots` x `context` on `topology`, each priced by
    the compiler -> {"fill", "prompt", "gamma", "rates", "programs": [...], "memory": {...}}."""
    mesh = plan_mesh(mesh_shape, topology)
    device = mesh.devices.flat[0]
    config = EngineConfig(num_slots=slots, max_len=context)
    ab = abstract_engine(cfg, mesh, config, drafter_in_target_dtype=True)
    ab0 = abstract_engine(cfg, mesh, dataclasses.replace(config, buckets=(slots,)), drafter=False)
    eng = ab.eng
    n_fill = max(int(fill * eng.room), 1)
    prompt = max(min(prompt, n_fill), eng.min_prompt_len, 2)
    sp = SamplingParams(temperature, 0, 1.0)
    ctl, ctl0 = eng.control(sp), ab0.eng.control(sp)
    m, m0 = _shapes(ab), _shapes(ab0)
    flops_s, bytes_s, _ = kernel_rates(device)
    progs = []

    def priced(fp, fn):
        t0 = time.perf_counter()
        c = fn()
        say(f"[roofline] {fp.name}: {1e3 * c.seconds:.3f} ms {PREDICTED}, compiled in {time.perf_counter() - t0:.0f} s")
        progs.append({"footprint": fp, "timing": {"best_s": c.seconds, "median_s": c.seconds, "repeats": 0},
                      "cost": dataclasses.asdict(c)})

    priced(rm.target_step(m0, slots, n_fill, f"target_step@{slots}"), lambda: _round_cost(ab0, slots, ctl0))
    for b, (k, g) in sorted(bucket_plan(eng.priced_buckets, slots, eng.G).items()):
        width = 1 if g == 0 else None  # as predict_table: only undrafted rows reach it, the one-column view
        priced(rm.round_footprint(m, k, g, n_fill, f"round@{b}"),
               lambda b=b, w=width: _round_cost(ab, b, ctl, w))
    priced(rm.draft_footprint(m, slots, n_fill), lambda: _draft_cost(ab, ctl))
    P = bucket_for(eng.prefill_buckets, prompt)
    box = {}

    def prefill_cost():
        box["compiled"] = _prefill_compiled(ab, P)
        return program_cost(box["compiled"], device)

    priced(rm.prefill_footprint(m, slots, prompt, f"prefill@{P}"), prefill_cost)
    mem = box["compiled"].memory_analysis()
    memory = {"prefill": {"arguments": int(mem.argument_size_in_bytes), "outputs": int(mem.output_size_in_bytes),
                          "temporaries": int(mem.temp_size_in_bytes), "aliased": int(mem.alias_size_in_bytes)}}
    rates = {"bandwidth": bytes_s, "flop_rate": flops_s, "device_kind": device.device_kind,
             "counted": "XLA:TPU's prices of a kernel's declared bytes and FLOPs (tpu_cost.kernel_rates), per device"}
    return {"fill": n_fill, "prompt": prompt, "gamma": eng.G, "buckets": list(eng.priced_buckets),
            "rates": rates, "programs": progs, "memory": memory}
