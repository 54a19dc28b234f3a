"""The target-only decode step of a preset on a TPU slice, priced by the TPU compiler beside its
read-once price and broken down by instruction: the figures of docs/performance.md's predicted
table and of its "what is left" notes (`python -m dspark_jax bench step`).

All of it is predicted (XLA:TPU cost model, deviceless): a CPU host compiles for the slice.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.engine.config import EngineConfig
from dspark_jax.engine.plan import abstract_engine, plan_mesh
from dspark_jax.engine.predict import _round_compiled
from dspark_jax.engine.read_once import kv_bytes_per_chip, read_once_seconds
from dspark_jax.parallel.tpu_breakdown import instruction_breakdown
from dspark_jax.parallel.tpu_cost import kernel_pricer, program_cost

__all__ = ["StepPrice", "price_target_step"]


@dataclasses.dataclass(frozen=True)
class StepPrice:
    slots: int
    step_s: float  # the compiled target-only step, one chip
    read_once: dict  # engine.read_once.read_once_seconds: weights, kv, total, products
    breakdown: list  # [(seconds, instruction group, result type)], costliest first

    @property
    def ratio(self) -> float:
        return self.step_s / self.read_once["total"]


def price_target_step(cfg, topology: str, mesh_shape: tuple[int, int, int], *, slots: int, context: int,
                      auto_weight_layouts: bool = False, top: int = 20) -> StepPrice:
    """The greedy target-only step of `slots` rows over caches of `context` tokens (full-size),
    compiled for `topology` laid out as `mesh_shape` (data, fsdp, tensor)."""
    mesh = plan_mesh(mesh_shape, topology)
    ab = abstract_engine(cfg, mesh, EngineConfig(num_slots=slots, max_len=context, buckets=(slots,)), drafter=False)
    compiled = _round_compiled(ab, slots, ab.eng.control(SamplingParams(0.0, 0, 1.0)),
                               auto_weight_layouts=auto_weight_layouts)
    device = mesh.devices.flat[0]
    cost = program_cost(compiled, device)
    m = cfg.target.model
    tensor = mesh_shape[2]
    itemsize = 2 if cfg.target.dtype == "bfloat16" else 4
    kv = kv_bytes_per_chip(m, slots=slots // mesh_shape[0], context=context, tensor=tensor, itemsize=itemsize)
    floor = read_once_seconds(m, device, rows=max(slots // mesh_shape[0], 8), tensor=tensor, kv_bytes_per_chip=kv,
                              dtype=jnp.bfloat16 if itemsize == 2 else jnp.float32)
    hlo = compiled.as_text()
    kernels = kernel_pricer(hlo, device, cost.clock_hz)
    return StepPrice(slots=slots, step_s=cost.seconds, read_once=floor,
                     breakdown=instruction_breakdown(hlo, cost.clock_hz, top, kernels))
