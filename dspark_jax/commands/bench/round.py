"""`python -m dspark_jax bench round`: the speculative round on a TPU slice against its floors.

    python -m dspark_jax bench round configs/qwen3_8b_dspark.yaml --topology v6e-8 --slots 1 8 64
    python -m dspark_jax bench round configs/qwen3_8b_dspark.yaml --topology v7x-8 --slots 1 128 --top 40

Compiles, for each slot count, the target-only step, the draft, the round at every verification
bucket and the round that skips drafting for the slice on this host (libtpu, no TPU) and prints
each beside its floors (engine/round_price.py): the compiler's read-once price, the bytes over
the chip's datasheet HBM bandwidth, the part its kernels declare, and its collectives under
parallel/collectives.py's model; then the goal ratios (round / step, draft / its floor) and where
the draft's and the full round's time goes, instruction group by instruction group. Every figure
is predicted (XLA:TPU cost model), not measured.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dspark_jax.cli import report_user_errors
from dspark_jax.commands.bench.step import slice_setup

PROG = "python -m dspark_jax bench round"

HEADER = (f"  {'program':18s} {'compiler':>9s} {'read-once':>9s} {'x':>5s} {'HBM floor':>9s} {'x':>5s} "
          f"{'declared':>9s} {'coll.':>5s} {'coll. ms':>8s} {'with coll.':>10s}")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1],
                                 epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("preset", help="a preset naming a target and its drafter, e.g. configs/qwen3_8b_dspark.yaml")
    ap.add_argument("--topology", required=True, metavar="SLICE", help="a Cloud TPU slice: v5e-8, v6e-8, v7x-8, ...")
    ap.add_argument("--mesh", default=None, metavar="DATA,FSDP,TENSOR", help="default 1,1,N (tensor parallel)")
    ap.add_argument("--slots", type=int, nargs="+", default=[1, 8, 64], metavar="R",
                    help="concurrent requests (default 1 8 64)")
    ap.add_argument("--context", type=int, default=2048, help="cache length per slot (default 2048)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="default bfloat16")
    ap.add_argument("--top", type=int, default=15, help="instruction groups listed per program (default 15)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the figures to this JSON file")
    return ap


def _row(p) -> str:
    ms = lambda s: f"{1e3 * s:9.3f}"
    return (f"  {p.name:18s} {ms(p.seconds)} {ms(p.floor_s)} {p.ratio:5.2f} {ms(p.hbm_s)} {p.seconds / p.hbm_s:5.2f} "
            f"{ms(p.declared_s)} {p.collectives:5d} {1e3 * p.collective_s:8.3f} {1e3 * p.with_collectives_s:10.3f}")


def _lines(rp, top: int) -> list[str]:
    out = [f"{rp.slots} slots (ms, one chip; x = compiler / floor):", HEADER, _row(rp.step)]
    out += [_row(p) for p in rp.programs[1:]]
    out.append("  " + ", ".join(f"{k} {v:.2f}" for k, v in rp.summary().items()))
    for p in ([rp.draft] if rp.draft else []) + [rp.full]:
        out.append(f"  where the {p.name}'s time goes:")
        out += [f"    {1e3 * s:8.3f} ms  {group:40s} {kind}" for s, group, kind in p.breakdown[:top]]
    return out


def _doc(rp) -> dict:
    one = lambda p: None if p is None else {
        "seconds": p.seconds, "read_once_s": p.floor_s, "bytes": p.nbytes, "hbm_s": p.hbm_s, "declared_s": p.declared_s,
        "collectives": p.collectives, "collective_s": p.collective_s, "breakdown": p.breakdown}
    return {"slots": rp.slots, "full_bucket": rp.full_bucket, "step": one(rp.step), "draft": one(rp.draft),
            "rounds": {str(b): one(p) for b, p in rp.rounds.items()}, "skip": one(rp.skip), "summary": rp.summary()}


@report_user_errors
def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    import jax

    from dspark_jax.engine.predict import libtpu_version
    from dspark_jax.engine.round_price import price_rounds
    from dspark_jax.parallel.collectives import HOP_LATENCY_S
    from dspark_jax.parallel.slices import DATASHEET, HBM_GBPS

    slc, mesh_shape, cfg = slice_setup(args)
    print(f"# {args.preset} on {slc.name}, mesh {mesh_shape}, {args.dtype}, context {args.context}, greedy; "
          f"predicted (XLA:TPU cost model, libtpu {libtpu_version()}, jax {jax.__version__})\n"
          f"# HBM floor at the datasheet's {HBM_GBPS[slc.generation]:g} GB/s ({DATASHEET}); collectives: "
          f"{HOP_LATENCY_S * 1e6:g} us a hop + bytes over the ICI ring (parallel/collectives.py), not in 'compiler'")
    doc = []
    for r in args.slots:
        rp = price_rounds(cfg, slc.name, mesh_shape, slots=r, context=args.context, top=args.top)
        print("\n".join(_lines(rp, args.top)), flush=True)
        doc.append(_doc(rp))
    if args.json:
        Path(args.json).write_text(json.dumps({"preset": args.preset, "topology": slc.name, "mesh": mesh_shape,
                                               "libtpu": libtpu_version(), "jax": jax.__version__,
                                               "slots": doc}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
