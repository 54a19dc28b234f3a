"""Plan a training run without devices: sharding divisibility on the preset's mesh, the
step's shapes traced abstractly, and a per-device memory estimate.

`python -m dspark_jax plan train configs/qwen3_8b_dspark.yaml` prints the table that
docs/tpu_memory.md records. With `--compile` the real train and eval steps are compiled: for the
preset's Cloud TPU slice (`mesh.slice`, or `--topology NAME`) by the TPU compiler on this machine
(libtpu, no TPU), else on fake CPU devices; a step whose peak exceeds a device's HBM makes the
command exit with status 1.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.config import Config
from dspark_jax.drafter import registry
from dspark_jax.drafter.abstract import abstract_models
from dspark_jax.drafter.frozen import Frozen
from dspark_jax.drafter.losses import LossCoefs
from dspark_jax.parallel.sharding import logical_to_pspec
from dspark_jax.parallel.slices import parse_slice
from dspark_jax.parallel.topology import require_libtpu, slice_mesh
from dspark_jax.train.compiled import peak
from dspark_jax.train.step import (
    TrainState,
    make_loss_fn,
    make_optimizer,
    make_train_step,
)

GIB = 2**30


class _Shape:  # what logical_to_pspec reads of a mesh
    def __init__(self, shape: dict):
        self.shape = shape


def mesh_shape(cfg: Config) -> dict[str, int]:
    m = cfg.mesh
    if m.data < 1:
        raise ValueError("planning needs an explicit mesh.data (not -1)")
    return {"data": m.data, "fsdp": m.fsdp, "tensor": m.tensor}


def shard_report(state, shape: dict, bytes_per: int | None = None) -> tuple[float, list[str]]:
    """(bytes per device, problems). Every sharded dimension must divide its mesh axes."""
    problems, total = [], 0.0
    mesh = _Shape(shape)
    for path, v in nnx.to_flat_state(state):
        names = v.get_metadata().get("out_sharding")
        try:
            spec = logical_to_pspec(names, v.shape, mesh, strict=True)
        except ValueError as e:
            problems.append(f"{'.'.join(map(str, path))}: {e}")
            spec = logical_to_pspec(names, v.shape, mesh)
        factor = 1
        for ax in spec:
            for a in (ax if isinstance(ax, tuple) else (ax,)):
                factor *= shape.get(a, 1) if a else 1
        nbytes = bytes_per or np.dtype(v.dtype).itemsize
        total += int(np.prod(v.shape)) * nbytes / factor
    return total, problems


def check_step_shapes(cfg: Config):
    """Trace one training step on abstract arrays of the preset's full shapes (no memory used)."""
    target, drafter = abstract_models(cfg)
    dg, params, frozen = nnx.split(drafter, nnx.Param, Frozen)
    tg, tstate = nnx.split(target)
    tc = cfg.train
    tx, _ = make_optimizer(tc.lr, 1000)
    loss_fn = make_loss_fn(dg, tg, registry.get_kind(cfg.drafter.kind), LossCoefs(), tc.anchor_chunk,
                           jnp.bfloat16 if tc.compute_dtype == "bfloat16" else None, tc.eagle3_steps)
    step = make_train_step(loss_fn, tx, tc.grad_accum)
    b, s, a, g = (tc.batch_size, cfg.data.seq_len, cfg.data.num_anchors,
                  registry.resolve(cfg.target.model, cfg.drafter).gamma)
    sds = jax.ShapeDtypeStruct
    batch = {"tokens": sds((b, s), jnp.int32), "loss_mask": sds((b, s), bool), "seq_valid": sds((b, s), bool),
             "anchors": sds((b, a), jnp.int32), "keep": sds((b, a), bool), "block_valid": sds((b, a, g), bool)}
    opt = jax.eval_shape(tx.init, params)
    state = TrainState(sds((), jnp.int32), params, opt)
    return jax.eval_shape(step, state, frozen, tstate, batch)


def activation_estimate(cfg: Config, micro_per_device: float) -> dict[str, float]:
    """Bytes per device of the largest live activations (analytic; see docs/tpu_memory.md)."""
    t, d, tc = cfg.target.model, registry.resolve(cfg.target.model, cfg.drafter), cfg.train
    s, a, h = cfg.data.seq_len, cfg.data.num_anchors, t.hidden_size
    bf = 2 if tc.compute_dtype == "bfloat16" else 4
    est = {
        # frozen target, no gradient: the scan keeps one layer's attention scores (fp32) and the residual
        "target forward (scores of one layer)": t.num_heads * s * s * 4 + 4 * s * h * bf,
        "target features + final hidden": (d.num_target_features + 1) * s * h * bf,
    }
    est.update(registry.get_kind(d.kind).activation_bytes(t, d, tc, s, a, bf))
    return {k: val * micro_per_device for k, val in est.items()}


def plan(cfg: Config) -> dict:
    shape = mesh_shape(cfg)
    n = int(np.prod(list(shape.values())))
    target, drafter = abstract_models(cfg)
    _, params, frozen = nnx.split(drafter, nnx.Param, Frozen)
    t_bytes, t_prob = shard_report(nnx.state(target), shape)
    p_bytes, p_prob = shard_report(params, shape, bytes_per=4)
    f_bytes, f_prob = shard_report(frozen, shape)
    batch_shards = shape["data"] * shape["fsdp"]
    micro = cfg.train.batch_size / cfg.train.grad_accum / batch_shards
    act = activation_estimate(cfg, micro)
    rows = {
        "target weights (frozen)": t_bytes,
        "drafter params (fp32 master)": p_bytes,
        "AdamW moments (fp32)": 2 * p_bytes,
        "gradients (fp32)": p_bytes,
        "frozen embed / LM head copy": f_bytes,
        **act,
    }
    n_params = sum(int(np.prod(v.shape)) for _, v in nnx.to_flat_state(params))
    return {"devices": n, "mesh": shape, "micro_batch_per_device": micro, "drafter_params": n_params,
            "rows": rows, "total": sum(rows.values()), "problems": t_prob + p_prob + f_prob}


