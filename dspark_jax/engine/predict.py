"""Cost tables predicted by the TPU compiler: the engine's programs compiled for a named slice on
this machine (no TPU) and priced by XLA:TPU's cost model (parallel/tpu_cost.py).

The measured tables (engine/timing.py) time the engine's one compiled round per bucket; the
compiler cannot price that program (its `lax.switch` over buckets and sampling paths has no
single time), so here each bucket is a program of its own: the round with that one bucket, its
sampling settings folded in as constants (the published TPU figures are greedy), plus the
round's draft part alone. As for a measured table, ``t_verify(b) = t_round(b) - t_draft``, and
the target-only step is the round of an engine without a drafter at R tokens. A round that skips
drafting is priced as a program of its own (``t_skip``): the engine's `plain_round`, the
target-only round plus the drafter's context for the verified position (the draft timed alone is
not what the draft adds to a round, so ``t_verify(R)`` is no price for it).

The figures are the compiler's estimates of one chip's time for the sharded program (the mesh's
collectives included as the compiler prices them), not measurements: host overhead, launch
latency and kernel efficiency beyond the cost model are not in them (docs/tpu_predictions.md
holds them against published TPU runs).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import time

import jax
from jax.experimental.layout import Format, Layout

from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.engine.buckets import tiled
from dspark_jax.engine.config import EngineConfig
from dspark_jax.engine.plan import AbstractEngine, abstract_engine, plan_mesh
from dspark_jax.engine.round import draft_part, round_step
from dspark_jax.parallel.collectives import collective_pricer
from dspark_jax.parallel.slices import tpu_generation
from dspark_jax.parallel.tpu_cost import ProgramCost, program_cost
from dspark_jax.scheduler.costs import PREDICTED_ON, SKIPPED_ROUND, bucket_plan
from dspark_jax.target.kernels import row_tile

__all__ = ["predict_table", "reprice", "with_collectives", "libtpu_version"]

log = logging.getLogger(__name__)



def libtpu_version() -> str:
    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _abstract_args(ab: AbstractEngine):
    sds = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
    return (ab.tp, ab.dt, jax.tree.map(sds, ab.state, ab.state_sh))


def _round_compiled(ab: AbstractEngine, bucket: int, ctl, width: int | None = None, skip: bool = False,
                    auto_weight_layouts: bool = False):
    """The round of one bucket compiled for the abstract engine's slice. `auto_weight_layouts`: the
    decoder layers' weights in layouts the compiler chooses (`Layout.AUTO`), not the row-major ones
    the engine places them in; an experiment for docs/performance.md, not what the engine runs."""
    spec = dataclasses.replace(ab.eng.spec, buckets=tiled((bucket,), row_tile(ab.mesh)),
                               verify_widths=(width,) if width else (),
                               **({"skip_drafting": "always"} if skip else {}))

    def one_round(tp, dt, s):
        return round_step(spec, tp, dt, s, ctl)

    tp_sh = ab.tp_sh
    if auto_weight_layouts:
        tp_sh = {**tp_sh, "layers": jax.tree.map(lambda sh, a: Format(Layout.AUTO, sh) if a.ndim >= 2 else sh,
                                                 tp_sh["layers"], ab.tp["layers"])}
    with jax.set_mesh(ab.mesh):
        lowered = jax.jit(one_round, in_shardings=(tp_sh, ab.dt_sh, ab.state_sh),
                          out_shardings=(ab.state_sh, None), donate_argnums=(2,)).lower(*_abstract_args(ab))
        return lowered.compile()


def _collectives(ab: AbstractEngine):
    """parallel/collectives.py's price for the abstract engine's slice (None off TPU or without a figure)."""
    device = ab.mesh.devices.flat[0]
    if device.platform != "tpu":
        return None
    return collective_pricer(tpu_generation(device.device_kind), ab.mesh.shape.get("tensor", 1))


def _round_cost(ab: AbstractEngine, bucket: int, ctl, width: int | None = None, skip: bool = False) -> ProgramCost:
    return program_cost(_round_compiled(ab, bucket, ctl, width, skip), ab.mesh.devices.flat[0], _collectives(ab))


def _draft_compiled(ab: AbstractEngine, ctl):
    """The round's draft part alone compiled for the abstract engine's slice."""
    spec = ab.eng.spec

    def draft_only(dt, s):
        return draft_part(spec, dt, s, ctl.sampling)

    with jax.set_mesh(ab.mesh):
        _, dt, st = _abstract_args(ab)
        return jax.jit(draft_only, in_shardings=(ab.dt_sh, ab.state_sh)).lower(dt, st).compile()


def _draft_cost(ab: AbstractEngine, ctl) -> ProgramCost:
    return program_cost(_draft_compiled(ab, ctl), ab.mesh.devices.flat[0], _collectives(ab))


def _derive_times(d: dict) -> dict:
    """The table's times from its programs' seconds: as for a measured table, t_verify(b) =
    t_round(b) - t_draft; the target-only step and other kinds' drafts where they were priced."""
    t = {n: p["seconds"] for n, p in d["programs"].items()}
    t_draft = t.get("draft", 0.0)
    t_round = [t[f"round@{b}"] for b in d["buckets"]]
    out = {**d, "t_draft": t_draft, "t_round": t_round, "t_verify": [max(x - t_draft, 1e-9) for x in t_round]}
    skip = f"skip@{d['engine']['num_slots']}"
    if skip in t:
        out["t_skip"] = t[skip]
    if "target_only@R" in t:
        out["t_target_step"] = t["target_only@R"]
    if d.get("t_draft_by_kind"):
        out["t_draft_by_kind"] = {kind: {**v, "t_draft_by_requests": [t[f"draft[{kind}]"]]}
                                  for kind, v in d["t_draft_by_kind"].items()}
    return out


