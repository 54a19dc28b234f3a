"""docs/tpu_predictions.md from predicted cost tables: the comparison with published TPU runs, the
overhead model, the serving simulation per slice, target and concurrency, and the plots
(`python -m dspark_jax bench tpu-predict`, bench/tpu_predict.py, makes the tables)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from dspark_jax.bench.tpu_plots import PREDICTED, plot_methods
from dspark_jax.calibration.profiles import PROFILES, Profile, profile_traces
from dspark_jax.calibration.sts import fit_sts
from dspark_jax.scheduler.costs import with_overhead
from dspark_jax.scheduler.simulate import Method, simulate_method

__all__ = ["PUBLISHED", "Overhead", "fixed_speedup", "fit_overhead", "write_report"]

BEGIN, END = "<!-- tpu_predictions:begin -->", "<!-- tpu_predictions:end -->"
NO_OVERHEAD = "gsm8k, compiler alone"
PUBLISHED = {
    "sglang-jax": dict(
        source="sglang-jax DSpark Stage 1: TPU v7x-8, Qwen3-8B + the block-7 DSpark drafter, bf16, TP 8, pages of 64, "
               "random 1024-token prompts, 4096 output tokens, fixed width 8, greedy",
        speedup={1: 5.03, 8: 3.98, 32: 3.41, 128: 3.18}, target_only_tps_c1=107.0, dspark_tps_c128=13899.0),
    "tpu-inference": dict(
        source="tpu-inference DFlash: TPU v5p-8, Qwen3-4B + DFlash K = 16, batch 1, greedy, mean over its sets",
        speedup=3.13, tau=5.42),
}
MTP1_ACCEPT = 0.85  # DeepSeek-V3's reported MTP acceptance (85-90 %), as `simulate --mtp-accept`
METHODS = (Method("target-only", "ar", None), Method("MTP-1", "mtp1", None),
           Method("DFlash gamma=7", "fixed", "dflash", gamma=7), Method("DSpark gamma=7", "fixed", "dspark", gamma=7),
           Method("DSpark scheduled", "production", "dspark", skip="known"))


def _load(cache: Path, key: str) -> dict | None:
    p = cache / f"{key}.json"
    return json.loads(p.read_text()) if p.exists() else None


def _round_at(d: dict, tokens: int) -> float:
    """Draft + verification of a round verifying `tokens` (the bucket it lands in)."""
    b = next(i for i, x in enumerate(d["buckets"]) if x >= tokens)
    return d["t_draft"] + d["t_verify"][b]


def fixed_speedup(d: dict, tau: float, width: int) -> float:
    """Per-user speedup of fixed-width speculation over target-only at the table's R: each round
    commits tau tokens per request in draft + verify(R x width), target-only one in a step (the
    table's times, overheads included where added)."""
    r = d["engine"]["num_slots"]
    return tau * d["t_target_step"] / _round_at(d, r * width)


@dataclasses.dataclass(frozen=True)
class Overhead:
    """Time per round the compiler does not see: h0 + h1 x requests on every round, plus
    h2 x drafted tokens on a round that drafts (scheduled.costs.with_overhead)."""
    h0: float
    h1: float
    h2: float
    tau: float  # sglang-jax's tau, fitted with them

    def apply(self, d: dict) -> dict:
        r = d["engine"]["num_slots"]
        return with_overhead(d, self.h0 + self.h1 * r, "fitted to sglang-jax (docs/tpu_predictions.md)", self.h2)


def fit_overhead(sg: dict) -> Overhead:
    """Fitted to sglang-jax's published points: its target-only speed at c = 1 (107 tok/s) and
    c = 128 (13,899 / 3.18 tok/s) give h0 and h1; its speedups at c = 1 and 128 (width 8) give
    h2 and tau together. Its speedups at c = 8 and 32 are left to check the fit. Without the
    c = 128 table: h1 = h2 = 0 and tau from c = 1."""
    pub = PUBLISHED["sglang-jax"]
    t_ar = {1: 1.0 / pub["target_only_tps_c1"], 128: 128.0 / (pub["dspark_tps_c128"] / pub["speedup"][128])}
    if sg.get(128) is None:
        h0 = t_ar[1] - sg[1]["t_target_step"]
        return Overhead(h0, 0.0, 0.0, pub["speedup"][1] * (_round_at(sg[1], 8) + h0) / t_ar[1])
    h1 = ((t_ar[128] - sg[128]["t_target_step"]) - (t_ar[1] - sg[1]["t_target_step"])) / 127
    h0 = t_ar[1] - sg[1]["t_target_step"] - h1
    g = sg[1]["engine"]["gamma"]
    # speedup_c = tau t_ar[c] / (round_c + h0 + h1 c + h2 g c): linear in (tau, h2) at c = 1 and 128
    a = np.array([[t_ar[c] / pub["speedup"][c], -g * c] for c in (1, 128)])
    b = np.array([_round_at(sg[c], 8 * c) + h0 + h1 * c for c in (1, 128)])
    tau, h2 = np.linalg.solve(a, b)
    return Overhead(float(h0), float(h1), float(h2), float(tau))


def _traces(profiles: dict[str, Profile]) -> dict:
    return {k: profile_traces(p) for k, p in profiles.items()}


def _simulate(d: dict, traces: dict, overhead: Overhead | None, rounds: int) -> dict:
    cost = d if overhead is None else overhead.apply(d)
    r = d["engine"]["num_slots"]
    full = traces["dspark"].full_gamma()
    temps = fit_sts(full.conf_logits, full.accepted)
    return {m.name: simulate_method(m, r, cost, traces, temps, n_rounds=rounds, seed=0, mtp_accept=MTP1_ACCEPT,
                                    R_pad=256) for m in METHODS}


def _ms(x: float) -> str:
    return f"{1e3 * x:.2f}"


def _comparison(cache: Path, lines: list[str]) -> Overhead | None:
    sg = {r: _load(cache, f"sglang-v7x-8-qwen3_8b_dspark-r{r}") for r in (1, 8, 32, 128)}
    if sg[1] is None:
        lines.append("The v7x-8 tables are not predicted yet: run "
                     "`python -m dspark_jax bench tpu-predict --only sglang`.")
        return None
    pub = PUBLISHED["sglang-jax"]
    o = fit_overhead(sg)
    one = Overhead(o.h0 + o.h1, 0.0, 0.0, 0.0)  # the simplest model: one fixed time per round
    tau1 = pub["speedup"][1] * _round_at(one.apply(sg[1]), 8) / one.apply(sg[1])["t_target_step"]
    t_ar128 = 128.0 / (pub["dspark_tps_c128"] / pub["speedup"][128])
    lines += ["## Held against published TPU runs", "",
              f"**sglang-jax** ({pub['source']}). The target-only step for Qwen3-8B on v7x-8, {PREDICTED}, is "
              f"{_ms(sg[1]['t_target_step'])} ms at concurrency 1"
              + (f" and {_ms(sg[128]['t_target_step'])} ms at 128" if sg[128] else "")
              + f"; sglang-jax ran {pub['target_only_tps_c1']:g} tok/s at 1 ({1e3 / pub['target_only_tps_c1']:.2f} ms "
              f"a step) and {128 / t_ar128:.0f} tok/s at 128 ({pub['dspark_tps_c128']:g} / {pub['speedup'][128]}, "
              f"{1e3 * t_ar128:.1f} ms a step): its host work, launches and collectives (which carry no cycle "
              "estimate) dominate at low concurrency. Two overhead models, each fitted only to the points named:", "",
              f"- **A, one fixed time per round**: h = {_ms(one.h0)} ms (sglang-jax's target-only step at c = 1 minus "
              f"the compiler's); tau fitted to the 5.03x at c = 1: {tau1:.2f}.",
              f"- **B, per round, per request and per drafted token**: h = {_ms(o.h0)} ms + {1e6 * o.h1:.0f} us x "
              f"requests + {1e6 * o.h2:.1f} us x drafted tokens (h0 and h1 from the two target-only speeds, h2 and "
              f"tau = **{o.tau:.2f}** together from the speedups at c = 1 and 128). The c = 8 and 32 speedups and "
              "tpu-inference's are checks, fitted to nothing.", "",
              f"| concurrency | {PREDICTED}: draft / round, width 8 / target step (ms) | A: {PREDICTED} + overhead A "
              f"| B: {PREDICTED} + overhead B | measured (sglang-jax) | A / measured | B / measured |",
              "|---|---|---|---|---|---|---|"]
    for r, d in sg.items():
        m = pub["speedup"][r]
        if d is None:
            lines.append(f"| {r} | not predicted yet | | | {m:.2f}x | | |")
            continue
        pa, pb = fixed_speedup(one.apply(d), tau1, 8), fixed_speedup(o.apply(d), o.tau, 8)
        fitted = {1: " (fitted)", 128: " (fitted)"}.get(r, "")
        lines.append(f"| {r} | {_ms(d['t_draft'])} / {_ms(_round_at(d, 8 * r))} / {_ms(d['t_target_step'])} | "
                     f"{pa:.2f}x | {pb:.2f}x | {m:.2f}x | {pa / m:.2f}{' (fitted)' if r == 1 else ''} | "
                     f"{pb / m:.2f}{fitted} |")
    p0 = fixed_speedup(sg[1], o.tau, 8)
    lines += ["", f"With no overhead at all the compiler alone gives {p0:.2f}x at c = 1 for tau {o.tau:.2f}. "
              f"tau {o.tau:.2f} beside DeepSpec's third-party evaluation of the same drafter (gsm8k 6.15, math500 "
              "5.80, humaneval 5.53, mbpp 5.17, mt-bench 3.72) is "
              + ("within that range, so the fit is plausible." if 3.72 <= o.tau <= 6.15 else
                 "above every set there (the highest, gsm8k, is 6.15): random prompts would have to suit the drafter "
                 "better than GSM8K does, which is unlikely, so part of what the fit puts in tau belongs to the "
                 "serving stack's costs." if o.tau > 6.15 else
                 "below every set there: random prompts suit the drafter less than any benchmark set.")]
    ti = _load(cache, "tpu-inference-v5p-8-qwen3_4b_dflash-k16")
    k128 = _load(cache, "tpu-inference-v5p-8-qwen3_4b_dflash-k128")
    pub = PUBLISHED["tpu-inference"]
    lines += ["", f"**tpu-inference** ({pub['source']}), at its published tau {pub['tau']}:", ""]
    if ti is None:
        lines.append("not predicted yet: `python -m dspark_jax bench tpu-predict --only tpu-inference`.")
    else:
        pa, pb, p0 = (fixed_speedup(x, pub["tau"], 16) for x in (one.apply(ti), o.apply(ti), ti))
        lines += [f"- Qwen3-4B on v5p-8 (4 chips, TP 4): target step {_ms(ti['t_target_step'])} ms, DFlash draft "
                  f"(block 16) {_ms(ti['t_draft'])} ms, round verifying 16 {_ms(_round_at(ti, 16))} ms, all "
                  f"{PREDICTED}: speedup **{pb:.2f}x** with model B ({pa:.2f}x with A, {p0:.2f}x from the compiler "
                  f"alone) against the measured {pub['speedup']}x: ratio {pb / pub['speedup']:.2f} "
                  f"(A {pa / pub['speedup']:.2f}, compiler alone {p0 / pub['speedup']:.2f})."]
    if k128 is not None and ti is not None:
        # like for like: the K = 16 program verifying 16 tokens against the K = 128 program verifying 128
        v = dict(zip(k128["buckets"], k128["t_verify"]))
        v16 = dict(zip(ti["buckets"], ti["t_verify"]))[16]
        r128, r16 = _round_at(k128, 128), _round_at(ti, 16)
        h = o.h0 + o.h1
        lines.append(f"- K-flat, {PREDICTED}: the K = 128 program verifies 128 tokens in {_ms(v[128])} ms, the K = 16 "
                     f"program 16 tokens in {_ms(v16)} ms: **{v[128] / v16:.2f}x** ({(v[128] + h) / (v16 + h):.2f}x "
                     f"with model B's per-round overhead); whole rounds (draft and verification) {_ms(r128)} against "
                     f"{_ms(r16)} ms, **{r128 / r16:.2f}x** ({(r128 + h) / (r16 + h):.2f}x with model B's overhead). "
                     f"Inside the K = 128 program alone, verifying 128 tokens costs {v[128] / v[16]:.2f}x verifying 16 "
                     f"({_ms(v[16])} ms), which is not the comparison tpu-inference made: it measured the same time "
                     "for K = 128 as for K = 16 at batch 1.")
    return o


def _grid(cache: Path, entries: list[dict], o: Overhead, rounds: int, lines: list[str], plots: Path,
          out_dir: Path) -> None:
    profiles = {"gsm8k": {"dspark": PROFILES["paper-4b-gsm8k-dspark"], "dflash": PROFILES["paper-4b-gsm8k-dflash"]},
                "arena-hard": {"dspark": PROFILES["paper-4b-arena-hard-dspark"],
                               "dflash": PROFILES["paper-4b-arena-hard-dflash"]}}
    traces = {name: _traces(p) for name, p in profiles.items()}
    grid = [e for e in entries if e["key"].startswith("grid-")]
    lines += ["", "## Every method on every slice", "",
              f"Tensor parallel over the slice's devices, {grid[0]['context'] if grid else ''} tokens of KV per "
              "request (dense caches), greedy, bf16, the presets' drafters (DSpark and DFlash 5 layers, block "
              f"7). Acceptance: the paper's Qwen3-4B tau on GSM8K (DSpark 6.11, DFlash 5.40) and Arena-Hard "
              f"(3.29, 2.83), measured at temperature 1 and applied here to programs compiled greedy "
              f"(calibration/profiles.py); MTP-1 accepts {MTP1_ACCEPT:.0%}. Every tokens/s and speedup below is "
              f"{PREDICTED}, not measured. Every round pays the fitted overhead of model B except in the "
              f"'compiler alone' table. Speedup = total tokens/s over "
              "target-only's at the same concurrency; "
              "'scheduled': the production scheduler with the engine's skip rule on STS-calibrated confidences.", ""]
    # (name, acceptance, overhead): the serving stack sglang-jax measured, and the chips alone
    passes = [("gsm8k", "gsm8k", o), ("arena-hard", "arena-hard", o), (NO_OVERHEAD, "gsm8k", None)]
    results = {}
    for e in grid:
        d = _load(cache, e["key"])
        if d is not None:
            for pname, acc, over in passes:
                results[(e["preset"], e["slice"], e["slots"], pname)] = _simulate(d, traces[acc], over, rounds)
    names = [m.name for m in METHODS]
    for pname, acc, over in passes:
        title = f"{acc} acceptance" + (", model B's overhead" if over else ", the compiler alone (no overhead)")
        lines += [f"### {title}", "",
                  f"| target | slice | c | target-only tok/s, {PREDICTED} | "
                  + " | ".join(f"{n}, speedup {PREDICTED}" for n in names[1:]) + " |",
                  "|---|---|---|---|" + "---|" * (len(names) - 1)]
        for e in grid:
            res = results.get((e["preset"], e["slice"], e["slots"], pname))
            if res is None:
                if pname == passes[0][0]:
                    failed = cache / f"{e['key']}.failed"
                    why = "does not fit the chips' HBM (the compiler's words in the .failed file)" if \
                        failed.exists() and "Ran out of memory" in failed.read_text() else "not predicted yet"
                    lines.append(f"| {e['preset'].removesuffix('_dspark')} | {e['slice']} | {e['slots']} | {why} |"
                                 + " |" * (len(names) - 1))
                continue
            base = res["target-only"].total_tps
            lines.append(f"| {e['preset'].removesuffix('_dspark')} | {e['slice']} | {e['slots']} | {base:.0f} | "
                         + " | ".join(f"{res[n].total_tps / base:.2f}x" for n in names[1:]) + " |")
        lines.append("")
    _crossovers(results, lines)
    _goal(cache, grid, o, rounds, lines)
    _one_token(cache, grid, lines)
    _paged(cache, entries, lines)
    plot_methods(results, METHODS, NO_OVERHEAD, plots, lines, out_dir)


def _goal(cache: Path, grid: list[dict], o: Overhead, rounds: int, lines: list[str]) -> None:
    """Scheduled DSpark against target-only on v6e-8 with Qwen3-8B's published acceptance."""
    rows = [(e["slots"], _load(cache, e["key"])) for e in grid
            if e["preset"] == "qwen3_8b_dspark" and e["slice"] == "v6e-8"]
    rows = [(c, d) for c, d in rows if d is not None]
    if not rows:
        return
    methods = [m for m in METHODS if m.name in ("target-only", "DSpark scheduled")]
    cells = []
    for name in ("deepspec-8b-gsm8k-dspark", "deepspec-8b-mt-bench-dspark"):
        traces = {"dspark": profile_traces(PROFILES[name])}
        full = traces["dspark"].full_gamma()
        temps = fit_sts(full.conf_logits, full.accepted)
        for label, over in (("model B", o), ("compiler alone", None)):
            ratios = []
            for c, d in rows:
                cost = d if over is None else over.apply(d)
                res = {m.name: simulate_method(m, c, cost, traces, temps, n_rounds=rounds, seed=0, R_pad=256)
                       for m in methods}
                ratios.append((c, res["DSpark scheduled"].total_tps / res["target-only"].total_tps))
            worst = min(ratios, key=lambda x: x[1])
            cells.append(f"{name.removeprefix('deepspec-8b-').removesuffix('-dspark')} tau {PROFILES[name].tau}, "
                         f"{label}: worst {worst[1]:.2f}x at c = "
                         f"{worst[0]} ({'met' if worst[1] >= 1.0 else 'NOT met'})")
    lines += ["Goal, scheduled DSpark at least target-only at every concurrency on v6e-8 with Qwen3-8B's "
              "acceptance (DeepSpec's tau, measured at temperature 1, applied to these greedy programs), "
              f"{PREDICTED}, over c = {', '.join(str(c) for c, _ in rows)}: " + "; ".join(cells) + ".",
              ""]


def _crossovers(results: dict, lines: list[str]) -> None:
    keys = sorted({k[:2] for k in results})
    if not keys:
        return
    lines += ["## The scheduler on TPU shapes", "",
              "Lowest concurrency at which fixed gamma 7 falls below target-only, and the scheduled DSpark's "
              "worst ratio to target-only over every concurrency predicted (GSM8K and Arena-Hard acceptance with "
              "model B's overhead; GSM8K on the compiler's times alone):", "",
              f"| target | slice | fixed gamma 7 < target-only from c =, {PREDICTED} | scheduled / target-only, "
              f"worst, {PREDICTED} | scheduled / fixed gamma 7 at the largest c, {PREDICTED} |",
              "|---|---|---|---|---|"]
    for preset, slc in keys:
        cells = []
        for what in ("cross", "worst", "last"):
            vals = []
            for pname in ("gsm8k", "arena-hard", NO_OVERHEAD):
                rows = sorted((k[2], v) for k, v in results.items() if k[:2] == (preset, slc) and k[3] == pname)
                if not rows:
                    continue
                ratio = lambda v, n: v[n].total_tps / v["target-only"].total_tps
                if what == "cross":
                    c = next((c for c, v in rows if ratio(v, "DSpark gamma=7") < 1.0), None)
                    vals.append(f"{pname}: {c if c is not None else 'never'}")
                elif what == "worst":
                    vals.append(f"{pname}: {min(ratio(v, 'DSpark scheduled') for _, v in rows):.2f}x")
                else:
                    c, v = rows[-1]
                    vals.append(f"{pname}: {v['DSpark scheduled'].total_tps / v['DSpark gamma=7'].total_tps:.2f}x "
                                f"(c = {c})")
            cells.append("; ".join(vals))
        lines.append(f"| {preset.removesuffix('_dspark')} | {slc} | " + " | ".join(cells) + " |")
    lines.append("")


def _paged(cache: Path, entries: list[dict], lines: list[str]) -> None:
    """Paged against dense KV on the same slice, target and concurrency."""
    pairs = []
    for e in entries:
        if e["key"].startswith("paged-"):
            dense = _load(cache, e["key"].replace("paged-", "grid-", 1))
            paged = _load(cache, e["key"])
            if dense is not None and paged is not None:
                pairs.append((e, dense, paged))
    if not pairs:
        return
    lines += ["## Paged KV", "",
              "The engine's paged cache reads the KV pages with its Pallas kernel (target/paged_kernel.py), which the "
              "cost model prices from the kernel's declared cost (bytes of every page the row's table names, flops "
              "and exponentials of every key: an upper bound, as the context is known at run time only), once per "
              "layer. Against the dense cache of the same shape (times in ms; fixed gamma's round verifies R (G + 1) "
              "tokens):", "",
              f"| target | slice | c | target-only step dense / paged, {PREDICTED} | verify R (G + 1) dense / paged, "
              f"{PREDICTED} | draft dense / paged, {PREDICTED} | kernel calls in the round |",
              "|---|---|---|---|---|---|---|"]
    for e, d, p in pairs:
        r, g = e["slots"], d["engine"]["gamma"]
        kernels = p["programs"][f"round@{p['buckets'][-1]}"].get("kernels", 0)
        lines.append(f"| {e['preset'].removesuffix('_dspark')} | {e['slice']} | {r} | {_ms(d['t_target_step'])} / "
                     f"{_ms(p['t_target_step'])} | {_ms(_round_at(d, r * (g + 1)) - d['t_draft'])} / "
                     f"{_ms(_round_at(p, r * (g + 1)) - p['t_draft'])} | {_ms(d['t_draft'])} / {_ms(p['t_draft'])} | "
                     f"{kernels} |")
    lines.append("")


def _one_token(cache: Path, grid: list[dict], lines: list[str]) -> None:
    """The target-only step at c = 1 beside the two-token verification: what the c = 1 speedups rest on."""
    rows = [(e, _load(cache, e["key"])) for e in grid if e["slots"] == 1]
    rows = [(e, d) for e, d in rows if d is not None and 2 in d["buckets"]]
    if not rows:
        return
    lines += ["## One token per program", "",
              "At one token a program's products are matrix-vector products, which XLA:TPU compiles as "
              "multiply-reduce fusions on the vector unit instead of the matrix unit; its cost model prices such a "
              "fusion well above the two-row product (a bf16 [1, 4096] x [4096, 14336] product on v6e: 496k "
              "cycles, the [2, 4096] one 150k, whose weight read at HBM speed is 72 us, about 91k cycles). "
              "The target-only step at c = 1 is such a program; a round verifying two or more tokens is not. "
              "Whether a TPU runs the one-token program that slowly is not known here; if it does not, the c = 1 "
              "speedups above are high by up to the ratio below (an engine could also pad the step to two tokens):",
              "", f"| target | slice | target-only step, 1 token (ms), {PREDICTED} | verify 2 tokens, less the "
              f"draft (ms), {PREDICTED} | ratio, {PREDICTED} |",
              "|---|---|---|---|---|"]
    for e, d in rows:
        t1, t2 = d["t_target_step"], d["t_verify"][d["buckets"].index(2)]
        lines.append(f"| {e['preset'].removesuffix('_dspark')} | {e['slice']} | {_ms(t1)} | {_ms(t2)} | "
                     f"{t1 / t2:.2f} |")
    lines.append("")


def _compilers(cache: Path) -> list[str]:
    """The line naming the libtpu versions that predicted the cost tables in `cache` (each table's
    `libtpu` field; "unknown" for a table that has none)."""
    versions = sorted({json.loads(p.read_text()).get("libtpu", "unknown") for p in cache.glob("*.json")})
    if not versions:
        return []
    return [f"Every cost table below: {PREDICTED} by libtpu {', '.join(versions)} (the tables' `libtpu` field).", ""]


def write_report(out: Path, cache: Path, entries: list[dict], rounds: int = 300) -> None:
    lines: list[str] = _compilers(cache)
    fitted = _comparison(cache, lines)
    if fitted is not None:
        _grid(cache, entries, fitted, rounds, lines, cache, out.parent)
    text = out.read_text() if out.exists() else ""
    block = f"{BEGIN}\n" + "\n".join(lines) + f"\n{END}"
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        text = text + "\n" + block + "\n"
    out.write_text(text)
