"""Run a recipe stage by stage; each finished stage leaves its output, and a rerun skips it.

Before the stages the caller resolves the target (`models fetch`, or --target). Stages (each a
subprocess of an ordinary command, so a stage's memory is freed before the next and its log is
the command's own output):
  train   `python -m dspark_jax.train PRESET target.path=... train.output_dir=OUT/<kind>` per drafter
          (done: OUT/<kind>/summary.json; an interrupted run resumes from its checkpoints, and the
          regeneration it starts with is cached and shared by drafters with the same data section)
  eval    `python -m dspark_jax eval --mode forced` on the prompt sets, all drafters side by side, per
          temperature: exact at T = 0, the expected tau at T > 0 with the engine's sampled tau on a
          few prompts beside it (done: OUT/eval_T<t>/results.json)
  speed   `python -m dspark_jax bench engine --sections speed` per drafter and temperature; for DSpark
          first `python -m dspark_jax costs measure` per batch size (OUT/costs/) and a scheduled row on
          those tables (done: OUT/speed_<kind>_T<t>.json)
Then OUT/report.md and OUT/summary.json are rewritten from whatever is done.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from dspark_jax.eval.metrics import paired_tau_ratio
from dspark_jax.recipe.curves import curve_table, plot_curves, training_curves
from dspark_jax.recipe.recipes import Recipe

STAGES = ("train", "eval", "speed")
SCHEDULED_KIND = "dspark"  # the drafter whose speed stage also times the scheduled policy (its confidence head)
ENGINE_CHECK_PROMPTS = 4  # at T > 0: prompts per set also decoded by the engine, beside the expected tau
COST_MAX_LEN = 256  # the cost tables' cache length: the speed stage's prompts + 64 new tokens fit


class RecipeError(RuntimeError):
    pass


def record_time(logs: Path, stage: str, seconds: float) -> None:
    """Append a finished (or failed) stage's wall time to LOGS/timings.jsonl: a resumed recipe's
    total is the sum over every run of it."""
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / "timings.jsonl", "a") as f:
        f.write(json.dumps({"stage": stage, "seconds": round(seconds, 1), "at": time.strftime("%Y-%m-%d %H:%M:%S")})
                + "\n")


def stage_times(logs: Path) -> dict[str, float]:
    """{stage: seconds summed over runs} from LOGS/timings.jsonl, and "total"."""
    path = logs / "timings.jsonl"
    out: dict[str, float] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            out[rec["stage"]] = out.get(rec["stage"], 0.0) + float(rec["seconds"])
    if out:
        out["total"] = sum(out.values())
    return out


def run_stage(name: str, cmd: list[str], log_path: Path, echo: bool = True) -> None:
    """Run `cmd`, its output passed through as it comes (progress bars included) and appended to
    `log_path`; its wall time is recorded beside the logs; a failure names the log."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    print(f"[recipe] {name}: {' '.join(cmd)}", flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # a piped child would otherwise hold its output back
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        while chunk := os.read(proc.stdout.fileno(), 65536):
            log.write(chunk)
            log.flush()
            if echo:  # notebooks' stdout has no byte buffer
                raw = getattr(sys.stdout, "buffer", None)
                raw.write(chunk) if raw is not None else sys.stdout.write(chunk.decode(errors="replace"))
                sys.stdout.flush()
        rc = proc.wait()
    record_time(log_path.parent, name, time.perf_counter() - t0)
    if rc:
        raise RecipeError(f"stage '{name}' failed (exit {rc}); its output is in {log_path}. Fix the cause and "
                          "rerun the same command: finished stages are skipped, training resumes from its checkpoints")


def _py(command: str, *args) -> list[str]:
    return [sys.executable, "-m", "dspark_jax", command, *map(str, args)]


def prompt_set_files(recipe: Recipe, eval_dir: Path) -> list[Path]:
    sets = [eval_dir / f"{s}.jsonl" for s in recipe.eval_sets]
    missing = [str(p) for p in sets if not p.is_file()]
    if missing:
        raise RecipeError(f"prompt sets not found: {', '.join(missing)}; pass --eval-dir with the folder holding "
                          f"{', '.join(s + '.jsonl' for s in recipe.eval_sets)} (e.g. ../shared/eval_datasets)")
    return sets


