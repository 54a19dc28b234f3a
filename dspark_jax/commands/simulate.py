"""`python -m dspark_jax simulate`: serving simulation of the schedulers under concurrency, round
times from a cost table, acceptance from traces (the model: dspark_jax/scheduler/simulate.py).

    python -m dspark_jax simulate --costs T.json --acceptance deepspec-8b-gsm8k-dspark --out out/
    python -m dspark_jax simulate --vs-target-only --all-profiles \
        --costs docs/tpu_predictions_figures,configs/costs,../shared/device/tables

`--vs-target-only`: scheduled DSpark (the production scheduler with the skip rule) against
target-only, as a table of throughput ratios, for every cost table named (directories: every
cost table in them) and acceptance profile, at every concurrency each table prices
(`scheduler.simulate.priced_concurrency`) unless `--concurrency` says otherwise."""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

from dspark_jax.cli import report_user_errors

# DeepSpec's evaluation of the Qwen3-8B DSpark drafter, one profile per set (calibration/profiles.py)
DEEPSPEC_8B = tuple(f"deepspec-8b-{s}-dspark" for s in ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench"))


def _load_temps(args, ts):
    import numpy as np

    from dspark_jax.calibration.calibrate import load_temperatures
    from dspark_jax.calibration.sts import fit_sts

    if args.drafter_dir:
        return np.asarray(load_temperatures(args.drafter_dir, ts.sampling, ts.gamma)), f"sts.json in {args.drafter_dir}"
    if args.no_calibration:
        return None, "none (T = 1)"
    full = ts.full_gamma()
    return fit_sts(full.conf_logits, full.accepted), "fitted on the simulation's own traces"


def _cost_paths(text: str) -> list[Path]:
    """Comma-separated cost files and directories (a directory: every cost table in it)."""
    from dspark_jax.scheduler.costs import FORMAT, CostTableError

    out = []
    for part in (p for p in text.split(",") if p):
        path = Path(part)
        if path.is_dir():
            found = [f for f in sorted(path.glob("*.json")) if f'"{FORMAT}"' in f.read_text()]
            if not found:
                raise CostTableError(f"{path}: no cost table ({FORMAT}) in this directory")
            out += found
        else:
            out.append(path)
    return out


def _origin(d: dict) -> str:
    from dspark_jax.scheduler.costs import table_origin

    return {"predicted": f"predicted (XLA:TPU cost model, {d.get('device_kind')})",
            "synthetic": "synthetic (roofline model)",
            "measured": f"measured ({d.get('device_kind')})"}[table_origin(d)]


def _skip_price(d: dict) -> str:
    """What the skip rule prices a round without a draft by, for this table
    (`scheduler.costs.skipped_round_price`)."""
    from dspark_jax.scheduler.costs import skipped_round_price

    price = skipped_round_price(d)
    if not (d.get("engine") or {}).get("num_slots") or price is None:
        return "t_verify(R)"
    return "t_skip" if price == d.get("t_skip") else "t_target_step"


def _versus(args, ap) -> int:
    """--vs-target-only: scheduled DSpark / target-only for every table and profile named."""
    from dspark_jax.calibration.profiles import parse_profile, profile_traces
    from dspark_jax.calibration.sts import fit_sts
    from dspark_jax.engine.predict import with_collectives
    from dspark_jax.scheduler.costs import load_cost_file, with_overhead
    from dspark_jax.scheduler.simulate import priced_concurrency, ratio_rows_markdown, versus_target_only

    names = list(DEEPSPEC_8B) if args.all_profiles else [n for n in (args.acceptance or "").split(",") if n]
    if not names:
        ap.error("--vs-target-only needs --acceptance PROFILE[,PROFILE...] or --all-profiles")
    short = lambda n: n.removeprefix("deepspec-8b-").removesuffix("-dspark")
    acceptance: dict[tuple[str, int], tuple] = {}
    rows, notes = [], {}
    for path in _cost_paths(args.costs):
        cost = load_cost_file(path)
        if args.with_collectives:
            cost = with_collectives(cost)
        if args.overhead_ms:
            cost = with_overhead(cost, args.overhead_ms / 1e3, "--overhead-ms")
        gamma = int((cost.get("engine") or {}).get("gamma") or 7)
        conc = [int(c) for c in args.concurrency.split(",")] if args.concurrency else priced_concurrency(cost, gamma)
        for name in names:
            prof = parse_profile(name, gamma=gamma)
            if prof.gamma != gamma:
                notes[path.stem] = f"{path.stem} (its engine drafts gamma {gamma}, the profiles gamma {prof.gamma})"
                continue
            if (name, gamma) not in acceptance:
                ts = profile_traces(prof)
                full = ts.full_gamma()
                acceptance[(name, gamma)] = ({"dspark": ts}, fit_sts(full.conf_logits, full.accepted))
            traces, temps = acceptance[(name, gamma)]
            for r in versus_target_only(cost, traces, temps, conc, skip=args.skip, n_rounds=args.rounds,
                                        seed=args.seed, mode=args.theta, charge=args.charge, turnover=args.turnover,
                                        probe_every=args.probe_every, probe_max=args.probe_max):
                rows.append({"table": path.stem, "origin": _origin(cost), "skip_price": _skip_price(cost),
                             "profile": short(name), "tau": prof.tau, **r})
    profiles = [short(n) for n in names]
    lines = ["Scheduled DSpark (production scheduler, skip rule "
             f"{args.skip!r}) / target-only, total tokens per second, {args.rounds} rounds, seed {args.seed}; "
             "acceptance: " + ", ".join(f"{short(n)} tau {parse_profile(n).tau:g}" for n in names), "",
             *ratio_rows_markdown(rows, profiles)]
    if notes:
        lines += ["", "Not simulated: " + "; ".join(notes.values()) + "."]
    if rows:
        worst = min(rows, key=lambda r: r["ratio"])
        lines += ["", f"Lowest of {len(rows)} points: {worst['ratio']:.4f} ({worst['table']}, {worst['profile']}, "
                      f"R = {worst['concurrency']}); points below 1.0: {sum(r['ratio'] < 1.0 for r in rows)}."]
    print("\n".join(lines))
    if args.out_dir:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "ratios.md").write_text("\n".join(lines) + "\n")
        with (out / "ratios.csv").open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["table"])
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {out / 'ratios.md'}, {out / 'ratios.csv'}")
    return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m dspark_jax simulate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--costs", required=True,
                    help="cost table JSON (dspark_jax.scheduler.costs); with --vs-target-only several, comma-"
                         "separated, and directories (every cost table in them)")
    ap.add_argument("--vs-target-only", action="store_true",
                    help="scheduled DSpark against target-only: a table of throughput ratios for every cost table "
                         "and acceptance profile, at every concurrency each table prices (module doc)")
    ap.add_argument("--all-profiles", action="store_true",
                    help="with --vs-target-only: every DeepSpec Qwen3-8B profile (" +
                         ", ".join(DEEPSPEC_8B) + ")")
    ap.add_argument("--traces", default=None, help="DSpark trace file (.npz); the default acceptance source")
    ap.add_argument("--dflash-traces", default=None)
    ap.add_argument("--mtp-traces", default=None)
    ap.add_argument("--synthetic-traces", action="store_true", help="parametric traces (traces.synthetic_traces)")
    ap.add_argument("--acceptance", default=None, metavar="PROFILE",
                    help="DSpark acceptance from a published tau instead of traces: a named profile "
                         "(calibration/profiles.py, e.g. deepspec-8b-gsm8k-dspark), tau:X or rates:r1,...,rG "
                         "(gamma = the cost table's); with --vs-target-only several, comma-separated")
    ap.add_argument("--dflash-acceptance", default=None, metavar="PROFILE", help="the same for DFlash")
    ap.add_argument("--overhead-ms", type=float, default=0.0,
                    help="added to every round (host overhead a predicted table does not hold: "
                         "docs/tpu_predictions.md)")
    ap.add_argument("--with-collectives", action="store_true",
                    help="--vs-target-only: a predicted table's programs with their collectives added, as "
                         "parallel/collectives.py prices them (the compiler prices none)")
    ap.add_argument("--expect-topology", default=None, help="refuse a table made for another slice")
    ap.add_argument("--expect-target", default=None, help="refuse a table made for another target preset")
    ap.add_argument("--mtp-accept", type=float, default=0.85,
                    help="MTP-1 acceptance when no MTP traces (DeepSeek-V3 reports 85-90 %%)")
    ap.add_argument("--drafter", dest="drafter_dir", default=None, help="read STS temperatures from <dir>/sts.json")
    ap.add_argument("--no-calibration", action="store_true")
    ap.add_argument("--concurrency", default=None,
                    help="comma-separated (default 1,2,4,...,256; with --vs-target-only, every concurrency "
                         "each table prices)")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--threshold", type=float, default=0.5)
    ap.add_argument("--skip", default="known", choices=["none", "known", "best_case", "stale"],
                    help="when the scheduled variants skip drafting (module doc); 'known' is the engine's default")
    ap.add_argument("--fixed-skip", default="none", choices=["none", "acceptance"],
                    help="when the fixed-length variants (DFlash, DSpark gamma=7) skip drafting: 'acceptance' is "
                         "the engine's default for drafters without a confidence head (module doc)")
    ap.add_argument("--probe-every", type=int, default=8, help="'known' rule: first probe interval (rounds)")
    ap.add_argument("--probe-max", type=int, default=64,
                    help="'known' rule: the interval doubles up to this while probes say drafting does not pay")
    ap.add_argument("--theta", default="latency", choices=["latency", "sps"])
    ap.add_argument("--charge", default="step", choices=["step", "interp"])
    ap.add_argument("--turnover", type=int, default=64, help="rounds before a slot replays a new request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", dest="out_dir", default=None,
                    help="output directory (required unless --vs-target-only, where it receives ratios.md / .csv)")
    return ap


