"""`python -m dspark_jax eval`: judge drafters on prompt sets, by speculative decoding or by
teacher forcing.

Modes (--mode): `engine` decodes every prompt with every drafter by speculative decoding.
`forced` generates each prompt's continuation once with the target alone and judges every drafter
along it in one parallel pass (eval/forced.py): at temperature 0 this is exact (the same rounds,
accepted lengths and confidences as the engine's greedy decoding, at a fraction of the time); at
T > 0 it reports the EXPECTED accepted length along one sampled continuation per prompt (an
estimate: slot 0 is exact, later slots are teacher forced), not a sampled tau, and no STS;
--engine-check N decodes the first N prompts with the engine beside it. `auto` (default): forced
at temperature 0, engine otherwise.

For every prompt set and drafter: accepted length tau with a 95 % bootstrap interval
(over requests), conditional acceptance per draft position (the paper's Figure 2
metric), a static confidence-threshold sweep (share of verified tokens accepted, and
tau) and calibration metrics. For drafters with a confidence head, STS is also fitted on
half of each set's requests (full-gamma rounds of the same run, no extra generation) and
ECE / Brier / ROC-AUC are reported before and after on the other half. Writes report.md,
PNG plots and results.json.

Prompt sets are jsonl files in the reference's `{"turns": [...]}` format (first turn) or
`{"conversations": [...]}`; without --prompts, the embedded corpora's held-out code,
math and prose prompts are used. The stdlib hold-out has only ~108 code functions, so the
code set is filled up to --num-prompts from the installed numpy / jax / flax / optax
sources (`dspark_jax.data.heldout_code`, unseen by the target and the drafters; their
versions are recorded in results.json).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from dspark_jax.cli import report_user_errors


def parse_args(argv=None):
    from dspark_jax.cli import add_dtype_argument, add_mesh_argument

    ap = argparse.ArgumentParser(prog="python -m dspark_jax eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="HF checkpoint directory (default: the embedded target)")
    add_dtype_argument(ap)
    add_mesh_argument(ap, "request slots over data, KV heads over tensor")
    ap.add_argument("--drafter", action="append", required=True, metavar="[NAME=]DIR",
                    help="a trained drafter directory; repeat for several (NAME defaults to its kind)")
    ap.add_argument("--prompts", nargs="*", default=None,
                    help="prompt set jsonl files (default: embedded held-out code/math/prose)")
    ap.add_argument("--num-prompts", type=int, default=200, help="prompts per set (default 200)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-len", type=int, default=None, help="keep only the last N prompt tokens")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mode", choices=["auto", "engine", "forced"], default="auto",
                    help="engine: speculative decoding; forced: teacher forcing along one continuation per prompt "
                         "(exact at temperature 0, expected tau at T > 0); auto: forced at T = 0, else engine")
    ap.add_argument("--engine-check", type=int, default=0, metavar="N",
                    help="with --mode forced at T > 0: also decode the first N prompts of each set with the engine "
                         "and report its sampled tau beside the expected one")
    ap.add_argument("--sts-split", action=argparse.BooleanOptionalAction, default=True,
                    help="fit STS on half of each set's requests, report calibration before/after on the other half "
                         "(drafters with a confidence head; default on)")
    ap.add_argument("--sts-min-rounds", type=int, default=50,
                    help="full-gamma rounds a set needs before STS is fitted on half of them (default 50)")
    ap.add_argument("--traces", dest="traces_dir", default=None,
                    help="also save each set's per-round traces as DIR/<set>_<drafter>.npz "
                         "(for python -m dspark_jax calibrate)")
    ap.add_argument("--out", default="eval_report", help="output directory (report.md, *.png, results.json)")
    return ap.parse_args(argv)


def _load(args, sampling):
    """(target, {name: (drafter, path, STS temperatures or None)}, prompt sets, their info)."""
    from dspark_jax.calibration.calibrate import CalibrationMissingError, load_temperatures
    from dspark_jax.embedded.target import resolve_target_dir
    from dspark_jax.eval.evaluate import load_prompt_sets
    from dspark_jax.io import drafter_dir as drafter_io
    from dspark_jax.io.loading import load_models
    from dspark_jax.parallel.sharding import parse_mesh

    mesh = parse_mesh(args.mesh)
    target, _, _ = load_models(resolve_target_dir(args.target), None, "ar", args.dtype, mesh)
    tok = target.require_tokenizer()
    drafters = {}
    for spec in args.drafter:
        name, _, path = spec.rpartition("=")
        tdt = target.model.embed[...].dtype  # the drafter computes in the target's dtype
        d = drafter_io.load(path, target.model, dtype=None if tdt == np.float32 else tdt, mesh=mesh)
        try:  # stored STS temperatures for this sampling setting, if any
            temps = load_temperatures(path, sampling, getattr(d, "gamma", None) or d.dcfg.gamma)
        except CalibrationMissingError:
            temps = None
        drafters[name or d.dcfg.kind] = (d, path, temps)
    info: dict = {}
    sets = load_prompt_sets(args.prompts, tok, target.chat_template, args.num_prompts, info=info)
    return target, mesh, drafters, sets, info


def _evaluate_set(args, mode, target, mesh, drafters, sname, prompts, groups, sampling, stop_ids, secs) -> dict:
    """Every drafter on one prompt set -> {drafter name: its results}; `secs` gets the wall times."""
    from dspark_jax.console import progress_bar
    from dspark_jax.eval.evaluate import evaluate_drafter, evaluate_forced
    from dspark_jax.eval.forced import greedy_continuations

    if args.max_prompt_len:
        prompts = [p[-args.max_prompt_len:] for p in prompts]
    paths = {dname: Path(args.traces_dir) / f"{sname}_{dname}.npz" for dname in drafters} if args.traces_dir \
        else {}
    forced, results = {}, {}
    if mode == "forced":
        print(f"[eval] {sname}: the target's continuations of {len(prompts)} prompts", flush=True)
        t0 = time.perf_counter()
        conts = greedy_continuations(target.model, prompts, max_new_tokens=args.max_new_tokens, stop_ids=stop_ids,
                                     sampling=sampling, seed=args.seed, mesh=mesh)
        secs["continuations"] = time.perf_counter() - t0
        with progress_bar(total=len(prompts), desc=f"{sname}: {', '.join(drafters)}", unit="prompt") as bar:
            forced = evaluate_forced(target.model, {n: v[0] for n, v in drafters.items()}, prompts, conts,
                                     sampling=sampling, seed=args.seed,
                                     temps={n: v[2] for n, v in drafters.items()}, groups=groups,
                                     sts_split=args.sts_split, sts_min_rounds=args.sts_min_rounds,
                                     traces_paths=paths, progress=bar.update, seconds=secs)
    for dname, (d, path, temps) in drafters.items():
        if mode == "forced":
            r = forced[dname]
        else:
            t0 = time.perf_counter()
            r = evaluate_drafter(target.model, d, prompts, max_new_tokens=args.max_new_tokens, sampling=sampling,
                                 seed=args.seed, stop_ids=stop_ids, temps=temps, groups=groups,
                                 sts_split=args.sts_split, sts_min_rounds=args.sts_min_rounds, mesh=mesh,
                                 traces_path=paths.get(dname))
            secs[f"engine {dname}"] = time.perf_counter() - t0
        r["sts"] = temps is not None
        results[dname] = r
        print(f"[eval] {sname} / {dname} ({r['mode']}): tau {r['tau']:.3f} [{r['ci95'][0]:.3f}, "
              f"{r['ci95'][1]:.3f}] over {r['prompts']} prompts")
    print(f"[eval] {sname}: seconds " + ", ".join(f"{k} {v:.0f}" for k, v in secs.items()), flush=True)
    return results


def _engine_checks(args, target, mesh, drafters, sets, sampling, stop_ids, results, seconds) -> None:
    """The engine's sampled tau on the first --engine-check prompts of each set, beside the forced one."""
    from dspark_jax.eval.evaluate import engine_check

    firsts = {sname: [p[-args.max_prompt_len:] if args.max_prompt_len else p for p in prompts[:args.engine_check]]
              for sname, prompts in sets.items()}
    for dname, (d, _, _) in drafters.items():
        t0 = time.perf_counter()
        checks = engine_check(target.model, d, firsts, max_new_tokens=args.max_new_tokens, sampling=sampling,
                              seed=args.seed, stop_ids=stop_ids, mesh=mesh)
        seconds[f"engine check {dname}"] = time.perf_counter() - t0
        print(f"[eval] engine check {dname}: {seconds[f'engine check {dname}']:.0f} s", flush=True)
        for sname, c in checks.items():
            results[sname][dname]["engine_check"] = c
            print(f"[eval] {sname} / {dname}: the engine's sampled tau on the first {c['prompts']} prompts "
                  f"{c['tau']:.3f} [{c['ci95'][0]:.3f}, {c['ci95'][1]:.3f}]")


