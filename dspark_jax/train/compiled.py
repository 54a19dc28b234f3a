"""Per-chip memory of the real train and eval steps, from compiled programs (no arrays allocated).

The step is lowered with the trainer's shardings on the preset's mesh and compiled; XLA's
`memory_analysis()` of the SPMD program is one device's: arguments (state, frozen target, batch
shard), outputs, temporaries. On a mesh of a Cloud TPU slice's compile-only devices
(`parallel.topology.slice_mesh`) the compiler is XLA:TPU itself, with the TPU kernels (splash
attention) the program would run there, so the figures are the chip's. Without a slice the mesh
is fake CPU devices (`jax_num_cpu_devices`): XLA:CPU schedules and fuses differently, so that
figure only approximates a chip's, but unlike the analytic estimate in `plan.py` it is what a
compiler made of the actual step.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dspark_jax.config import Config
from dspark_jax.drafter import registry
from dspark_jax.drafter.abstract import abstract_models
from dspark_jax.drafter.frozen import Frozen
from dspark_jax.drafter.losses import LossCoefs
from dspark_jax.parallel.platform import on_tpu
from dspark_jax.parallel.sharding import make_mesh, state_shardings
from dspark_jax.parallel.topology import hbm_refusal
from dspark_jax.parallel.tpu_cost import program_cost
from dspark_jax.train.step import (
    TrainState,
    make_eval_step,
    make_loss_fn,
    make_optimizer,
    make_train_step,
)

log = logging.getLogger(__name__)


def use_fake_devices(n: int) -> None:
    """Ask for `n` CPU devices; must run before JAX initialises its backend."""
    jax.config.update("jax_num_cpu_devices", n)


def _abstract(tree, shardings, dtype=None):
    """Shape/dtype structs laid out on `shardings` (a prefix of `tree`: one per NNX variable or array)."""
    def one(sh, x):
        if isinstance(x, nnx.Variable):
            return x.replace(jax.ShapeDtypeStruct(x.shape, dtype or x.dtype, sharding=sh))
        return jax.ShapeDtypeStruct(x.shape, dtype or x.dtype, sharding=sh)

    return jax.tree.map(one, shardings, tree)


def _memory(compiled) -> dict[str, int]:
    m = compiled.memory_analysis()
    return {"arguments": int(m.argument_size_in_bytes), "outputs": int(m.output_size_in_bytes),
            "temporaries": int(m.temp_size_in_bytes), "aliased": int(m.alias_size_in_bytes),
            "generated_code": int(m.generated_code_size_in_bytes)}


def compile_steps(cfg: Config, steps=("train", "eval"), mesh=None) -> dict[str, dict]:
    """{"train": {...}, "eval": {...}}: per-chip bytes of the compiled steps at the config's shapes
    (`_memory`'s keys), "compile_seconds" and "kernels" (Mosaic kernel calls: splash attention on
    TPU); compiled for TPU also "predicted", the compiler's time of one step (`ProgramCost`).
    `mesh`: where to compile (e.g. a TPU slice's, `slice_mesh`); default the config's mesh
    over this host's (fake) devices."""
    out = {}
    for step, (compiled, seconds) in compile_programs(cfg, steps, mesh).items():
        out[step] = {**_memory(compiled), "compile_seconds": seconds,
                     "kernels": compiled.as_text().count("tpu_custom_call")}
        if mesh is not None and on_tpu(mesh):  # the compiler's time estimate (parallel/tpu_cost.py)
            out[step]["predicted"] = dataclasses.asdict(program_cost(compiled, mesh.devices.flat[0]))
    return out


def compile_programs(cfg: Config, steps=("train", "eval"), mesh=None) -> dict:
    """{"train": (compiled, seconds), "eval": ...}: the steps lowered with the trainer's shardings
    on `mesh` (default: the config's mesh over this host's devices) and compiled."""
    if mesh is None:
        m = cfg.mesh
        n = m.data * m.fsdp * m.tensor
        if jax.device_count() < n:
            raise RuntimeError(f"compiling for mesh {m.data}x{m.fsdp}x{m.tensor} needs {n} devices "
                               f"but {jax.device_count()} "
                               f"exist: call use_fake_devices({n}) before JAX starts (the plan command does)")
        mesh = make_mesh(m.data, m.fsdp, m.tensor, devices=jax.devices()[:n])
    target, drafter = abstract_models(cfg)
    dg, params, frozen = nnx.split(drafter, nnx.Param, Frozen)
    tg, tstate = nnx.split(target)
    tc = cfg.train
    tx, _ = make_optimizer(tc.lr, 1000, tc.warmup_frac, tc.b1, tc.b2, tc.weight_decay, tc.clip_norm)
    compute = jnp.bfloat16 if tc.compute_dtype == "bfloat16" else None
    loss_fn = make_loss_fn(dg, tg, registry.get_kind(cfg.drafter.kind), LossCoefs.from_train(tc, cfg.drafter.gamma),
                           tc.anchor_chunk, compute, tc.eagle3_steps, tc.remat)
    rep = NamedSharding(mesh, P())
    p_sh = state_shardings(params, mesh)
    params_a = _abstract(params, p_sh)
    opt = jax.eval_shape(tx.init, params_a)
    # Adam moments are laid out like their parameters, counters replicated (as the trainer does)
    leaf_sh = jax.tree.map(lambda x: x.sharding, params_a)
    opt_sh = optax.tree_map_params(tx, lambda _, sh: sh, opt, leaf_sh, transform_non_params=lambda _: rep)
    opt_a = _abstract(opt, opt_sh)
    state = TrainState(jax.ShapeDtypeStruct((), jnp.int32, sharding=rep), params_a, opt_a)
    # the drafter's frozen embedding / LM head are the target's arrays (its dtype); XLA counts
    # them as arguments a second time although at run time they are the same buffers
    frozen_a = _abstract(frozen, state_shardings(frozen, mesh),
                         jnp.bfloat16 if cfg.target.dtype == "bfloat16" else jnp.float32)
    tstate_a = _abstract(tstate, state_shardings(tstate, mesh))
    b, s, a = tc.batch_size, cfg.data.seq_len, cfg.data.num_anchors
    g = registry.resolve(cfg.target.model, cfg.drafter).gamma
    bsh = NamedSharding(mesh, P(("data", "fsdp")))

    def sds(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=bsh)

    batch = {"tokens": sds((b, s), jnp.int32), "loss_mask": sds((b, s), bool), "seq_valid": sds((b, s), bool),
             "anchors": sds((b, a), jnp.int32), "keep": sds((b, a), bool), "block_valid": sds((b, a, g), bool)}
    micro_sh = NamedSharding(mesh, P(None, ("data", "fsdp")))
    # traced under the mesh: kernels (splash attention) are chosen for its devices' platform
    with jax.set_mesh(mesh):
        return _compile(steps, loss_fn, tx, tc, state, frozen_a, tstate_a, params_a, batch, micro_sh)


def _timed(name: str, jitted, *args):
    t0 = time.perf_counter()
    try:
        compiled = jitted.lower(*args).compile()
    except Exception as e:  # XLA:TPU refuses a program that cannot fit the chip's HBM
        reason = hbm_refusal(e)
        if reason is None:
            raise
        raise ValueError(f"the {name} step does not fit on the chip, the TPU compiler refused it: {reason}; "
                         "raise train.grad_accum, set train.remat=drafter_layers or shard wider "
                         "(mesh.fsdp / mesh.tensor)") from None
    seconds = time.perf_counter() - t0
    log.info("compiled the %s step in %.1f s", name, seconds)
    return compiled, seconds


def _compile(steps, loss_fn, tx, tc, state, frozen_a, tstate_a, params_a, batch, micro_sh):
    out = {}
    if "train" in steps:
        state_sh = jax.tree.map(lambda x: x.sharding, state)
        train = jax.jit(make_train_step(loss_fn, tx, tc.grad_accum, micro_sh), donate_argnums=(0,),
                        out_shardings=(state_sh, None, None))
        out["train"] = _timed("train", train, state, frozen_a, tstate_a, batch)
    if "eval" in steps:
        ev = jax.jit(make_eval_step(loss_fn, tc.grad_accum, micro_sh))
        out["eval"] = _timed("eval", ev, params_a, frozen_a, tstate_a, batch)
    return out


def peak(mem: dict[str, int]) -> int:
    """What a chip must hold at once: arguments + outputs not aliased to them + temporaries."""
    return mem["arguments"] + mem["outputs"] - mem["aliased"] + mem["temporaries"]
