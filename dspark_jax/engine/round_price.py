"""A preset's speculative round on a TPU slice, priced program by program against its floors: the
target-only step, the draft, the round at every verification bucket and the round that skips
drafting (`python -m dspark_jax bench round`, docs/performance.md).

Every program is compiled for the slice on this host (libtpu, no TPU) and priced by the compiler's
cost model (parallel/tpu_cost.py). Beside it stand three other figures, none of them in the
compiler's time:

- the compiler's read-once price (engine/read_once.py): the products compiled bare at the program's
  rows and the KV at the kernel byte rate. A round's is the target step's at the bucket's rows,
  plus the draft's, plus writing the drafter's context for the verified tokens;
- the HBM floor: the bytes that price reads over the chip's datasheet HBM bandwidth
  (parallel/slices.py `HBM_GBPS`); the compiler grants some products more than that, so a
  program can sit below its HBM floor on paper;
- the collectives under the stated model of parallel/collectives.py (the compiler prices none).

Where a Pallas kernel runs, its part of the compiler's time is the cost it declares (`declared_s`).
All of it is predicted, not measured.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.engine.config import EngineConfig
from dspark_jax.engine.plan import abstract_engine, plan_mesh
from dspark_jax.engine.predict import _draft_compiled, _round_compiled
from dspark_jax.engine.read_once import (
    context_read_once_seconds,
    draft_read_once_seconds,
    kv_bytes_per_chip,
    read_once_seconds,
)
from dspark_jax.parallel.collectives import collective_pricer
from dspark_jax.parallel.slices import parse_slice
from dspark_jax.parallel.tpu_breakdown import instruction_breakdown
from dspark_jax.parallel.tpu_cost import kernel_pricer, program_cost
from dspark_jax.scheduler.costs import bucket_plan

__all__ = ["Priced", "RoundPrices", "price_rounds"]


@dataclasses.dataclass(frozen=True)
class Priced:
    """One program of one chip, predicted."""

    name: str
    seconds: float  # the compiler's estimate (collectives not in it)
    floor_s: float  # the compiler's read-once price of what it must read and compute
    nbytes: int  # what it must read (weights, KV), a chip
    hbm_s: float  # nbytes over the datasheet HBM bandwidth
    declared_s: float  # the part of `seconds` the Pallas kernels declared
    collectives: int
    collective_s: float  # the collectives under parallel/collectives.py's model
    breakdown: list  # [(seconds, instruction group, result type)], costliest first

    @property
    def ratio(self) -> float:
        return self.seconds / self.floor_s

    @property
    def with_collectives_s(self) -> float:
        return self.seconds + self.collective_s


@dataclasses.dataclass(frozen=True)
class RoundPrices:
    slots: int
    full_bucket: int
    step: Priced
    draft: Priced | None
    rounds: dict  # bucket -> Priced
    skip: Priced | None

    @property
    def programs(self) -> list[Priced]:
        """The step, the draft, the rounds by bucket, the skipped round (those priced)."""
        return [p for p in (self.step, self.draft, *self.rounds.values(), self.skip) if p is not None]

    @property
    def full(self) -> Priced:
        return self.rounds[self.full_bucket]

    def summary(self) -> dict:
        """The ratios the goals are stated in (docs/performance.md)."""
        s = self.step.seconds
        out = {"round_full / step": self.full.seconds / s}
        if self.draft is not None:
            out.update({"round_full less draft / step": (self.full.seconds - self.draft.seconds) / s,
                        "draft / round_full": self.draft.seconds / self.full.seconds,
                        "draft / its read-once": self.draft.ratio})
        if self.skip is not None:
            out["skipped round / step"] = self.skip.seconds / s
        return out


def _priced(name, compiled, device, floor: dict, hbm_bytes_per_s: float, coll, top: int) -> Priced:
    cost = program_cost(compiled, device, coll)
    hlo = compiled.as_text()
    return Priced(name=name, seconds=cost.seconds, floor_s=floor["total"], nbytes=int(floor["bytes"]),
                  hbm_s=floor["bytes"] / hbm_bytes_per_s, declared_s=cost.kernel_cycles / cost.clock_hz,
                  collectives=cost.collectives, collective_s=cost.collective_seconds,
                  breakdown=instruction_breakdown(hlo, cost.clock_hz, top, kernel_pricer(hlo, device, cost.clock_hz)))


def _plus(*floors: dict) -> dict:
    return {"total": sum(f["total"] for f in floors), "bytes": sum(f["bytes"] for f in floors)}


def price_rounds(cfg, topology: str, mesh_shape: tuple[int, int, int], *, slots: int, context: int,
                 top: int = 20, buckets=None, temperature: float = 0.0) -> RoundPrices:
    """Every program of `cfg`'s engine of `slots` x `context` on `topology` (module docstring); the
    verification buckets the engine prices (or `buckets`), greedy unless `temperature`."""
    slc = parse_slice(topology)
    mesh = plan_mesh(mesh_shape, topology)
    device = mesh.devices.flat[0]
    data, _, tensor = mesh_shape
    coll = collective_pricer(slc.generation, tensor)
    config = EngineConfig(num_slots=slots, max_len=context, buckets=None if buckets is None else tuple(buckets))
    ab = abstract_engine(cfg, mesh, config, drafter_in_target_dtype=True)
    ab0 = abstract_engine(cfg, mesh, dataclasses.replace(config, buckets=(slots,)), drafter=False)
    eng, m = ab.eng, cfg.target.model
    dtype = jax.tree.leaves(ab.tp["layers"])[0].dtype
    itemsize = jnp.dtype(dtype).itemsize
    r = slots // data
    kv = kv_bytes_per_chip(m, slots=r, context=context, tensor=tensor, itemsize=itemsize)
    target_floor = lambda rows: read_once_seconds(m, device, rows=max(rows, 8), tensor=tensor, kv_bytes_per_chip=kv,
                                                  dtype=dtype)
    hbm = slc.hbm_bytes_per_s
    price = lambda name, compiled, floor: _priced(name, compiled, device, floor, hbm, coll, top)
    sampling = SamplingParams(temperature, 0, 1.0)
    step = price("target-only step", _round_compiled(ab0, slots, ab0.eng.control(sampling)), target_floor(r))
    if not eng.G:
        return RoundPrices(slots=slots, full_bucket=slots, step=step, draft=None, rounds={slots: step}, skip=None)
    ctl = eng.control(sampling)
    shape, G = eng.spec.draft, eng.G
    rank = ab.dt["markov_w2"].shape[0] if "markov_w2" in ab.dt else 0
    dkv = kv_bytes_per_chip(shape.cfg, slots=r, context=context, tensor=tensor, itemsize=itemsize)
    draft_floor = draft_read_once_seconds(shape.cfg, device, slots=r, gamma=G, markov_rank=rank, tensor=tensor,
                                          kv_bytes_per_chip=dkv, dtype=dtype)
    context_floor = lambda rows: context_read_once_seconds(shape.cfg, len(shape.feature_layers), device, rows=rows,
                                                           tensor=tensor, dtype=dtype)
    draft = price("draft", _draft_compiled(ab, ctl), draft_floor)
    plan = bucket_plan(eng.priced_buckets, slots, G)
    rounds = {}
    for b in eng.priced_buckets:
        width = 1 if plan.get(b, (0, 1))[1] == 0 else None  # a bucket only undrafted rows reach: one column
        floor = _plus(target_floor(b // data), draft_floor, context_floor(r * (G + 1)))
        rounds[b] = price(f"round@{b}", _round_compiled(ab, b, ctl, width), floor)
    skip = price("skipped round", _round_compiled(ab, slots, ctl, 1, skip=True),
                 _plus(target_floor(r), context_floor(r)))
    return RoundPrices(slots=slots, full_bucket=max(eng.priced_buckets), step=step, draft=draft, rounds=rounds,
                       skip=skip)
