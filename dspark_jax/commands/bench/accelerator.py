r"""`python -m dspark_jax bench accelerator PRESET`: first contact with an accelerator, in one run within a budget.

    python -m dspark_jax bench accelerator configs/qwen3_8b_dspark.yaml --json accel.json
    python -m dspark_jax bench accelerator tiny --slots 1 --context 64 --buckets 4 --budget 60
    BUDGET=540 bash .accel/run.sh "python3 -m dspark_jax bench accelerator configs/qwen3_8b_dspark.yaml \
        --slots 1 --budget 240 --json $OUT/accel_r1.json" "python3 -m dspark_jax bench accelerator \
        configs/qwen3_8b_dspark.yaml --slots 64 --budget 180 --json $OUT/accel_r64.json"
        (on the lent GPU machine, where run.sh gives an extra step at most 300 s: docs/performance.md)

With random weights of the preset's shapes (PRESET `tiny`: the test shapes) and nothing
downloaded, on whatever backend JAX finds, it prints as it goes:
  the backend and versions (jax, jaxlib, flax, the plugin / libtpu, the device kind, its memory);
  this device's copy bandwidth and matmul rate in the run's dtype, measured in the same run;
  the GPU cache-attention kernel against the reference attention (equal outputs within a
    tolerance, both timed against the keys' bytes; off GPU: "no GPU: skipped", reference timed);
  the target-only step, the round at each verification bucket and the draft at each slot count,
    each beside its roofline: max(bytes / bandwidth, FLOPs / matmul rate);
  every compiled program's memory_analysis() and compile seconds, and each stage's seconds,
    compile seconds and device memory after it.
Engines and states are freed between stages (`del`, `gc.collect()`), so one stage's buffers are
gone before the next allocates; the random models live for the whole run. Once --budget is
spent the remaining stages are skipped, a line naming each; a stage that fails (out of memory,
say) is reported and the run goes on; the exit status is 1 if any stage failed. --json is
rewritten after every stage, so a run killed by a timeout keeps what it measured. On a GPU,
XLA_PYTHON_CLIENT_MEM_FRACTION defaults to 0.9 here (JAX's own default 0.75 leaves 20 GB of an
80 GB GPU unused).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from dspark_jax.cli import report_user_errors

PROG = "python -m dspark_jax bench accelerator"
TINY = "tiny"
BUDGET_S = 480.0  # 8 minutes on one GPU


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1],
                                 epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("preset", help="a DSpark or DFlash preset (path or name), e.g. configs/qwen3_8b_dspark.yaml, "
                                   "or 'tiny' (the test shapes)")
    ap.add_argument("--slots", type=int, nargs="+", default=[1, 64], metavar="R",
                    help="slot counts: the target-only step, the rounds and the draft at each (default 1 64)")
    ap.add_argument("--context", type=int, default=2048, help="tokens per slot, the engine's max_len (default 2048)")
    ap.add_argument("--buckets", type=int, nargs="+", default=None, metavar="TOKENS",
                    help="verification buckets to time (tokens a round verifies); for R slots those up to "
                         "R x (gamma + 1) and that full one (default: the engine's, R, 2R, 4R, ...)")
    ap.add_argument("--fill", type=float, default=1.0, help="caches filled to this share of the room a round leaves "
                    "(context - gamma - 2); default 1.0")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="weights, caches and the matmul rate's operands (default bfloat16)")
    ap.add_argument("--gamma", type=int, default=None, help="the drafter's block (default: the preset's; tiny: 7)")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per program after its compile (default 5)")
    ap.add_argument("--budget", type=float, default=BUDGET_S, metavar="SECONDS",
                    help=f"time budget; stages after it is spent are skipped (default {BUDGET_S:g})")
    ap.add_argument("--copy-mib", type=int, default=None,
                    help="size of the bandwidth copy (default 1024 MiB on an accelerator, 256 on CPU)")
    ap.add_argument("--matmul-n", type=int, default=None,
                    help="the matmul rate's [n, n] x [n, n] (default 8192 on an accelerator, 1024 on CPU)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write every figure to this JSON file "
                    "(rewritten after every stage)")
    return ap


def _args(argv):
    args = _parser().parse_args(argv)
    checks = [(all(r >= 1 for r in args.slots), "--slots: an engine needs at least 1 slot"),
              (args.context >= 8, f"--context {args.context}: give at least 8 tokens"),
              (args.buckets is None or all(b >= 1 for b in args.buckets), "--buckets: give positive token counts"),
              (0 < args.fill <= 1, f"--fill {args.fill}: give a share in (0, 1]"),
              (args.repeats >= 1, f"--repeats {args.repeats}: give at least 1"),
              (args.gamma is None or args.gamma >= 1, f"--gamma {args.gamma}: give at least 1"),
              (args.budget > 0, f"--budget {args.budget}: give a positive number of seconds"),
              (args.copy_mib is None or args.copy_mib >= 1, "--copy-mib: give at least 1"),
              (args.matmul_n is None or args.matmul_n >= 16, "--matmul-n: give at least 16")]
    for ok, msg in checks:
        if not ok:
            raise ValueError(msg)
    return args


@report_user_errors
def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")  # read when the GPU client starts
    from dspark_jax.bench.accelerator import Settings, run
    from dspark_jax.console import show_logs

    show_logs()
    settings = Settings(preset=None if args.preset == TINY else args.preset, slots=tuple(args.slots),
                        context=args.context, buckets=None if args.buckets is None else tuple(args.buckets),
                        dtype=args.dtype, gamma=args.gamma, fill=args.fill, repeats=args.repeats,
                        copy_mib=args.copy_mib, matmul_n=args.matmul_n, budget_s=args.budget)
    command = f"{PROG} {shlex.join(argv)}"
    print(f"# {command}", flush=True)
    doc = run(settings, command=command, json_path=args.json, emit=lambda s: print(s, flush=True))
    if args.json:
        print(f"wrote {args.json}")
    return 1 if any(s["status"] == "failed" for s in doc["stages"]) else 0


if __name__ == "__main__":
    sys.exit(main())