def _write(args, argv, mode, target, drafters, info, results, seconds, out: Path) -> Path:
    """results.json, the plots and report.md -> the report's path."""
    from dspark_jax.eval.evaluate import write_plots, write_report

    meta = {"command": "python -m dspark_jax eval " + " ".join(sys.argv[1:] if argv is None else argv),
            "target": str(target.path), "mode": mode, "temperature": args.temperature, "top_k": args.top_k,
            "top_p": args.top_p,
            "max_new_tokens": args.max_new_tokens, "seed": args.seed, "seconds": seconds,
            "sets": {k: v["sources"] for k, v in info.items()},
            "drafters": {n: {"path": str(path), **{k: getattr(d.dcfg, k, None) for k in
                                                   ("kind", "gamma", "num_layers", "confidence_head")}}
                         for n, (d, path, _) in drafters.items()}}
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=float))
    plots = write_plots(results, out)
    return write_report(results, meta, out, plots)


@report_user_errors
def main(argv=None) -> int:
    args = parse_args(argv)
    from dspark_jax.decoding.sampling import SamplingParams
    from dspark_jax.drafter.frozen import TargetMismatchError
    from dspark_jax.eval.evaluate import EvalError

    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    try:
        target, mesh, drafters, sets, info = _load(args, sampling)
    except (TargetMismatchError, EvalError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mode = args.mode if args.mode != "auto" else ("forced" if args.temperature == 0 else "engine")
    if mode == "forced" and args.temperature > 0:
        print(f"[eval] --mode forced at temperature {args.temperature:g}: reporting the EXPECTED accepted length along "
              "one sampled continuation per prompt (slot 0 exact, later slots teacher forced), not a sampled tau; "
              "use --mode engine for sampled rounds (and STS)", file=sys.stderr)
    stop_ids = tuple(target.require_tokenizer().stop_ids)
    results: dict = {}
    seconds: dict = {}  # where the evaluation's wall time goes, per set and part (results.json's meta)
    for sname, prompts in sets.items():
        seconds[sname] = {}
        results[sname] = _evaluate_set(args, mode, target, mesh, drafters, sname, prompts, info[sname]["groups"],
                                       sampling, stop_ids, seconds[sname])
    if mode == "forced" and args.temperature > 0 and args.engine_check:
        _engine_checks(args, target, mesh, drafters, sets, sampling, stop_ids, results, seconds)
    path = _write(args, argv, mode, target, drafters, info, results, seconds, out)
    print(f"[eval] report: {path}")
    return 0
