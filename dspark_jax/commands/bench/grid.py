"""`python -m dspark_jax bench grid`: the reproduction grid's tables and plots from eval results.

    python -m dspark_jax bench grid --out docs/results_figures --from /tmp/grid_v2
    python -m dspark_jax bench grid --out DIR --drafter dspark_g7_d2=EVAL_DIR --drafter dflash_g7_d2=EVAL_DIR
    python -m dspark_jax bench grid --out DIR --drafter dspark_g4_d2=runs/dspark_g4_d2/drafter --evals evals

One cell = one drafter evaluated by `python -m dspark_jax eval` (its results.json). A
``--drafter NAME=DIR`` whose DIR holds a results.json is rendered as is; one whose DIR is a
trained drafter (drafter_config.json) is first evaluated into ``EVALS/eval_NAME`` unless
that already holds results (the cache), with --num-prompts / --max-new-tokens.

Writes ``grid.md`` (tau with 95 % CI per set and cell; STS before / after per cell),
``grid.json`` and PNGs: conditional acceptance per position (one row per sweep: gamma at
depth 2, depth at gamma 7, the gamma-7 kinds; one column per prompt set), tau vs gamma and
tau vs depth with the intervals. Cell kind / gamma / depth come from the eval's metadata,
else the drafter's drafter_config.json, else the name ``<kind>_g<gamma>[_d<depth>]``.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path

import numpy as np

from dspark_jax.cli import report_user_errors
from dspark_jax.drafter import registry

KIND_ORDER = tuple(registry.KINDS)
KIND_COLOR = {k: f"C{i}" for i, k in enumerate(KIND_ORDER)}
MIN_SUPPORT = 30  # conditional acceptance resting on fewer rounds is drawn hollow
_NAME = re.compile(r"^(?P<kind>[a-z0-9]+?)_g(?P<gamma>\d+)(?:_d(?P<depth>\d+))?$")


class GridError(ValueError):
    pass


# ---------------------------------------------------------------------------- cells

def load_cell(name: str, path) -> dict:
    """One eval result dir (or its results.json) -> {"name", "kind", "gamma", "depth", "sets": {set: result}}."""
    path = Path(path)
    file = path / "results.json" if path.is_dir() else path
    if not file.is_file():
        raise GridError(f"cell {name!r}: {file} does not exist; pass an eval output dir written by "
                        f"`python -m dspark_jax eval --out DIR` (or a trained drafter dir to evaluate it)")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise GridError(f"cell {name!r}: {file} is not valid JSON "
                        f"({e.msg} at line {e.lineno}); re-run the eval") from None
    res = data.get("results") if isinstance(data, dict) else None
    if not isinstance(res, dict) or not res:
        raise GridError(f"cell {name!r}: {file} has no \"results\" "
                        "(expected the results.json of dspark_jax.eval.evaluate)")
    meta = data.get("meta", {})
    drafters = sorted({d for row in res.values() if isinstance(row, dict) for d in row})
    if len(drafters) != 1 and name not in drafters:
        raise GridError(f"cell {name!r}: {file} holds drafters {drafters}; name the cell after one of them")
    dname = name if name in drafters else drafters[0]
    sets = {}
    for s, row in res.items():
        r = row.get(dname) if isinstance(row, dict) else None
        if r is None:
            continue
        for k in ("tau", "ci95", "prompts", "conditional_acceptance"):
            if k not in r:
                raise GridError(f"cell {name!r}: {file} set {s!r} lacks {k!r}; re-run the eval with this version")
        sets[s] = r
    info = _cell_params(name, dname, meta, sets)
    return {"name": name, "path": str(file), "drafter": dname, "meta": meta, "sets": sets, **info}


def _cell_params(name: str, dname: str, meta: dict, sets: dict) -> dict:
    d = (meta.get("drafters") or {}).get(dname) or {}
    if not d:
        cfg = _drafter_config_from_command(meta.get("command", ""), dname)
        d = {k: cfg.get(k) for k in ("kind", "gamma", "num_layers")} if cfg else {}
    m = _NAME.match(name)
    kind = d.get("kind") or (m and m["kind"]) or None
    gamma = d.get("gamma") or (m and int(m["gamma"])) or len(next(iter(sets.values()))["conditional_acceptance"])
    depth = d.get("num_layers") or (m and m["depth"] and int(m["depth"])) or None
    return {"kind": kind, "gamma": int(gamma), "depth": None if depth is None else int(depth)}


def _drafter_config_from_command(command: str, dname: str) -> dict | None:
    try:
        argv = shlex.split(command)
    except ValueError:
        return None
    for a, b in zip(argv, argv[1:]):
        if a == "--drafter":
            n, _, p = b.rpartition("=")
            f = Path(p) / "drafter_config.json"
            if (not n or n == dname) and f.is_file():
                return json.loads(f.read_text())
    return None


def _block(cell) -> bool:
    """A cell of a block drafter (DSpark / DFlash: the gamma and depth sweeps)."""
    return cell["kind"] in registry.KINDS and registry.get_kind(cell["kind"]).drafts_in_parallel


def sort_cells(cells: list[dict]) -> list[dict]:
    """Gamma sweep at depth 2 first, then the other depths, then other kinds (Eagle3)."""
    k = lambda c: (not _block(c), c["depth"] != 2, c["depth"] or 0, c["gamma"],
                   KIND_ORDER.index(c["kind"]) if c["kind"] in KIND_ORDER else 99, c["name"])
    return sorted(cells, key=k)


def set_names(cells) -> list[str]:
    return list(dict.fromkeys(s for c in cells for s in c["sets"]))


# ---------------------------------------------------------------------------- tables

def _tau(r) -> str:
    return f"{r['tau']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]" if r else ""


def tau_table(cells) -> str:
    sets = set_names(cells)
    n = {s: sorted({c["sets"][s]["prompts"] for c in cells if s in c["sets"]}) for s in sets}
    head = [f"{s} tau [95 % CI] (n={'/'.join(map(str, n[s]))})" for s in sets]
    lines = ["| cell | kind | gamma | depth | " + " | ".join(head) + " |", "|---|---|---|---|" + "---|" * len(sets)]
    for c in cells:
        lines.append(f"| {c['name']} | {c['kind'] or '?'} | {c['gamma']} | {c['depth'] or '?'} | "
                     + " | ".join(_tau(c["sets"].get(s)) for s in sets) + " |")
    return "\n".join(lines)


def source_table(cells) -> str:
    """tau per prompt source inside a set (e.g. code: stdlib hold-out vs dependencies)."""
    cols = list(dict.fromkeys((s, lab) for c in cells for s, r in c["sets"].items() for lab in r.get("by_source", {})))
    if not cols:
        return ""
    lines = ["| cell | " + " | ".join(f"{s}: {lab}" for s, lab in cols) + " |", "|---|" + "---|" * len(cols)]
    for c in cells:
        cells_ = [c["sets"].get(s, {}).get("by_source", {}).get(lab) for s, lab in cols]
        lines.append(f"| {c['name']} | " + " | ".join(f"{_tau(b)} (n={b['prompts']})" if b else ""
                                                      for b in cells_) + " |")
    return "\n".join(lines)


def _pct(v) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}"


def sts_rows(cells) -> list[dict]:
    rows = []
    for c in cells:
        for s, r in c["sets"].items():
            sp = r.get("sts_split")
            if not sp:
                continue
            if "error" in sp:
                rows.append({"cell": c["name"], "set": s, "error": sp["error"]})
                continue
            rep = sp["report"]
            rows.append({"cell": c["name"], "set": s, "n_fit": sp["n_fit"], "n_heldout": sp["n_heldout"],
                         "ece1_before": rep["ece_before"][0], "ece1_after": rep["ece_after"][0],
                         "ece_mean_before": sp["ece_before_mean"], "ece_mean_after": sp["ece_after_mean"],
                         "brier_mean_before": sp["brier_before_mean"], "brier_mean_after": sp["brier_after_mean"],
                         "auc1": rep["auc_before"][0], "temperatures": sp["temperatures"]})
    return rows


def sts_table(cells) -> str:
    rows = sts_rows(cells)
    if not rows:
        return ""
    lines = ["| cell | set | rounds fit / held-out | ECE pos 1 before -> after (%) | mean ECE over positions "
             "before -> after (%) | mean Brier before -> after | ROC-AUC pos 1 | T_1..T_G |",
             "|---|---|---|---|---|---|---|---|"]
    f3 = lambda v: "n/a" if v is None else f"{v:.3f}"
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['cell']} | {r['set']} | not fitted: {r['error'][:80]} | | | | | |")
            continue
        temps = ", ".join(f"{t:.2g}" for t in r["temperatures"])
        lines.append(f"| {r['cell']} | {r['set']} | {r['n_fit']} / {r['n_heldout']} | {_pct(r['ece1_before'])} -> "
                     f"{_pct(r['ece1_after'])} | {_pct(r['ece_mean_before'])} -> {_pct(r['ece_mean_after'])} | "
                     f"{f3(r['brier_mean_before'])} -> {f3(r['brier_mean_after'])} | {f3(r['auc1'])} | {temps} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- plots

def sweeps(cells) -> list[tuple[str, list[dict]]]:
    """(title, cells) rows of the conditional-acceptance figure; falls back to one row of all cells."""
    two = [c for c in cells if _block(c)]
    out = []
    g = [c for c in two if c["depth"] == 2]
    if len({c["gamma"] for c in g}) > 1:
        out.append(("gamma sweep, depth 2", g))
    d = [c for c in two if c["gamma"] == 7]
    if len({c["depth"] for c in d}) > 1:
        out.append(("depth sweep, gamma 7", d))
    k = [c for c in cells if c["gamma"] == 7 and (c["depth"] == 2 or not _block(c))]
    if len({c["kind"] for c in k}) > 1:
        out.append(("kinds at gamma 7", k))
    return out or [("all cells", list(cells))]


def _style(c, variants: list) -> dict:
    ls = ("-", "--", ":", "-.")[variants.index(c["name"]) % 4] if c["name"] in variants else "-"
    return {"color": KIND_COLOR.get(c["kind"], "C7"), "ls": ls}


def plot_conditional(cells, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, sets = sweeps(cells), set_names(cells)
    fig, axes = plt.subplots(len(rows), len(sets), figsize=(3.6 * len(sets), 2.9 * len(rows)), squeeze=False)
    for i, (title, group) in enumerate(rows):
        for j, s in enumerate(sets):
            ax = axes[i][j]
            for c in group:
                r = c["sets"].get(s)
                if not r:
                    continue
                same_kind = [x["name"] for x in group if x["kind"] == c["kind"]]
                st = _style(c, same_kind)
                ca = np.asarray(r["conditional_acceptance"], float)
                sup = np.asarray(r.get("conditional_support", [MIN_SUPPORT] * len(ca)))
                k = np.arange(1, len(ca) + 1)
                ok = sup >= MIN_SUPPORT
                ax.plot(k[ok], ca[ok], marker="o", ms=3, label=c["name"], **st)
                if (~ok).any():
                    ax.plot(k[~ok], ca[~ok], marker="o", ms=3, ls="none", mfc="none", color=st["color"])
            ax.set_ylim(0, 1)
            ax.set_title(f"{s}: {title}", fontsize=9)
            if i == len(rows) - 1:
                ax.set_xlabel("draft position k")
            if j == 0:
                ax.set_ylabel("conditional acceptance")
            if j == len(sets) - 1:
                ax.legend(fontsize=7)
    fig.suptitle(f"conditional acceptance per position (hollow: fewer than {MIN_SUPPORT} rounds reached k)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_tau_vs(cells, axis: str, path: Path) -> Path | None:
    """tau with 95 % CI against ``axis`` ("gamma" at depth 2, or "depth" at gamma 7), a line per kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pick = (lambda c: c["depth"] == 2) if axis == "gamma" else (lambda c: c["gamma"] == 7)
    chosen = [c for c in cells if pick(c) and c[axis] is not None]
    if len({c[axis] for c in chosen}) < 2:
        return None
    sets = set_names(chosen)
    kinds = list(dict.fromkeys(c["kind"] for c in chosen))
    fig, axes = plt.subplots(1, len(sets), figsize=(3.4 * len(sets), 3.0), squeeze=False)
    for ax, s in zip(axes[0], sets):
        for n, kind in enumerate(kinds):
            pts = sorted((c[axis], c["sets"][s]) for c in chosen if c["kind"] == kind and s in c["sets"])
            if not pts:
                continue
            x = np.asarray([p[0] for p in pts], float) * (1 + 0.02 * (n - (len(kinds) - 1) / 2))
            y = np.asarray([p[1]["tau"] for p in pts])
            err = np.asarray([[p[1]["tau"] - p[1]["ci95"][0], p[1]["ci95"][1] - p[1]["tau"]] for p in pts]).T
            ax.errorbar(x, y, yerr=err, marker="o", ms=4, capsize=3, label=kind, color=KIND_COLOR.get(kind, "C7"))
        ax.set_xticks(sorted({c[axis] for c in chosen}))
        ax.set_title(s, fontsize=9)
        ax.set_xlabel(axis + (" (depth 2)" if axis == "gamma" else " (drafter layers, gamma 7)"))
    axes[0][0].set_ylabel("accepted length tau (95 % CI)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- render / run

def render(cells, out, command: str = "") -> dict:
    """Tables (grid.md), summary (grid.json) and PNGs for ``cells`` into ``out``."""
    if not cells:
        raise GridError("no cells to render: pass --drafter NAME=EVAL_DIR or --from DIR holding eval_*/results.json")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cells = sort_cells(cells)
    plots = [plot_conditional(cells, out / "conditional_acceptance.png")]
    plots += [p for p in (plot_tau_vs(cells, "gamma", out / "tau_vs_gamma.png"),
                          plot_tau_vs(cells, "depth", out / "tau_vs_depth.png")) if p]
    meta = cells[0]["meta"]
    lines = ["# Reproduction grid", "", f"Command: `{command}`" if command else "", "",
             f"Eval settings (first cell): `{meta.get('command', '?')}`", "",
             "## Accepted length tau (95 % bootstrap interval over requests)", "", tau_table(cells), ""]
    src = source_table(cells)
    if src:
        lines += ["### tau by prompt source", "", src, ""]
    sts = sts_table(cells)
    if sts:
        lines += ["## STS before / after (fit on half of the requests, metrics on the other half)", "", sts, ""]
    lines += ["## Plots", ""] + [f"![{p.name}]({p.name})" for p in plots]
    (out / "grid.md").write_text("\n".join(lines) + "\n")
    summary = {"command": command, "cells": [{k: c[k] for k in ("name", "kind", "gamma", "depth", "path")} | {
        "tau": {s: {"tau": r["tau"], "ci95": r["ci95"], "prompts": r["prompts"]} for s, r in c["sets"].items()}}
        for c in cells], "sts": sts_rows(cells), "plots": [p.name for p in plots]}
    (out / "grid.json").write_text(json.dumps(summary, indent=1))
    return {"markdown": out / "grid.md", "plots": plots, "summary": summary}


def _evaluate_if_needed(name: str, drafter_dir: Path, evals: Path, eval_args: list[str]) -> Path:
    dest = evals / f"eval_{name}"
    if (dest / "results.json").is_file():
        print(f"[grid] {name}: cached {dest}")
        return dest
    from dspark_jax.commands.eval import main as eval_main

    print(f"[grid] {name}: evaluating {drafter_dir} -> {dest}")
    rc = eval_main(["--drafter", f"{name}={drafter_dir}", "--out", str(dest), *eval_args])
    if rc:
        raise GridError(f"cell {name!r}: the eval of {drafter_dir} failed (exit {rc}); see the message above")
    return dest


def collect(specs, from_dirs, evals, eval_args) -> list[dict]:
    cells = []
    for d in from_dirs:
        root = Path(d)
        if not root.is_dir():
            raise GridError(f"--from {d}: not a directory (expected one holding eval_<name>/results.json)")
        found = sorted(p for p in root.glob("eval_*") if (p / "results.json").is_file())
        if not found:
            raise GridError(f"--from {d}: no eval_<name>/results.json inside; run `python -m dspark_jax eval "
                            f"--out {d}/eval_<name> ...` first")
        cells += [load_cell(p.name[len("eval_"):], p) for p in found]
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise GridError(f"--drafter {spec!r}: expected NAME=DIR (an eval output dir or a trained drafter dir)")
        p = Path(path)
        if (p / "drafter_config.json").is_file() and not (p / "results.json").is_file():
            p = _evaluate_if_needed(name, p, Path(evals), eval_args)
        cells.append(load_cell(name, p))
    names = [c["name"] for c in cells]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise GridError(f"cell name(s) {dup} given twice; every cell needs its own name")
    return cells


@report_user_errors
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspark_jax bench grid", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output dir for grid.md, grid.json and the PNGs")
    ap.add_argument("--drafter", action="append", default=[], metavar="NAME=DIR",
                    help="a cell: an eval output dir (results.json), or a trained drafter dir to evaluate")
    ap.add_argument("--from", dest="from_dirs", action="append", default=[], metavar="DIR",
                    help="add every DIR/eval_<name>/results.json as cell <name>")
    ap.add_argument("--evals", default=None, help="where drafters given by --drafter are evaluated (default OUT/evals)")
    ap.add_argument("--num-prompts", type=int, default=200, help="for evals run here (default 200)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="for evals run here (default 32)")
    args = ap.parse_args(argv)
    eval_args = ["--num-prompts", str(args.num_prompts), "--max-new-tokens", str(args.max_new_tokens)]
    command = "python -m dspark_jax bench grid " + " ".join(shlex.quote(a)
                                                            for a in (sys.argv[1:] if argv is None else argv))
    try:
        cells = collect(args.drafter, args.from_dirs, args.evals or Path(args.out) / "evals", eval_args)
        rendered = render(cells, args.out, command)
    except GridError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[grid] {len(cells)} cells -> {rendered['markdown']} ({', '.join(p.name for p in rendered['plots'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