def run_recipe(recipe: Recipe, out: Path, target: Path, *, overrides=(), eval_dir: Path, num_eval_prompts: int = 80,
               eval_max_new_tokens: int = 64, speed_prompts: int = 8, speed_max_new_tokens: int = 64,
               speed_repeats: int = 2, speed_batch_sizes=(1, 8), temperatures=None, speed_temperatures=None,
               stages=STAGES, echo: bool = True) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    temps = tuple(recipe.eval_temperatures if temperatures is None else temperatures)
    speed_temps = tuple(recipe.speed_temperatures if speed_temperatures is None else speed_temperatures)
    sets = prompt_set_files(recipe, eval_dir) if {"eval", "speed"} & set(stages) else []
    drafter_dir = {k: out / k / "drafter" for k in recipe.kinds}
    for kind, (preset, kind_overrides) in recipe.kinds.items():
        if "train" in stages and not (out / kind / "summary.json").is_file():
            cmd = _py("train", *([preset] if preset else []), f"target.path={target}",
                      f"train.output_dir={out / kind}", *kind_overrides, *overrides)
            run_stage(f"train {kind}", cmd, logs / f"train_{kind}.log", echo)
    for t in temps:
        res = out / f"eval_T{t:g}"
        if "eval" in stages and not (res / "results.json").is_file():
            cmd = _py("eval", "--target", target,
                      *[a for k, d in drafter_dir.items() for a in ("--drafter", f"{k}={d}")],
                      "--prompts", *sets, "--num-prompts", num_eval_prompts, "--max-new-tokens", eval_max_new_tokens,
                      "--temperature", t, "--mode", "forced",
                      *(["--engine-check", ENGINE_CHECK_PROMPTS] if t > 0 else []), "--out", res)
            run_stage(f"eval T={t:g}", cmd, logs / f"eval_T{t:g}.log", echo)
    speed_set = eval_dir / f"{recipe.speed_set}.jsonl"
    for kind, d in drafter_dir.items():
        for t in speed_temps:
            res = out / f"speed_{kind}_T{t:g}.json"
            if "speed" in stages and not res.is_file():
                tables = []
                if kind == SCHEDULED_KIND:  # a cost table per batch size, measured on these models at this T
                    for r in speed_batch_sizes:
                        table = out / "costs" / f"{kind}_r{r}_T{t:g}.json"
                        if not table.is_file():
                            cmd = _py("costs", "measure", "--target", target, "--drafter", d, "--slots", r,
                                      "--temperature", t, "--max-len", COST_MAX_LEN, "--repeats", 3, "--stat", "min",
                                      "--out", table)
                            run_stage(f"costs {kind} R={r} T={t:g}", cmd, logs / f"costs_{kind}_r{r}_T{t:g}.log", echo)
                        tables += ["--costs", f"{r}={table}"]
                cmd = _py("bench", "engine", "--target", target, "--drafter", d, "--prompts", speed_set,
                          "--num-prompts", speed_prompts, "--max-new-tokens", speed_max_new_tokens,
                          "--sections", "speed",
                          "--temperature", t, "--repeats", speed_repeats,
                          "--batch-sizes", ",".join(map(str, speed_batch_sizes)), *tables, "--json", res)
                run_stage(f"speed {kind} T={t:g}", cmd, logs / f"speed_{kind}_T{t:g}.log", echo)
    summary = collect(recipe, out, target, temps, speed_temps)
    if plot_curves(summary["curves"], out / "tau_vs_steps.png"):
        summary["curves_plot"] = "tau_vs_steps.png"
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=float))
    (out / "report.md").write_text(report_markdown(summary))
    print(f"[recipe] report: {out / 'report.md'}", flush=True)
    return summary