def _acceptance(args, cost, ap) -> tuple[dict, str]:
    """(traces per drafter kind, what they are) from --acceptance, --traces or --synthetic-traces."""
    from dspark_jax.calibration.profiles import parse_profile, profile_traces
    from dspark_jax.calibration.traces import load_traces, synthetic_traces

    if args.acceptance:
        gamma = int((cost.get("engine") or {}).get("gamma") or 7)
        traces, parts = {}, []
        for k, text in (("dspark", args.acceptance), ("dflash", args.dflash_acceptance)):
            if text:
                prof = parse_profile(text, kind=k, gamma=gamma)
                if prof.gamma != gamma:
                    raise ValueError(f"acceptance profile {text!r} is for gamma {prof.gamma}, the cost table's engine "
                                     f"drafts gamma {gamma}: use a profile of that block size or tau:X")
                traces[k] = profile_traces(prof)
                parts.append(f"{k}: {prof.source} (tau {prof.tau:g})")
        source = "acceptance profiles: " + "; ".join(parts)
    elif args.traces:
        traces = {"dspark": load_traces(args.traces).full_gamma()}
        for k, p in (("dflash", args.dflash_traces), ("mtp1", args.mtp_traces)):
            if p:
                traces[k] = load_traces(p).full_gamma()
        source = f"real traces: {args.traces}" + "".join(f", {k}: {p}" for k, p in (
            ("dflash", args.dflash_traces), ("mtp1", args.mtp_traces)) if p)
    elif args.synthetic_traces:
        traces = {k: synthetic_traces(256, 64, 7, kind=k, seed=args.seed + i)
                  for i, k in enumerate(("dspark", "dflash", "mtp1"))}
        source = "SYNTHETIC traces (traces.synthetic_traces presets: " + "; ".join(
            f"{k}: tau {t.tau():.2f}" for k, t in traces.items()) + ")"
    else:
        ap.error("give --traces FILE (real), --acceptance PROFILE or --synthetic-traces")
    return traces, source


