"""Drafters judged on prompt sets, by speculative decoding or by teacher forcing (eval/forced.py):
tau with bootstrap intervals, conditional acceptance per draft position, a confidence-threshold
sweep, calibration before and after STS, plots and report.md (the command: `python -m dspark_jax
eval`, commands/eval.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from dspark_jax.calibration.calibrate import (
    calibrate_traces,
    fmt,
    report_table,
    split_by_request,
)
from dspark_jax.calibration.sts import calibration_report, prefix_labels, survival
from dspark_jax.calibration.traces import TraceSet, from_engine, save_traces
from dspark_jax.data import heldout_code
from dspark_jax.data.corpora import HELDOUT_MODULES, build_corpus
from dspark_jax.data.formats import read_conversations
from dspark_jax.data.regenerate import prompt_messages
from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.eval.forced import expected_acceptance, forced_traces
from dspark_jax.eval.metrics import (
    bootstrap_tau,
    conditional_acceptance,
    conditional_support,
    fixed_length_sweep,
    tau_by_group,
    threshold_sweep,
)
from dspark_jax.text.chat import render_prompt

MODES = {"engine": "speculative decoding with the engine",
         "forced": "teacher forcing along the target's greedy continuation of each prompt (exactly the engine's "
                   "greedy rounds; eval/forced.py)",
         "forced-expected": "teacher forcing along one sampled continuation per prompt: tau is the EXPECTED accepted "
                            "length (slot 0 exact, later slots teacher forced; an estimate, eval/forced.py), and "
                            "'engine check' the engine's sampled tau on the first prompts"}


class EvalError(ValueError):
    pass


# ---------------------------------------------------------------------------- running

def default_conversations(num: int, seed: int = 0) -> tuple[dict[str, list], dict[str, list[str]], dict]:
    """The embedded held-out sets: ({set: conversations}, {set: source label per prompt}, {set: provenance}).

    code = all stdlib held-out functions, then functions of installed dependencies up to ``num``."""

    held = build_corpus("heldout", seed, n_code=num + 8, n_math=num + 8, n_prose=num + 8)
    sets = {d: [c for c in held if _domain(c) == d][:num] for d in ("code", "math", "prose")}
    groups = {d: ["stdlib_heldout"] * len(v) for d, v in sets.items()}
    info = {d: {"stdlib_heldout": len(v), "heldout_modules": list(HELDOUT_MODULES)} for d, v in sets.items()}
    info["math"] = {"synthetic_heldout": len(sets["math"])}
    missing = num - len(sets["code"])
    if missing > 0:
        extra = heldout_code.code_conversations(missing, seed, exclude_prompts={c[0]["content"] for c in sets["code"]})
        sets["code"] += extra
        groups["code"] += ["dependencies"] * len(extra)
        info["code"].update({"dependencies": len(extra), "dependency_packages": heldout_code.source_versions()})
    return sets, groups, info


def load_prompt_sets(paths, tokenizer, template, num: int, info: dict | None = None) -> dict[str, list[list[int]]]:
    """{set name: prompt token ids}. ``info`` (optional, filled in place): per set its
    provenance ("sources") and the source label of every kept prompt ("groups")."""

    sets, groups, prov = {}, {}, {}
    if paths:
        for p in paths:
            path = Path(p)
            if not path.is_file():
                raise EvalError(f"prompt set '{p}' does not exist: pass a jsonl file of {{\"turns\": [...]}} lines")
            convs = read_conversations(path)
            sets[path.stem] = convs[:num]
            groups[path.stem] = [path.stem] * len(sets[path.stem])
            prov[path.stem] = {"file": str(path), path.stem: len(sets[path.stem])}
    else:
        sets, groups, prov = default_conversations(num)
    out = {}
    for name, convs in sets.items():
        ids = [render_prompt(tokenizer, prompt_messages(c), template) for c in convs]
        keep = [i for i, x in enumerate(ids) if len(x) >= 2]
        out[name] = [ids[i] for i in keep]
        if info is not None:
            info[name] = {"sources": prov[name], "groups": [groups[name][i] for i in keep]}
    return out


def _domain(conv) -> str:
    user = conv[0]["content"]
    if user.startswith(("Write the Python", "Complete this code")):
        return "code"
    if user.startswith("Explain"):
        return "prose"
    return "math"


def sts_before_after(traces, *, drafter_kind: str, sampling, seed: int = 0, holdout: float = 0.5,
                     min_rounds: int = 50) -> dict:
    """STS fitted on the full-gamma rounds of one half of the requests, ECE / Brier /
    ROC-AUC per position before (T = 1) and after on the other half (calibrate.calibrate_traces).

    Returns {"error": why} instead when there are too few full-gamma rounds."""

    ts = traces if isinstance(traces, TraceSet) else from_engine(traces, drafter_kind=drafter_kind, sampling=sampling)
    try:
        fit = calibrate_traces(ts, holdout=holdout, seed=seed, min_rounds=min_rounds)
    except ValueError as e:
        return {"error": str(e)}
    _, held = split_by_request(ts.full_gamma(), holdout, seed)  # the half the report is measured on
    means = {f"mean_survival_{tag}": survival(held.conf_logits, t).mean(0).tolist()
             for tag, t in (("before", None), ("after", fit["temperatures"]))}
    means["prefix_rate"] = prefix_labels(held.accepted, ts.gamma).mean(0).tolist()
    rep = fit["report"]
    mean = lambda v: float(np.mean([x for x in v if x is not None])) if any(x is not None for x in v) else None
    summary = {f"{m}_{tag}_mean": mean(rep[f"{m}_{tag}"]) for m in ("ece", "brier", "auc")
               for tag in ("before", "after")}
    return {"split": "by request", "holdout": holdout, "seed": seed, **summary, **means,
            **{k: fit[k] for k in ("temperatures", "n_rounds", "n_fit", "n_heldout", "n_bins", "grid", "report")}}


def evaluate_drafter(target, drafter, prompts, *, max_new_tokens, sampling, seed, stop_ids, temps=None, num_slots=8,
                     max_prompt_len=None, groups=None, sts_split: bool = True, sts_min_rounds: int = 50,
                     traces_path=None, mesh=None):
    """Judge `drafter` by speculative decoding of `prompts` with the engine."""
    G = getattr(drafter, "gamma", None) or drafter.dcfg.gamma
    if max_prompt_len:
        prompts = [p[-max_prompt_len:] for p in prompts]
    S = max(len(p) for p in prompts) + max_new_tokens + G + 2
    config = EngineConfig(num_slots=min(num_slots, len(prompts)), max_len=S, policy="fixed")  # tau at fixed length
    eng = Engine(target, drafter, config, mesh=mesh)
    res = eng.generate(prompts, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, stop_ids=stop_ids,
                       traces=True)
    acc = np.asarray([r.accepted for r in res.results])
    rounds = np.asarray([r.rounds for r in res.results])
    out = summarise_rounds(res.traces.arrays(), acc, rounds, G, drafter=drafter, sampling=sampling, seed=seed,
                           temps=temps, groups=groups, sts_split=sts_split, sts_min_rounds=sts_min_rounds,
                           traces_path=traces_path, source="engine (eval)")
    out["tokens_per_s"] = float(sum(len(r.tokens) for r in res.results) / max(res.seconds, 1e-9))
    return {"mode": "engine", **out}


def engine_check(target, drafter, prompts_by_set: dict, *, max_new_tokens, sampling, seed, stop_ids,
                 mesh=None) -> dict:
    """{set: {"prompts", "tau", "ci95"}}: the engine's sampled tau on a few prompts of every set,
    decoded in one engine run (one compile), beside an expected tau from teacher forcing."""
    names = [s for s, ps in prompts_by_set.items() if ps]
    prompts = [p for s in names for p in prompts_by_set[s]]
    if not prompts:
        return {}
    r = evaluate_drafter(target, drafter, prompts, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                         stop_ids=stop_ids, sts_split=False, mesh=mesh)
    acc, rounds = (np.asarray(r["per_request"][k]) for k in ("accepted", "rounds"))
    out, i = {}, 0
    for s in names:
        n = len(prompts_by_set[s])
        tau, lo, hi = bootstrap_tau(acc[i:i + n], rounds[i:i + n], seed=seed)
        out[s] = {"prompts": n, "tau": tau, "ci95": [lo, hi]}
        i += n
    return out


def evaluate_forced(target, drafters: dict, prompts, continuations, *, sampling, seed, temps=None, groups=None,
                    sts_split: bool = True, sts_min_rounds: int = 50, traces_paths=None, progress=None,
                    seconds: dict | None = None) -> dict:
    """{name: result} for `drafters` ({name: drafter}) judged by teacher forcing along
    `continuations` (eval/forced.py), one target pass per prompt for all of them: at T = 0 the
    engine's greedy rounds exactly; at T > 0 the expected acceptance along one sampled continuation
    per prompt (an estimate of tau, slot 0 exact; no rounds, so no STS). `temps` / `traces_paths`:
    {name: ...} (STS temperatures, where to save the traces). `seconds`, a dict: gets the wall time
    of the teacher-forced pass and of the summaries (STS, sweep, calibration)."""
    temps, traces_paths = temps or {}, traces_paths or {}
    seconds = {} if seconds is None else seconds
    t0 = time.perf_counter()
    if sampling.temperature == 0:
        traces = forced_traces(target, drafters, prompts, continuations, progress=progress)
        seconds["forced pass"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = {name: {"mode": "forced", **summarise_rounds(
                    tr, tr["request_accepted"], tr["request_rounds"], tr["gamma"], drafter=drafters[name],
                    sampling=sampling, seed=seed, temps=temps.get(name), groups=groups, sts_split=sts_split,
                    sts_min_rounds=sts_min_rounds, traces_path=traces_paths.get(name),
                    source="teacher forced (eval)")}
               for name, tr in traces.items()}
        seconds["summaries"] = time.perf_counter() - t0
        return out
    expected = expected_acceptance(target, drafters, prompts, continuations, sampling, progress=progress)
    seconds["forced pass"] = time.perf_counter() - t0
    return {name: _expected_summary(ex, groups, seed) for name, ex in expected.items()}


def _expected_summary(ex: dict, groups, seed: int) -> dict:
    reqs = [r for r in ex["requests"] if len(r["expected_accepted"])]
    if not reqs:
        raise EvalError("no continuation is long enough for a whole block: raise --max-new-tokens")
    acc = np.asarray([r["expected_accepted"].sum() for r in reqs])
    blocks = np.asarray([len(r["expected_accepted"]) for r in reqs], float)
    tau, lo, hi = bootstrap_tau(acc, blocks, seed=seed)
    rates = np.concatenate([r["rates"] for r in reqs])
    out = {"mode": "forced-expected", "tau": tau, "ci95": [lo, hi], "prompts": len(reqs), "rounds": 0,
           "anchors": int(blocks.sum()),
           # expected accepted drafts and whole blocks per request: tau's terms, as `rounds` are for decoding
           "per_request": {"accepted": acc.tolist(), "rounds": blocks.tolist()},
           # slot j's acceptance given slots < j accepted (teacher forced): the conditional acceptance
           "conditional_acceptance": np.nanmean(rates, axis=0).tolist(),
           "conditional_support": np.sum(~np.isnan(rates), axis=0).tolist()}
    if groups is not None and len(set(groups)) > 1:
        kept = [g for g, r in zip(groups, ex["requests"]) if len(r["expected_accepted"])]
        out["by_source"] = tau_by_group(acc, blocks, kept, seed=seed)
    return out


def summarise_rounds(tr: dict, acc, rounds, G: int, *, drafter, sampling, seed, temps, groups, sts_split: bool,
                     sts_min_rounds: int, traces_path, source: str) -> dict:
    """tau with its interval, conditional acceptance, STS before / after, the threshold sweep and
    calibration from per-round traces (`Traces.arrays()` format) and per-request totals."""
    tau, lo, hi = bootstrap_tau(acc, rounds, seed=seed)
    out = {"tau": tau, "ci95": [lo, hi], "prompts": len(acc), "rounds": int(np.sum(rounds)),
           "per_request": {"accepted": np.asarray(acc).tolist(), "rounds": np.asarray(rounds).tolist()},
           # rounds cut by a stop token / max_new discarded drafts: not rejections
           "conditional_acceptance": conditional_acceptance(tr["accepted"][~tr["cut"]],
                                                            tr["length"][~tr["cut"]], G).tolist(),
           "conditional_support": conditional_support(tr["accepted"][~tr["cut"]], tr["length"][~tr["cut"]], G).tolist()}
    if groups is not None and len(set(groups)) > 1:
        out["by_source"] = tau_by_group(acc, rounds, groups, seed=seed)
    has_conf = bool(getattr(drafter, "dcfg", None) and drafter.dcfg.confidence_head)
    full = tr["full"]
    if traces_path is not None or (has_conf and sts_split):
        ts = from_engine(tr, drafter_kind=drafter.dcfg.kind, sampling=sampling, source=source)
        if traces_path is not None:
            out["traces"] = str(save_traces(traces_path, ts))
        if has_conf and sts_split:
            out["sts_split"] = sts_before_after(ts, drafter_kind=drafter.dcfg.kind, sampling=sampling, seed=seed,
                                                min_rounds=sts_min_rounds)
    if full.any():
        out["fixed_length_sweep"] = fixed_length_sweep(tr["accepted"][full], G)
    if has_conf and full.any():
        out["threshold_sweep"] = threshold_sweep(tr["conf_logits"][full], tr["accepted"][full], temps)
        rep = calibration_report(tr["conf_logits"][full], tr["accepted"][full], np.ones(G) if temps is None else temps)
        out["calibration"] = json.loads(json.dumps(rep, default=lambda x: np.asarray(x).tolist()))
    return out


# ---------------------------------------------------------------------------- report

def _save(fig, out: Path, name: str, files: list[str]) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(out / name, dpi=120)
    plt.close(fig)
    files.append(name)


def write_plots(results: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    sets = list(results)
    drafters = sorted({d for s in results.values() for d in s})
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(sets), 3.6))
    w = 0.8 / max(len(drafters), 1)
    for i, d in enumerate(drafters):
        xs, ys, err = [], [], [[], []]
        for j, s in enumerate(sets):
            r = results[s].get(d)
            if r:
                xs.append(j + i * w)
                ys.append(r["tau"])
                err[0].append(r["tau"] - r["ci95"][0])
                err[1].append(r["ci95"][1] - r["tau"])
        ax.bar(xs, ys, w, yerr=err, capsize=3, label=d)
    ax.set_xticks([j + w * (len(drafters) - 1) / 2 for j in range(len(sets))], sets)
    ax.set_ylabel("accepted length tau (95 % CI)")
    ax.legend(fontsize=8)
    _save(fig, out, "tau.png", files)
    fig, axes = plt.subplots(1, len(sets), figsize=(3.4 * len(sets), 3.2), squeeze=False)
    for ax, s in zip(axes[0], sets):
        for d in drafters:
            r = results[s].get(d)
            if r:
                ca = r["conditional_acceptance"]
                ax.plot(range(1, len(ca) + 1), ca, marker="o", label=d)
        ax.set_title(s)
        ax.set_xlabel("draft position k")
        ax.set_ylim(0, 1)
    axes[0][0].set_ylabel("conditional acceptance")
    axes[0][-1].legend(fontsize=8)
    _save(fig, out, "conditional_acceptance.png", files)
    sweeps = [(s, d, results[s][d]["threshold_sweep"]) for s in sets for d in drafters
              if results[s].get(d, {}).get("threshold_sweep")]
    if sweeps:
        fig, ax = plt.subplots(figsize=(4.4, 3.4))
        for s, d, sw in sweeps:
            ax.plot([r["threshold"] for r in sw], [r["accepted_share"] for r in sw], marker=".", label=f"{d} / {s}")
        ax.set_xlabel("static confidence threshold")
        ax.set_ylabel("share of verified tokens accepted")
        ax.legend(fontsize=7)
        _save(fig, out, "threshold_sweep.png", files)
    return files


def _tau_cell(r) -> str:
    if not r:
        return ""
    check = r.get("engine_check")
    return (f"{r['tau']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}] (n={r['prompts']})"
            + (f"; engine check {check['tau']:.3f} [{check['ci95'][0]:.3f}, {check['ci95'][1]:.3f}] "
               f"(n={check['prompts']})" if check else ""))


def write_report(results: dict, meta: dict, out: Path, plots: list[str]) -> Path:
    mode = meta.get("mode", "engine")
    mode = "forced-expected" if mode == "forced" and meta["temperature"] > 0 else mode
    lines = ["# Drafter evaluation", "", f"Command: `{meta['command']}`", "",
             f"Target: `{meta['target']}`; sampling: temperature {meta['temperature']}, top-k {meta['top_k']}, "
             f"top-p {meta['top_p']}; {meta['max_new_tokens']} new tokens per prompt; seed {meta['seed']}.", "",
             f"Judged by {MODES[mode]}.", "",
             "## Accepted length tau (95 % bootstrap interval over requests)", ""]
    drafters = sorted({d for s in results.values() for d in s})
    lines.append("| set | " + " | ".join(drafters) + " |")
    lines.append("|---|" + "---|" * len(drafters))
    for s, row in results.items():
        cells = [_tau_cell(row.get(d)) for d in drafters]
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
        labels = sorted({k for d in drafters for k in row.get(d, {}).get("by_source", {})})
        for label in labels:
            cells = [_tau_cell(row.get(d, {}).get("by_source", {}).get(label)) for d in drafters]
            lines.append(f"| {s}: {label} | " + " | ".join(cells) + " |")
    if meta.get("sets"):
        lines += ["", "Prompt sources: " + "; ".join(f"{s}: {json.dumps(v)}" for s, v in meta["sets"].items())]
    lines += ["", "## Conditional acceptance per draft position", ""]
    for s, row in results.items():
        for d, r in row.items():
            ca = ", ".join("nan" if np.isnan(x) else f"{x:.3f}" for x in np.asarray(r["conditional_acceptance"], float))
            lines.append(f"- {s} / {d}: {ca}")
    sweeps = [(s, d, r["threshold_sweep"]) for s, row in results.items()
              for d, r in row.items() if "threshold_sweep" in r]
    if sweeps:
        lines += ["", "## Static threshold sweep (replayed on full-gamma rounds)", "",
                  "| set / drafter | threshold | verified / round | accepted share | tau |", "|---|---|---|---|---|"]
        for s, d, sw in sweeps:
            for r in sw:
                lines.append(f"| {s} / {d} | {r['threshold']:.1f} | {r['verified_per_round']:.2f} | "
                             f"{r['accepted_share']:.3f} | {r['tau']:.3f} |")
    splits = [(s, d, r["sts_split"]) for s, row in results.items() for d, r in row.items() if "sts_split" in r]
    if splits:
        lines += ["", "## STS before / after (fitted on half of the requests, measured on the other half)", ""]
        for s, d, sp in splits:
            if "error" in sp:
                lines += [f"- {s} / {d}: not fitted ({sp['error']})"]
                continue
            lines += [f"{s} / {d}: {sp['n_fit']} fit / {sp['n_heldout']} held-out full-gamma rounds; mean over "
                      f"positions: ECE {fmt(sp['ece_before_mean'], True)} -> {fmt(sp['ece_after_mean'], True)}, Brier "
                      f"{fmt(sp['brier_before_mean'])} -> {fmt(sp['brier_after_mean'])}", ""]
            none = [None] * len(sp["temperatures"])
            extra = {h: sp.get(k, none) for h, k in (("mean a_j before", "mean_survival_before"),
                                                      ("mean a_j after", "mean_survival_after"),
                                                      ("realised prefix rate", "prefix_rate"))}
            lines += [report_table(sp, extra), ""]
    cals = [(s, d, r["calibration"]) for s, row in results.items() for d, r in row.items() if "calibration" in r]
    if cals:
        lines += ["", "## Calibration of the confidence head (raw or STS temperatures)", ""]
        for s, d, c in cals:
            lines.append(f"- {s} / {d}: `{json.dumps(c)[:600]}`")
    lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