def _read(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def collect(recipe: Recipe, out: Path, target: Path, temps, speed_temps) -> dict:
    """Everything the finished stages wrote, in one dict (missing stages are None)."""
    train = {}
    for kind in recipe.kinds:
        s = _read(out / kind / "summary.json")
        if s:
            ev = s.get("eval") or {}
            train[kind] = {"steps": s.get("step"), "heldout_tau": ev.get("eval/expected_accepted_length"),
                           "heldout_tau_ci95": ev.get("eval/expected_accepted_length_ci95"),
                           "measured_tau": s.get("measured_tau"),
                           "wall_s": s.get("wall_s"), "phases_s": s.get("phases_s")}
    evals = {f"{t:g}": (_read(out / f"eval_T{t:g}" / "results.json") or {}).get("results") for t in temps}
    speed = {k: {f"{t:g}": _read(out / f"speed_{k}_T{t:g}.json") for t in speed_temps} for k in recipe.kinds}
    return {"recipe": recipe.name, "target": str(target), "notes": recipe.notes, "kinds": list(recipe.kinds),
            "train": train, "curves": training_curves(out, recipe.kinds), "eval": evals, "speed": speed,
            "wall_s": stage_times(out / "logs")}


def _ci(r) -> str:
    return f"{r['tau']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]" if r else "-"


def report_markdown(s: dict) -> str:
    kinds = s["kinds"]
    lines = [f"# Recipe `{s['recipe']}`", "", s["notes"], "", f"Target: `{s['target']}`", ""]
    wall = s.get("wall_s") or {}
    if wall:
        lines += [f"Wall clock: {wall['total'] / 60:.1f} min over every run of the recipe ("
                  + ", ".join(f"{k} {v / 60:.1f}" for k, v in wall.items() if k != "total") + " min).", ""]
    lines += ["## Training", "",
             "| drafter | steps | held-out expected tau [95% CI] | measured tau | wall of its last run (a resumed run "
             "counts only itself) |", "|---|---|---|---|---|"]
    for k in kinds:
        t = s["train"].get(k)
        if t:
            ci = t["heldout_tau_ci95"]
            held = _num(t["heldout_tau"]) + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")
            lines.append(f"| {k} | {t['steps']} | {held} | {_num(t['measured_tau'])} | "
                         f"{(t['wall_s'] or 0) / 60:.1f} min |")
        else:
            lines.append(f"| {k} | not trained yet | | | |")
    if s.get("curves"):
        lines += ["", "## Held-out expected tau against training steps", ""] + curve_table(s["curves"])
        if s.get("curves_plot"):
            lines += ["", f"![tau against steps]({s['curves_plot']})"]
    base = "dflash" if "dflash" in kinds else None
    for t, res in s["eval"].items():
        how = "exact greedy rounds, teacher forced" if float(t) == 0 else "expected tau, teacher forced"
        lines += ["", f"## Accepted length tau on the prompt sets, T = {t} ({how})", ""]
        if not res:
            lines.append("not evaluated yet")
            continue
        ratio = base and "dspark" in kinds
        head = "| set | " + " | ".join(kinds) + (" | dspark / dflash [paired 95% CI] |" if ratio else " |")
        lines += [head, "|" + "---|" * (head.count("|") - 1)]
        for sname, per in res.items():
            row = f"| {sname} | " + " | ".join(_ci(per.get(k)) for k in kinds) + " |"
            a, b = per.get("dspark"), per.get(base) if ratio else None
            if a and b and "per_request" in a and "per_request" in b:
                r, lo, hi = paired_tau_ratio(a["per_request"]["accepted"], a["per_request"]["rounds"],
                                             b["per_request"]["accepted"], b["per_request"]["rounds"])
                row += f" {r:.3f} [{lo:.3f}, {hi:.3f}] |"
            elif a and b:
                row += f" {a['tau'] / b['tau']:.3f} |"
            lines.append(row)
        checks = [f"{sname} / {k}: {per[k]['engine_check']['tau']:.3f} (n={per[k]['engine_check']['prompts']})"
                  for sname, per in res.items() for k in kinds if (per.get(k) or {}).get("engine_check")]
        if checks:
            lines += ["", "The engine's sampled tau on the first prompts of each set: " + "; ".join(checks) + "."]
    lines += ["", "## Wall clock (tokens/s, `bench engine --sections speed`)", "",
              "| drafter | T | batch | target-only | speculative | speedup [range over runs] | tau | "
              "T_ar ms | T_draft ms | "
              "T_verify ms | bound | scheduled speedup [range] |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for k in kinds:
        for t, sp in (s["speed"].get(k) or {}).items():
            for key in sorted((sp or {})):
                if key.startswith("speed_b"):
                    r = sp[key]
                    span = r.get("speedup_range")  # min-max over repeated runs (older files: one run)
                    span = f" [{span[0]:.2f}, {span[1]:.2f}]" if span else ""
                    lines.append(f"| {k} | {t} | {r['batch']} | {r['ar_tok_s']:.1f} | {r['spec_tok_s']:.1f} | "
                                 f"x{r['speedup']:.2f}{span} | {r['tau']:.2f} | "
                                 f"{r['T_ar_ms']:.1f} | {r['T_draft_ms']:.1f} | "
                                 f"{r['T_verify_ms']:.1f} | x{r['bound']:.2f} | {_scheduled(r)} |")
    return "\n".join(lines) + "\n"


def _num(x) -> str:
    """A figure to three places, or a dash where the run made none (no held-out evaluation, or
    measure_prompts 0: None, or nan from older summaries)."""
    return "-" if x is None or math.isnan(x) else f"{x:.3f}"


def _scheduled(r: dict) -> str:
    if "scheduled_speedup" not in r:
        return "-"
    lo, hi = r["scheduled_speedup_range"]
    return f"x{r['scheduled_speedup']:.2f} [{lo:.2f}, {hi:.2f}] (tau {r['scheduled_tau']:.2f})"
