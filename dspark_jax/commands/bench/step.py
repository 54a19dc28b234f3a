"""`python -m dspark_jax bench step`: the target-only decode step on a TPU slice against its floor.

    python -m dspark_jax bench step configs/qwen3_8b_dspark.yaml --topology v6e-8 --slots 1 8 64
    python -m dspark_jax bench step configs/qwen3_8b_dspark.yaml --topology v5p-8 --slots 8 --weight-layouts auto

Compiles the greedy target-only step for the slice on this host (libtpu, no TPU) and prints, per
slot count, its time, the compiler's own read-once price (engine/read_once.py: every weight product
compiled bare, plus the KV at the kernel byte rate), their ratio and where the step's time goes,
instruction group by instruction group. Every figure is predicted (XLA:TPU cost model).
--weight-layouts auto lets the compiler choose the decoder weights' layouts: an experiment, not
what the engine runs (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dspark_jax.cli import parse_mesh_shape, report_user_errors

PROG = "python -m dspark_jax bench step"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1],
                                 epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("preset", help="a preset naming a target model, e.g. configs/qwen3_8b_dspark.yaml")
    ap.add_argument("--topology", required=True, metavar="SLICE", help="a Cloud TPU slice: v5e-8, v6e-8, v5p-8, ...")
    ap.add_argument("--mesh", default=None, metavar="DATA,FSDP,TENSOR", help="default 1,1,N (tensor parallel)")
    ap.add_argument("--slots", type=int, nargs="+", default=[8], metavar="R", help="rows of the step (default 8)")
    ap.add_argument("--context", type=int, default=2048, help="cache length per slot (default 2048)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="default bfloat16")
    ap.add_argument("--weight-layouts", default="fixed", choices=["fixed", "auto"],
                    help="fixed: row-major, as the engine places them (default); auto: the compiler's choice")
    ap.add_argument("--top", type=int, default=20, help="instruction groups listed per step (default 20)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the figures to this JSON file")
    return ap


def _lines(price) -> list[str]:
    f = price.read_once
    out = [f"{price.slots} slots: step {1e3 * price.step_s:.3f} ms, read-once {1e3 * f['total']:.3f} ms "
           f"(weights {1e3 * f['weights']:.3f}, KV {1e3 * f['kv']:.3f}) -> {price.ratio:.2f}x  [predicted]",
           "  read-once by product: " + ", ".join(f"{k} {1e3 * v:.3f}" for k, v in f["products"].items())]
    out += [f"  {1e3 * s:8.3f} ms  {group:40s} {kind}" for s, group, kind in price.breakdown]
    return out


def slice_setup(args):
    """(slice, mesh shape, served config) of a TPU-pricing command's --topology, --mesh, preset and
    --dtype (`bench step`, `bench round`)."""
    from dspark_jax.config import served_config
    from dspark_jax.parallel.slices import parse_slice
    from dspark_jax.parallel.topology import slice_devices

    slc = parse_slice(args.topology)
    return slc, parse_mesh_shape(args.mesh, len(slice_devices(slc))), served_config(args.preset, args.dtype)


@report_user_errors
def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    import jax

    from dspark_jax.engine.predict import libtpu_version
    from dspark_jax.engine.step_price import price_target_step

    slc, mesh_shape, cfg = slice_setup(args)
    print(f"# {args.preset} target-only step on {slc.name}, mesh {mesh_shape}, {args.dtype}, context {args.context}, "
          f"weight layouts {args.weight_layouts}; predicted (XLA:TPU cost model), libtpu {libtpu_version()}, "
          f"jax {jax.__version__}")
    doc = []
    for r in args.slots:
        price = price_target_step(cfg, slc.name, mesh_shape, slots=r, context=args.context,
                                  auto_weight_layouts=args.weight_layouts == "auto", top=args.top)
        print("\n".join(_lines(price)), flush=True)
        doc.append({"slots": r, "step_s": price.step_s, "read_once": price.read_once, "ratio": price.ratio,
                    "breakdown": price.breakdown})
    if args.json:
        Path(args.json).write_text(json.dumps({"preset": args.preset, "topology": slc.name, "mesh": mesh_shape,
                                               "libtpu": libtpu_version(), "jax": jax.__version__,
                                               "weight_layouts": args.weight_layouts, "steps": doc}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