def with_collectives(d: dict) -> dict:
    """A predicted table's times with each program's collectives added as parallel/collectives.py
    prices them (`collective_seconds`, recorded beside the compiler's `seconds`)."""
    missing = [n for n, p in d["programs"].items() if "collective_seconds" not in p]
    if missing:
        raise ValueError(f"programs {', '.join(missing)} were predicted before collectives were priced: predict the "
                         "table again (python -m dspark_jax costs predict ...)")
    progs = {n: {**p, "seconds": p["seconds"] + p["collective_seconds"]} for n, p in d["programs"].items()}
    return {**_derive_times({**d, "programs": progs}),
            "provenance": d.get("provenance", "") + "; collectives added (parallel/collectives.py's stated model)"}


def reprice(d: dict, clock_hz: float) -> dict:
    """A predicted table's times re-derived from its programs' cycles at another clock (when the
    clock calibration changes; tpu_cost.chip_clock_hz), without compiling the programs again."""
    progs = {n: {**p, "clock_hz": clock_hz, "seconds": p["cycles"] / clock_hz} for n, p in d["programs"].items()}
    return _derive_times({**d, "programs": progs})


def predict_table(cfg, *, slots: int, context: int, topology: str, mesh_shape: tuple[int, int, int],
                  gamma: int | None = None, kv_pages: tuple[int, int] | None = None, temperature: float = 0.0,
                  buckets=None, target_only: bool = True, draft_kinds=(), progress=None,
                  only=None, keep: dict | None = None) -> dict:
    """A cost dict (scheduler/costs.py's format) for `cfg`'s target and drafter on `topology`,
    R = `slots` x `context`: t_verify per bucket, t_draft, the target-only step (`target_only`),
    the draft of each kind in `draft_kinds` (the same preset with that drafter kind) under
    "t_draft_by_kind", every program's estimate under "programs". With `only` (program names),
    just those are compiled and the others taken from `keep` (an earlier prediction of the same
    entry)."""
    if only is not None and keep is None:
        raise ValueError("predict_table(only=...) prices the other programs from `keep`, an earlier table")
    mesh = plan_mesh(mesh_shape, topology)
    config = EngineConfig(num_slots=slots, max_len=context, gamma=gamma, kv_pages=kv_pages,
                          buckets=None if buckets is None else tuple(int(b) for b in buckets))
    ab = abstract_engine(cfg, mesh, config, drafter_in_target_dtype=True)
    eng = ab.eng
    ctl = eng.control(SamplingParams(temperature, 0, 1.0))
    programs, say = {}, progress or (lambda s: log.info(s))

    def priced(name, fn, **facts):
        if only is not None and name not in only:
            if name in keep["programs"]:  # a program the kept table predates is left out
                programs[name] = keep["programs"][name]
            return
        t0 = time.perf_counter()
        c = fn()
        programs[name] = {**dataclasses.asdict(c), **facts, "compile_s": round(time.perf_counter() - t0, 1)}
        say(f"{name}: {1e3 * c.seconds:.3f} ms ({c.cycles} cycles at {c.clock_hz / 1e9:.2f} GHz; {c.collectives} "
            f"collectives; loops {sorted({n for _, n in c.loops})}), compiled in {time.perf_counter() - t0:.0f} s")

    if eng.G:
        priced("draft", lambda: _draft_cost(ab, ctl))
    plan = bucket_plan(eng.priced_buckets, slots, eng.G) if eng.G else {}
    for b in eng.priced_buckets:
        # a bucket reached only by rows verifying no drafts (skipped or scheduled to none) runs the
        # round's one-column view, as in a measured table (engine/timing.py times it on that view)
        width = 1 if plan.get(b, (0, 1))[1] == 0 else None
        priced(f"round@{b}", lambda b=b, w=width: _round_cost(ab, b, ctl, w), view_width=width or eng.G + 1)
    if eng.G:
        # the skipped round: the round without a draft (`round.plain_round`, which a skip rule's
        # rounds run), the R anchors verified alone; recorded as such (a table priced from an earlier
        # skipped round is recompiled by `tpu-predict --programs skip@R`, and its t_skip is not read:
        # scheduler.costs.skipped_round_price)
        priced(f"skip@{slots}", lambda: _round_cost(ab, slots, ctl, 1, skip=True), program=SKIPPED_ROUND)
    if target_only and eng.G:
        ab0 = abstract_engine(cfg, mesh, dataclasses.replace(config, buckets=(slots,)), drafter=False)
        ctl0 = ab0.eng.control(SamplingParams(temperature, 0, 1.0))
        priced("target_only@R", lambda: _round_cost(ab0, slots, ctl0))
    by_kind = {}
    for kind in draft_kinds:
        kcfg = dataclasses.replace(cfg, drafter=dataclasses.replace(cfg.drafter, kind=kind))
        abk = abstract_engine(kcfg, mesh, dataclasses.replace(config, gamma=None), drafter_in_target_dtype=True)
        priced(f"draft[{kind}]", lambda: _draft_cost(abk, abk.eng.control(SamplingParams(temperature, 0, 1.0))))
        by_kind[kind] = {"draft_requests": [slots], "gamma": abk.eng.G}
    if only is not None and not set(only) <= set(programs):
        raise ValueError(f"no program named {', '.join(sorted(set(only) - set(programs)))} in this prediction; "
                         f"its programs are {', '.join(programs)}")
    version = libtpu_version()
    dtype = str(jax.tree.leaves(ab.tp["layers"])[0].dtype)
    return _derive_times({
            "buckets": [int(b) for b in eng.priced_buckets], "predicted_on": PREDICTED_ON, "programs": programs,
            "provenance": (f"predicted by the XLA:TPU cost model, {topology}, libtpu {version}: the engine's round "
                           f"per bucket (one-column view where only undrafted rows reach it) and its draft "
                           f"compiled for the slice on a CPU host (no TPU), mesh data "
                           f"{mesh_shape[0]} x fsdp {mesh_shape[1]} x tensor {mesh_shape[2]}, temperature "
                           f"{temperature:g}, {'paged' if kv_pages else 'dense'} KV; NOT measured"),
            "engine": {"num_slots": slots, "gamma": eng.G, "mode": eng.mode, "max_len": context,
                       "hidden_size": cfg.target.model.hidden_size, "num_layers": cfg.target.model.num_layers,
                       "vocab_size": cfg.target.model.vocab_size, "dtype": dtype, "kv_pages": kv_pages},
            "topology": topology, "libtpu": version,
            **({"t_draft_by_kind": by_kind} if by_kind else {})})