def _print_sweep(args, cost, source, temps_src, conc, methods, results, hl, matched) -> None:
    """The sweep as text: total tokens/s and budget per method and concurrency, the headline ratios."""
    print(f"traces: {source}\nSTS: {temps_src}\ncosts: {args.costs} ({cost.get('backend')})")
    print(f"{'method':28s} " + " ".join(f"{'R=' + str(c):>9s}" for c in conc) + "   (total tokens/s)")
    for m in methods:
        row = {r.concurrency: r for r in results if r.method == m.name}
        print(f"{m.name:28s} " + " ".join(f"{row[c].total_tps:9.0f}" for c in conc))
    print("budget (1 + l) per request:")
    for m in methods:
        row = {r.concurrency: r for r in results if r.method == m.name}
        print(f"{m.name:28s} " + " ".join(f"{row[c].budget:9.2f}" for c in conc))
    print("throughput / target-only at max concurrency: " + ", ".join(
        f"{m}: {v:.3f}" for m, v in hl["at_max_concurrency"].items()))
    print("min over concurrency of throughput / target-only: " + ", ".join(
        f"{m}: {v:.3f}" for m, v in hl["min_over_concurrency"].items()))
    for name, pts in matched.items():
        if pts:
            print(f"{name} vs MTP-1 at matched total throughput: per-user gain " + ", ".join(
                f"R_mtp={p['baseline_concurrency']}: {100 * p['gain']:+.0f} %" for p in pts))


