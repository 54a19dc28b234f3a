"""`python -m dspark_jax calibrate`: STS temperatures fitted on engine traces, reported and saved
with the drafter (dspark_jax/calibration/calibrate.py)."""

from __future__ import annotations

import argparse
import sys

from dspark_jax.cli import report_user_errors


def _run(args) -> int:
    import json
    from pathlib import Path

    from dspark_jax.calibration.calibrate import (
        calibrate_traces,
        load_trace_file,
        parse_sampling,
        reliability_diagram,
        report_table,
        save_temperatures,
        split_by_request,
    )
    from dspark_jax.calibration.sts import make_grid
    from dspark_jax.calibration.traces import TraceSet, concat, synthetic_traces

    sampling = parse_sampling(args.sampling) if args.sampling else None
    sets = [load_trace_file(p, sampling) for p in args.traces] or [synthetic_traces(256, 64, 7, seed=args.seed)]
    groups: dict[str, list[TraceSet]] = {}
    for s in sets:
        groups.setdefault(s.key, []).append(s)
    out_dir = Path(args.out_dir or args.drafter_dir)
    grid = make_grid(args.grid_size, args.grid_min, args.grid_max)
    summary = {}
    for key, group in groups.items():
        ts = concat(group)
        res = calibrate_traces(ts, grid=grid, n_bins=args.bins, holdout=args.holdout, seed=args.seed)
        path = save_temperatures(args.drafter_dir, ts.sampling, res)
        _, held = split_by_request(ts.full_gamma(), args.holdout, args.seed)
        png = reliability_diagram(held.conf_logits, held.accepted, res["temperatures"],
                                  out_dir / f"reliability_{key}.png",
                                  n_bins=args.bins,
                                  title=f"{ts.meta.get('drafter_kind')} {key} ({ts.meta.get('source')})"[:120])
        summary[key] = res
        print(f"## sampling {key}: {res['n_fit']} fit / {res['n_heldout']} held-out full-gamma rounds; "
              f"source: {res['source']}\n{report_table(res)}\nsaved {path}; diagram {png}\n")
    (out_dir / "calibration_report.json").write_text(json.dumps(summary, indent=1))
    return 0


@report_user_errors
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspark_jax calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", nargs="*", default=[], help="trace .npz files (dspark_jax.calibration.traces format)")
    ap.add_argument("--synthetic-traces", action="store_true",
                    help="use the parametric model of traces.synthetic_traces")
    ap.add_argument("--drafter", dest="drafter_dir", required=True,
                    help="where sts.json is written (the drafter checkpoint dir)")
    ap.add_argument("--out", dest="out_dir", default=None,
                    help="report JSON/markdown and reliability PNGs (default: drafter dir)")
    ap.add_argument("--grid-size", type=int, default=256)
    ap.add_argument("--grid-min", type=float, default=0.05)
    ap.add_argument("--grid-max", type=float, default=20.0)
    ap.add_argument("--bins", type=int, default=20)
    ap.add_argument("--holdout", type=float, default=0.5, help="fraction of requests held out for the report")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sampling", default=None, metavar="T[,TOP_K,TOP_P]",
                    help="the sampling setting of trace files that record none (the engine's raw Traces.save "
                         "output); files written by `python -m dspark_jax generate --traces F.npz` record theirs")
    args = ap.parse_args(argv)
    if not args.traces and not args.synthetic_traces:
        ap.error("give --traces FILE ... or --synthetic-traces")
    try:
        return _run(args)
    except (ValueError, FileNotFoundError) as e:  # bad input: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