def format_plan(name: str, p: dict) -> str:
    lines = [f"{name}: {p['devices']} devices, mesh {p['mesh']}, {p['micro_batch_per_device']:g} sequences per device "
             f"per micro-batch, drafter {p['drafter_params'] / 1e6:.1f} M trainable params"]
    for k, v in p["rows"].items():
        lines.append(f"  {k:<40} {v / GIB:8.2f} GiB")
    lines.append(f"  {'total (estimate)':<40} {p['total'] / GIB:8.2f} GiB")
    for pr in p["problems"]:
        lines.append(f"  PROBLEM: {pr}")
    return "\n".join(lines)


def format_compiled(mem: dict, estimate: float, hbm_gib: float | None = None, where: str | None = None) -> str:
    """`where`: what the steps were compiled for (default: fake CPU devices)."""

    where = where or "fake CPU devices, XLA:CPU"
    lines = [f"compiled per-chip memory ({where}; memory_analysis of the step lowered with the trainer's shardings):"]
    for step, m in mem.items():
        tot = peak(m)
        fit = f"; {hbm_gib:g} GiB HBM: margin {hbm_gib - tot / GIB:.2f} GiB" if hbm_gib else ""
        notes = [f"compiled in {m['compile_seconds']:.0f} s"] if "compile_seconds" in m else []
        notes += [f"{m['kernels']} Mosaic kernel call(s)"] if m.get("kernels") else []
        secs = f"  ({'; '.join(notes)})" if notes else ""
        lines.append(f"  {step:<6} arguments {m['arguments'] / GIB:7.2f}  outputs {m['outputs'] / GIB:7.2f} "
                     f"(aliased {m['aliased'] / GIB:.2f})  temporaries {m['temporaries'] / GIB:7.2f}  "
                     f"-> peak {tot / GIB:7.2f} GiB{fit}{secs}")
    lines.append(f"  analytic estimate above: {estimate / GIB:.2f} GiB")
    return "\n".join(lines)


def predicted_time(cfg: Config, step: dict, slc, n_devices: int) -> dict:
    """The TPU compiler's time of one train step (`step["predicted"]`, parallel/tpu_cost.py) as
    tokens/s, FLOPs utilisation (the program's FLOPs, loop bodies counted as the time counts
    them, over the devices' bf16 peak) and the wall-clock and chip-hours of the run: `train.steps`
    when set, else per 1000 steps. A cost-model estimate without host or input-pipeline time."""
    p = step["predicted"]
    seconds = p["seconds"]
    tokens = cfg.train.batch_size * cfg.data.seq_len
    flops = p["flops"] * (p["cycles"] / p["once_cycles"] if p["once_cycles"] else 1.0)
    peak = slc.peak_tflops * 1e12 * slc.chips / n_devices
    steps = cfg.train.steps or 1000
    hours = steps * seconds / 3600
    return {"step_s": seconds, "tokens_per_s": tokens / seconds, "utilisation": flops / (seconds * peak),
            "steps": steps, "steps_from": "train.steps" if cfg.train.steps else "per 1000 steps",
            "hours": hours, "chip_hours": hours * slc.chips}


def format_predicted(t: dict, slice_name: str) -> str:
    return (f"predicted train step on {slice_name} (XLA:TPU cost model, not measured): {t['step_s']:.2f} s, "
            f"{t['tokens_per_s']:,.0f} tokens/s, FLOPs utilisation {100 * t['utilisation']:.0f} %; "
            + ("per 1000 steps" if t["steps_from"] == "per 1000 steps" else f"{t['steps']} steps (train.steps)")
            + f": {t['hours']:.1f} h, {t['chip_hours']:.0f} chip-hours")


def misfits(mem: dict, hbm_gib: float, where: str = "a device") -> list[str]:
    """One line per compiled step whose peak exceeds `hbm_gib`."""

    return [f"the {step} step needs {peak(m) / GIB:.2f} GiB per device, more than the {hbm_gib:g} GiB of HBM of "
            f"{where}: raise train.grad_accum, set train.remat=drafter_layers or shard wider (mesh.fsdp / mesh.tensor)"
            for step, m in mem.items() if peak(m) > hbm_gib * GIB]


def device_hbm_gib(slc, n_devices: int) -> float:
    """HBM of one device of the slice: v4 and v7x topologies expose two devices per chip."""
    return slc.hbm_gib / (n_devices / slc.chips)


def topology_mesh(cfg: Config, name: str):
    """(slice, mesh) of the config's data x fsdp x tensor over the named slice's compile-only
    devices; ValueError naming the problem for an unknown slice, a mesh of the wrong size or a
    missing libtpu."""

    slc = parse_slice(name)
    require_libtpu()
    if not os.environ.get("JAX_PLATFORMS"):
        # compile only: never open a TPU this host may have
        jax.config.update("jax_platforms", "cpu")
    m = cfg.mesh
    return slc, slice_mesh(slc, m.data, m.fsdp, m.tensor)