@report_user_errors
def main(argv=None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.vs_target_only:
        return _versus(args, ap)
    if not args.out_dir:
        ap.error("--out is required (the sweep's CSV, plots and summary go there)")
    if args.all_profiles:
        ap.error("--all-profiles runs with --vs-target-only")
    from dspark_jax.scheduler.costs import describe_table, expect_table_for, load_cost_file, with_overhead
    from dspark_jax.scheduler.simulate import (
        SCHEDULED,
        default_methods,
        headline,
        matched_throughput,
        run_sweep,
        write_outputs,
    )

    cost = load_cost_file(args.costs)
    expect_table_for(cost, args.costs, topology=args.expect_topology, target=args.expect_target)
    print(describe_table(cost, args.costs))
    if args.overhead_ms:
        cost = with_overhead(cost, args.overhead_ms / 1e3, "--overhead-ms")
    traces, source = _acceptance(args, cost, ap)
    temps, temps_src = _load_temps(args, traces["dspark"])
    conc = [int(c) for c in (args.concurrency or "1,2,4,8,16,32,64,128,256").split(",")]
    methods = default_methods(args.threshold, args.skip, have_dflash="dflash" in traces, fixed_skip=args.fixed_skip)
    results = run_sweep(methods, conc, cost, traces, temps, n_rounds=args.rounds, seed=args.seed,
                        mtp_accept=args.mtp_accept, mode=args.theta, charge=args.charge, turnover=args.turnover,
                        probe_every=args.probe_every, probe_max=args.probe_max)
    files = write_outputs(results, args.out_dir, title=f"{Path(args.costs).name}; {source}"[:150])
    hl = headline(results)
    matched = {m.name: matched_throughput(results, m.name, "MTP-1") for m in methods if m.kind in SCHEDULED}
    summary = {"costs": args.costs, "cost_backend": cost.get("backend"), "traces": source,
               "mtp1": "traces" if "mtp1" in traces else f"stated acceptance {args.mtp_accept}",
               "sts": temps_src, "temperatures": None if temps is None else [float(t) for t in temps],
               "settings": {k: getattr(args, k) for k in ("rounds", "threshold", "skip", "probe_every",
                                                          "probe_max", "theta", "charge", "turnover", "seed")},
               "concurrency": conc, "headline": hl, "matched_vs_mtp1": matched, **files}
    Path(args.out_dir, "summary.json").write_text(json.dumps(summary, indent=1))
    _print_sweep(args, cost, source, temps_src, conc, methods, results, hl, matched)
    print(f"wrote {files['csv']}, {', '.join(files['png'])}, summary.json")
    return 0
