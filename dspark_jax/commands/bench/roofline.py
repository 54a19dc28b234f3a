"""`python -m dspark_jax bench roofline PRESET`: each decode program of the engine beside its roofline.

    python -m dspark_jax bench roofline configs/smollm2_135m_dspark.yaml --slots 1 8 --context 1024
    python -m dspark_jax bench roofline --target tiny --slots 1 --context 64 --json out.json
    python -m dspark_jax bench roofline configs/qwen3_8b_dspark.yaml --topology v6e-8 --slots 8 --context 2048

Measured (the default): random models of the preset's shapes on this backend; this device's
memory bandwidth (a large copy) and matmul rate measured in the same run; then the target-only
step, the round at each verification bucket, the draft alone and a prefill of an engine of R
slots x the context, with its caches filled, each timed (best of --repeats after a compile) and
set against its roofline: max(bytes it must read / bandwidth, FLOPs / matmul rate), the bytes
and FLOPs counted from its weights and KV (bench/roofline_model.py says what is counted), and
each compiled program's memory_analysis(). One engine and one decode state are held at a time
(the target-only engine is dropped before the DSpark one is built, each program's states freed
before the next's are made; both engines read the model's one copy of the target's weights), and
the device bytes alive after each program are reported. With --topology the same programs are compiled for a
Cloud TPU slice on this machine and every time is the XLA:TPU cost model's estimate, set against
one chip's bytes and FLOPs at the rates the compiler prices a chip at: predicted, not measured.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from dspark_jax.cli import parse_mesh_shape, report_user_errors

PROG = "python -m dspark_jax bench roofline"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1],
                                 epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("preset", nargs="?", help="a DSpark or DFlash preset (path or name), e.g. "
                                              "configs/qwen3_8b_dspark.yaml, smollm2_135m_dspark, micro")
    ap.add_argument("--target", choices=["tiny"], help="the tiny test shapes instead of a preset (measured only)")
    ap.add_argument("--slots", type=int, nargs="+", default=[8], metavar="R", help="request slots; several give a "
                    "table each (default 8)")
    ap.add_argument("--context", type=int, default=2048, help="tokens per slot, the engine's max_len (default 2048)")
    ap.add_argument("--fill", type=float, default=1.0, help="caches filled to this share of the room a round leaves "
                    "(context - gamma - 2); default 1.0")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="weights, caches and the matmul rate's operands (default bfloat16, as served)")
    ap.add_argument("--gamma", type=int, default=None, help="the drafter's block (default: the preset's; tiny: 7)")
    ap.add_argument("--prefill-tokens", type=int, default=256, help="prompt tokens of the timed prefill (default "
                    "256, at most the fill)")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per program after the compile (default 5)")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of the rounds (default 0)")
    ap.add_argument("--copy-mib", type=int, default=256, help="size of the bandwidth copy (default 256 MiB)")
    ap.add_argument("--matmul-n", type=int, default=2048, help="the matmul rate's [n, n] x [n, n] (default 2048)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write every figure to this JSON file")
    ap.add_argument("--topology", default=None, metavar="SLICE", help="predict for a Cloud TPU slice (v5e-1, v6e-8, "
                    "v5p-8, ...) with the TPU compiler instead of measuring here (libtpu; no TPU needed)")
    ap.add_argument("--mesh", default=None, metavar="DATA,FSDP,TENSOR", help="with --topology: default 1,1,N")
    return ap


def _args(argv):
    args = _parser().parse_args(argv)
    if (args.preset is None) == (args.target is None):
        raise ValueError("give a preset (e.g. configs/smollm2_135m_dspark.yaml) or --target tiny, one of the two")
    if args.topology and args.target:
        raise ValueError("--topology compiles a preset's engine for the slice: give a preset (e.g. micro), "
                         "not --target tiny")
    if args.mesh and not args.topology:
        raise ValueError("--mesh lays the programs out on a TPU slice: give --topology too")
    bad = [r for r in args.slots if r < 1]
    if bad:
        raise ValueError(f"--slots {bad[0]}: an engine needs at least 1 slot")
    checks = [(args.context >= 8, f"--context {args.context}: give at least 8 tokens"),
              (0 < args.fill <= 1, f"--fill {args.fill}: give a share in (0, 1]"),
              (args.repeats >= 1, f"--repeats {args.repeats}: give at least 1"),
              (args.prefill_tokens >= 2, f"--prefill-tokens {args.prefill_tokens}: give at least 2"),
              (args.gamma is None or args.gamma >= 1, f"--gamma {args.gamma}: give at least 1"),
              (args.copy_mib >= 1 and args.matmul_n >= 16, "--copy-mib >= 1 and --matmul-n >= 16")]
    for ok, msg in checks:
        if not ok:
            raise ValueError(msg)
    return args


def _measured(args, say) -> dict:
    import jax
    import jax.numpy as jnp

    from dspark_jax.bench import roofline_model as rm
    from dspark_jax.bench.roofline_measure import best_rates, device_rates, measure_programs, random_models

    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    target, drafter, name = random_models(args.preset, dtype, args.gamma)

    def rates_now(when: str) -> dict:
        say(f"[roofline] {name}: measuring this device's copy bandwidth and {args.dtype} matmul rate ({when} the "
            "programs; the best of the two is used)")
        return device_rates(dtype, args.copy_mib, args.matmul_n, args.repeats)

    before = rates_now("before")
    runs = [measure_programs(target, drafter, slots=R, context=args.context, fill=args.fill, prompt=args.prefill_tokens,
                             repeats=args.repeats, temperature=args.temperature, say=say) for R in args.slots]
    after = rates_now("after")
    rates = {**best_rates(before, after), "before": before, "after": after}
    for R, run in zip(args.slots, runs):
        run.update(slots=R, rows=rm.table_rows(run.pop("programs"), rates["bandwidth"], rates["flop_rate"]))
    dev = jax.devices()[0]
    return {"source": f"measured on {jax.default_backend()} ({dev.device_kind})", "model": name,
            "backend": jax.default_backend(), "device_kind": dev.device_kind, "rates": rates, "runs": runs}


def _predicted(args, say) -> dict:

    from dspark_jax.bench import roofline_model as rm
    from dspark_jax.bench.roofline_predict import PREDICTED, predict_programs
    from dspark_jax.config import served_config
    from dspark_jax.engine.predict import libtpu_version
    from dspark_jax.parallel.slices import parse_slice
    from dspark_jax.parallel.topology import slice_devices

    slc = parse_slice(args.topology)
    mesh_shape = parse_mesh_shape(args.mesh, len(slice_devices(slc)))
    cfg = served_config(args.preset, args.dtype, args.gamma)
    runs = []
    for R in args.slots:
        say(f"[roofline] {args.preset} on {slc.name}, mesh {mesh_shape}, {R} slots x {args.context}: compiling the "
            "target-only step, the round per bucket, the draft and a prefill for the slice")
        res = predict_programs(cfg, slots=R, context=args.context, topology=slc.name, mesh_shape=mesh_shape,
                               fill=args.fill, prompt=args.prefill_tokens, temperature=args.temperature, say=say)
        rates = res.pop("rates")
        costs = [p.pop("cost") for p in res["programs"]]
        rows = rm.table_rows(res.pop("programs"), rates["bandwidth"], rates["flop_rate"], per_chip=True)
        for r, c in zip(rows, costs):
            r.update(source=PREDICTED, cost=c)
        runs.append({"slots": R, **res, "rows": rows, "rates": rates})
    return {"source": f"{PREDICTED}, {slc.name}, libtpu {libtpu_version()}", "model": args.preset,
            "backend": "tpu (compiled on this host for the slice; no TPU ran)", "device_kind": rates["device_kind"],
            "topology": slc.name, "mesh": list(mesh_shape), "predicted": PREDICTED, "runs": runs}


def _report(doc: dict, args) -> str:
    from dspark_jax.bench import roofline_model as rm

    predicted = doc.get("predicted")
    out = [f"# {doc['source']}; jax {doc['jax']}", f"# {doc['command']}"]
    if not predicted:
        r = doc["rates"]
        out.append(f"bandwidth {r['bandwidth'] / 1e9:.2f} GB/s used (copy: {r['copy_rate'] / 1e9:.2f} GB/s copied = "
                   f"{r['copy_traffic'] / 1e9:.2f} GB/s read + written; read stream {r['read_rate'] / 1e9:.2f} GB/s), "
                   f"matmul {r['flop_rate'] / 1e9:.1f} GFLOP/s ({r['matmul_dtype']}, n = {r['matmul_n']}); "
                   "each the best "
                   "measured before and after the programs")
    for run in doc["runs"]:
        rates = run.get("rates")
        head = (f"\n{doc['model']}, {args.dtype}, {run['slots']} slots x {args.context} tokens, caches filled to "
                f"{run['fill']}, gamma {run['gamma']}, prefill prompts of {run['prompt']} tokens")
        if rates:
            head += (f"\nper chip ({rates['device_kind']}), {predicted}: HBM {rates['bandwidth'] / 1e9:.0f} GB/s, "
                     f"matmul {rates['flop_rate'] / 1e12:.1f} TFLOP/s (the compiler's kernel rates)")
        out += [head, rm.format_table(run["rows"], predicted), "", rm.format_memory(run["memory"])]
        if run.get("live_bytes"):
            live = run["live_bytes"]
            out.append("device bytes alive after each program, its decode states freed (MiB): "
                       + ", ".join(f"{k} {v / 2 ** 20:.1f}" for k, v in live.items()))
        if predicted:
            out.append("(round and draft: the compiled round's memory is `python -m dspark_jax plan engine`'s)")
    return "\n".join(out)


@report_user_errors
def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _args(argv)
    import jax

    say = lambda s: print(s, file=sys.stderr, flush=True)
    doc = _predicted(args, say) if args.topology else _measured(args, say)
    doc = {"command": f"{PROG} {shlex.join(argv)}", "jax": jax.__version__, "dtype": args.dtype,
           "context": args.context, "fill_share": args.fill, "temperature": args.temperature, **doc}
    print(_report(doc, args))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1, default=float))
        print(f"wrote {args.json}")
    return 0
