"""`python -m dspark_jax plan engine`: per-chip serving memory of the engine for a target preset,
R slots x a context, on a (data, fsdp, tensor) mesh, from shapes and from the compiled programs.

    python -m dspark_jax plan engine configs/qwen3_8b_dspark.yaml --topology v6e-8 --slots 32 --context 4096 --compile

Weights and caches are exact (their shapes and the rules table's shardings). With `--compile` the
engine's programs are lowered for those shardings and compiled: the round (draft, verification
over every bucket, rejection, cache update) and the prefill of the largest prompt bucket (and,
with `--prefill-chunk`, the admission of prompts into the rounds). A scheduled server's host loop
runs the skip rule's choice and each round it chooses as programs of their own
(`--programs round,host_rounds,prefill`); the round holds all of them, as the compiled loop of
rounds runs it.
`--topology NAME` (a Cloud TPU slice: v5e-8, v6e-8, v5p-8, v7x-8, ...) compiles them with the TPU
compiler for that slice on this machine, no TPU needed (parallel/topology.py); without it they
compile for fake CPU devices. XLA's `memory_analysis()` gives one chip's arguments, outputs and
temporaries. Dense caches hold `[L, R, context, kv_heads, head_dim]` whatever the slots use; with
`--kv-pages NUM,SIZE` target and drafter caches are pools of NUM pages of SIZE tokens (the
engine's `kv_pages`), sized for the tokens the slots hold at once, e.g. 128 slots averaging 2048
tokens: `--kv-pages 16384,16`. A program whose peak does not fit the chip's HBM (`--hbm-gib`, or
the slice's) makes the command exit with status 1.
"""

from __future__ import annotations

import argparse
import sys

from dspark_jax.cli import (
    add_kv_pages_argument,
    add_prefill_chunk_argument,
    parse_mesh_shape,
    prefill_chunk,
    report_user_errors,
)
from dspark_jax.names import ENGINE_POLICIES, PLAN_PROGRAMS


@report_user_errors
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspark_jax plan engine", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("config", help="a preset naming target.model (and the drafter), e.g. configs/qwen3_8b_dspark.yaml")
    ap.add_argument("--slots", type=int, default=128)
    ap.add_argument("--context", type=int, default=8192, help="tokens per slot (prompt + completion)")
    ap.add_argument("--mesh", default=None, metavar="DATA,FSDP,TENSOR",
                    help="default 1,1,N: tensor parallel over the N devices of --topology (else 1,1,8)")
    ap.add_argument("--topology", default=None, metavar="SLICE",
                    help="compile with the TPU compiler for this Cloud TPU slice (v5e-8, v6e-8, v5p-8, v7x-8, ...); "
                         "needs libtpu (pip install -e '.[aot]'), no TPU")
    ap.add_argument("--gamma", type=int, default=None, help="verification length (default: the drafter's block)")
    ap.add_argument("--policy", default="fixed", choices=ENGINE_POLICIES,
                    help="fixed gamma, or the production scheduler with its skip rule (compiles the rounds and the "
                         "bucket switch it adds)")
    ap.add_argument("--target-only", action="store_true", help="the engine without a drafter")
    ap.add_argument("--hbm-gib", type=float, default=None,
                    help="HBM per chip for the fit line (default: the slice's with --topology; v5e 16, v6e 32, v5p 95)")
    ap.add_argument("--compile", action="store_true",
                    help="also compile the round and the prefill and report the compiler's per-chip memory")
    ap.add_argument("--programs", default="round,prefill", help=f"with --compile: which of {','.join(PLAN_PROGRAMS)}")
    add_kv_pages_argument(ap)
    add_prefill_chunk_argument(ap, None)
    args = ap.parse_args(argv)
    import jax

    from dspark_jax.engine.plan import device_hbm_gib, format_plan, misfits, plan
    from dspark_jax.parallel.slices import parse_slice
    from dspark_jax.parallel.topology import slice_devices

    hbm = args.hbm_gib
    if args.topology:
        slc = parse_slice(args.topology)
        n = len(slice_devices(slc))
        hbm = hbm or device_hbm_gib(args.topology)
    else:
        n = 8
    mesh_shape = parse_mesh_shape(args.mesh, n)
    if not args.topology:
        jax.config.update("jax_num_cpu_devices", mesh_shape[0] * mesh_shape[1] * mesh_shape[2])
        jax.config.update("jax_platforms", "cpu")
    from dspark_jax.config import ConfigError, from_cli

    cfg = from_cli([args.config])
    if cfg.target.model is None:
        raise ConfigError(f"{args.config} names no target.model: use a preset such as configs/qwen3_8b_dspark.yaml")
    res = plan(cfg, args.slots, args.context, mesh_shape, args.gamma, args.compile, args.kv_pages,
               prefill_chunk(args.prefill_chunk), topology=args.topology, policy=args.policy,
               drafter=not args.target_only, programs=tuple(p for p in args.programs.split(",") if p))
    print(format_plan(args.config, args.slots, args.context, mesh_shape, res, hbm))
    bad = misfits(res, hbm)
    for line in bad:
        print(f"error: {line}", file=sys.stderr)
    return 1 if bad else 0
