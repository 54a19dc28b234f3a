"""`python -m dspark_jax costs measure | predict | roofline | show | plot`: verification cost tables
measured on the engine's compiled round (engine/timing.py), predicted by the TPU compiler for a
Cloud TPU slice (engine/predict.py), written from a roofline model, shown or plotted (the table
format: dspark_jax/scheduler/costs.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from dspark_jax.cli import add_kv_pages_argument, parse_mesh_shape, report_user_errors
from dspark_jax.names import KIND_NAMES


def _build_engine(args):
    """The engine to time: random models of a config's (or the tiny) shapes, whose timing does not
    depend on the weights' values, or a checkpoint directory with a trained drafter directory, the
    models that will serve."""
    import jax.numpy as jnp

    from dspark_jax.config import from_cli
    from dspark_jax.drafter.kinds.eagle3 import EAGLE3
    from dspark_jax.drafter.random_models import random_drafter, random_target, tiny_config
    from dspark_jax.engine import Engine, EngineConfig
    from dspark_jax.io.loading import load_models

    buckets = [int(b) for b in args.buckets.split(",")] if args.buckets else None
    drafter_dir = args.drafter if Path(args.drafter).is_dir() else None
    e3 = args.drafter == EAGLE3.name  # the random Eagle3 drafter fuses target layer 0
    # a skip rule (any: every timed round is pinned) so that the round that skips drafting is
    # compiled and timed too: the table's `t_skip`, what a skipped round costs the scheduler
    kw = dict(max_len=args.max_len, gamma=args.gamma if e3 else None, layer_ids=(0,) if e3 else None,
              policy="fixed", skip_drafting="best_case")
    if (Path(args.model) / "config.json").is_file():

        lt, drafter, _ = load_models(args.model, drafter_dir, None if drafter_dir else "ar", args.dtype)
        target, cfg = lt.model, lt.model.cfg
        if drafter_dir:
            kw.update(gamma=None, layer_ids=None)  # the trained drafter's own
        elif args.drafter != "none":
            drafter = random_drafter(args.drafter, target, gamma=args.gamma)
    elif drafter_dir:
        raise ValueError(f"--drafter {args.drafter} is a trained drafter: give --target the checkpoint directory it "
                         "was trained for (a config or 'tiny' times random models)")
    else:
        dcfg = None
        if args.model == "tiny":
            cfg = tiny_config()
        else:

            full = from_cli([args.model])
            cfg = full.target.model
            if args.drafter in ("dspark", "dflash"):  # the preset's drafter (layers, features, Markov rank), not a toy
                dcfg = dataclasses.replace(full.drafter, kind=args.drafter, gamma=args.gamma)
        dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
        target = random_target(cfg, param_dtype=dtype)
        drafter = None if args.drafter == "none" else random_drafter(
            args.drafter, target, gamma=args.gamma, dcfg=dcfg, dtype=None if dtype == jnp.float32 else dtype)
    eng = Engine(target, drafter, EngineConfig(num_slots=args.num_slots, buckets=buckets, **kw))
    return eng, cfg, lambda r: Engine(target, drafter, EngineConfig(num_slots=r, **kw))

def _cmd_measure(args) -> int:
    import time

    import jax

    from dspark_jax.decoding.sampling import SamplingParams
    from dspark_jax.engine.timing import draft_time, measure_engine
    from dspark_jax.scheduler.costs import MEASURED_ON, save_cost_file

    eng, cfg, make_engine = _build_engine(args)
    dev = jax.devices()[0]
    log = lambda s: print(s, flush=True)
    log(f"backend {jax.default_backend()} ({dev.device_kind}); R={eng.R} G={eng.G} buckets {list(eng.buckets)}")

    # Rounds price differently by temperature: greedy rows skip the sampled path (rejection over
    # the vocabulary at every verified position), so a table is measured at the serving setting.
    kw = dict(repeats=args.repeats, warmup=args.warmup, stat=args.stat,
              sampling=SamplingParams(args.temperature, 0, 1.0))
    res = measure_engine(eng, log=log, **kw)
    extra = {}
    if args.draft_requests and eng.G:
        rs = sorted({int(r) for r in args.draft_requests.split(",")} | {eng.R})
        tds = [res["t_draft"] if r == eng.R else draft_time(make_engine(r), **kw) for r in rs]
        for r, t in zip(rs, tds):
            log(f"draft per round at {r:4d} requests: {1e3 * t:.3f} ms")
        extra = {"draft_requests": rs, "t_draft_by_requests": tds}
    if "t_skip" in res:
        extra["t_skip"] = res["t_skip"]
    path = save_cost_file(
        args.out, res["buckets"], res["t_verify"], res["t_draft"], backend=jax.default_backend(),
        device_kind=dev.device_kind,
        provenance=(f"measured by `python -m dspark_jax costs measure` on {jax.default_backend()} ({dev.device_kind}), "
                    f"model {args.model}, drafter {args.drafter}, {args.dtype}, temperature {args.temperature:g}, "
                    f"{'the checkpoint' if (Path(args.model) / 'config.json').is_file() else 'random'} weights; "
                    "t_verify(b) = compiled round "
                    "landing in bucket b minus the engine's draft function on the same state"),
        measured_on=MEASURED_ON, t_round=res["t_round"], t_draft_paired=res["t_draft_paired"], plan=res["plan"],
        clipped=res["clipped"], repriced=res["repriced"],
        engine={"num_slots": eng.R, "gamma": eng.G, "mode": eng.mode, "max_len": eng.S, "model": args.model,
                "hidden_size": cfg.hidden_size, "num_layers": cfg.num_layers, "vocab_size": cfg.vocab_size,
                "dtype": args.dtype},
        measure={"repeats": args.repeats, "warmup": args.warmup, "stat": args.stat, "temperature": args.temperature,
                 "when": time.strftime("%Y-%m-%d %H:%M:%S")}, **extra)
    log(f"wrote {path}")
    return 0


def _cmd_predict(args) -> int:
    import jax

    from dspark_jax.config import ConfigError, served_config
    from dspark_jax.engine.predict import libtpu_version, predict_table
    from dspark_jax.parallel.slices import parse_slice
    from dspark_jax.parallel.topology import slice_devices
    from dspark_jax.scheduler.costs import FORMAT, write_checked

    slc = parse_slice(args.topology)
    mesh_shape = parse_mesh_shape(args.mesh, len(slice_devices(slc)))
    # --block: the drafter as trained with another block size (what it drafts per round)
    cfg = served_config(args.config, args.dtype, args.block)
    buckets = [int(b) for b in args.buckets.split(",")] if args.buckets else None
    only = keep = None
    if args.programs:
        if not Path(args.out).exists():
            raise ConfigError(f"--programs recompiles part of the table in --out, and {args.out} does not exist: "
                              "predict the whole table first (drop --programs)")
        keep = json.loads(Path(args.out).read_text())
        only = {n.replace("@R", f"@{args.slots}") if n in ("round@R", "skip@R") else n
                for n in args.programs.split(",") if n}
    log = lambda s: print(s, flush=True)
    log(f"{args.config} on {slc.name} (jax {jax.__version__}, TPU compiler libtpu {libtpu_version()}), "
        f"mesh {mesh_shape}, {args.slots} slots x {args.context} tokens: compiling the draft, one round per bucket "
        "and the target-only step")
    try:
        d = predict_table(cfg, slots=args.slots, context=args.context, topology=slc.name, mesh_shape=mesh_shape,
                          gamma=args.gamma, kv_pages=args.kv_pages, temperature=args.temperature, buckets=buckets,
                          target_only=not args.no_target_only, progress=log, only=only, keep=keep,
                          draft_kinds=tuple(k for k in args.draft_kinds.split(",") if k))
    except ValueError as e:
        if only is None:
            raise
        raise ConfigError(f"--programs: {e}") from None
    d = {"format": FORMAT, "backend": "tpu", "device_kind": slc.name, **d,
         "target": Path(args.config).stem, "drafter": cfg.drafter.kind}
    path = write_checked(args.out, d)
    log(f"wrote {path} (predicted, not measured)")
    return 0


def _cmd_roofline(args) -> int:
    from dspark_jax.scheduler.costs import roofline_table, write_checked

    path = write_checked(args.out, roofline_table())
    print(f"wrote {path}")
    return 0


def _cmd_show(args) -> int:
    from dspark_jax.scheduler.costs import describe_table, load_cost_file

    d = load_cost_file(args.path)
    print(describe_table(d, args.path))
    print(f"backend {d['backend']} ({d['device_kind']}); t_draft {1e3 * d['t_draft']:.3f} ms")
    print(f"provenance: {d.get('provenance')}")
    for b, t in zip(d["buckets"], d["t_verify"]):
        print(f"  B={b:6d}  T_verify={1e3 * t:9.3f} ms  SPS={1 / t:9.1f}  tokens/s at full bucket={b / t:12.0f}")
    return 0


def _cmd_plot(args) -> int:
    from dspark_jax.scheduler.costs import plot_tables

    print(f"wrote {plot_tables(args.paths, args.out, per_slot=args.per_slot)}")
    return 0


@report_user_errors
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspark_jax costs", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="time the engine's compiled round per bucket and its draft step")
    m.add_argument("--target", dest="model", default="tiny",
                   help="'tiny', a config name/path (e.g. micro, bench_cpu: random weights), or a checkpoint directory")
    m.add_argument("--drafter", default="dspark", metavar="{" + ",".join([*KIND_NAMES, "none"]) + "} or DIR",
                   help="drafter kind (random; with a config --target, DSpark / DFlash take its drafter section's "
                        "shape) or a trained drafter directory (with its checkpoint --target)")
    m.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="target weights and compute dtype (the drafter computes in it), as the engine would run")
    m.add_argument("--slots", dest="num_slots", type=int, default=8)
    m.add_argument("--gamma", type=int, default=7)
    m.add_argument("--max-len", type=int, default=256)
    m.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature of the timed rounds (0 = greedy, cheaper: no rejection over the "
                        "vocabulary; default 1); measure the table at the temperature it will serve")
    m.add_argument("--buckets", default=None, help="comma-separated bucket sizes (default: the engine's)")
    m.add_argument("--repeats", type=int, default=7)
    m.add_argument("--warmup", type=int, default=2)
    m.add_argument("--stat", default="median", choices=["median", "min"], help="min resists a shared, noisy host")
    m.add_argument("--draft-requests", default=None, help="also time drafting at these slot counts, e.g. 1,16,64")
    m.add_argument("--out", required=True, help="output JSON (e.g. configs/costs/<backend>_<model>.json)")
    p = sub.add_parser("predict", help="predict a table for a Cloud TPU slice with the TPU compiler's cost model "
                                       "(no TPU needed; libtpu)",
                       description="Compiles the engine's programs for the slice on this machine (the draft, one round "
                                   "per verification bucket, the target-only step) and writes the XLA:TPU cost model's "
                                   "time of each as a cost table marked as predicted (docs/tpu_predictions.md).")
    p.add_argument("config", help="a preset naming the target and drafter, e.g. configs/qwen3_8b_dspark.yaml")
    p.add_argument("--topology", required=True, metavar="SLICE",
                   help="Cloud TPU slice: v5e-8, v6e-8, v5p-8, v7x-8, ...")
    p.add_argument("--slots", type=int, required=True, help="concurrent requests R the table prices")
    p.add_argument("--context", type=int, default=2048, help="tokens per slot (prompt + completion)")
    p.add_argument("--mesh", default=None, metavar="DATA,FSDP,TENSOR", help="default 1,1,N: tensor parallel")
    p.add_argument("--gamma", type=int, default=None, help="verification length (default: the drafter's block)")
    p.add_argument("--block", type=int, default=None, help="the drafter's block size (default: the preset's)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                   help="weights and compute of target and drafter, as served")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature folded into the programs")
    p.add_argument("--buckets", default=None, help="comma-separated verification buckets (default: the engine's)")
    p.add_argument("--no-target-only", action="store_true", help="skip compiling the target-only step")
    p.add_argument("--draft-kinds", default="", help="also price these kinds' drafts (same preset), e.g. dflash,mtp1")
    add_kv_pages_argument(p)
    p.add_argument("--programs", default="", metavar="NAMES",
                   help="compile only these programs of the table already in --out, keeping the others, e.g. "
                        "round@R (the round at bucket R: the one-column view), skip@R (a round that skips "
                        "drafting), draft, target_only@R")
    p.add_argument("--out", required=True, help="output JSON, e.g. configs/costs/predicted/v6e-8_qwen3_8b_r8.json")
    r = sub.add_parser("roofline", help="write the synthetic accelerator-shaped table (documented roofline model)")
    r.add_argument("--out", default="configs/costs/accelerator_synthetic.json")
    s = sub.add_parser("show", help="print a cost table")
    s.add_argument("path")
    pl = sub.add_parser("plot", help="plot T_verify against B for cost tables (files named before* dashed)")
    pl.add_argument("paths", nargs="+")
    pl.add_argument("--out", required=True, help="PNG to write")
    pl.add_argument("--per-slot", action="store_true", help="x = B / R, y relative to B = R (tables of several R)")
    args = ap.parse_args(argv)
    if args.cmd == "measure" and args.drafter not in (*KIND_NAMES, "none") and not Path(args.drafter).is_dir():
        ap.error(f"--drafter {args.drafter!r}: give a kind ({', '.join(KIND_NAMES)}, none) "
                 "or a trained drafter directory")
    run = {"measure": _cmd_measure, "predict": _cmd_predict, "roofline": _cmd_roofline, "show": _cmd_show,
           "plot": _cmd_plot}
    return run[args.cmd](args)
