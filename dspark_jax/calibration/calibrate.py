"""STS calibration from engine traces (docs/method.md §2.4): fit, report, save with the drafter.

    python -m dspark_jax calibrate --traces run.npz [more.npz ...] --drafter ckpt/drafter \
        [--out reports/calib] [--grid-size 256 --grid-min 0.05 --grid-max 20 --bins 20] [--holdout 0.5]
    python -m dspark_jax calibrate --synthetic-traces --drafter /tmp/d          # standalone demo

Only rounds verified at full gamma are used (shorter rounds censor the labels). Traces are
grouped by sampling setting (the soft label is defined at one temperature, so the fit is
per setting); each group is split by request into fit / held-out halves, T_j is fitted on
the first and ECE / Brier / conditional ROC-AUC are reported on the second.

The temperatures live in ``<drafter_dir>/sts.json``::

    {"format": "dspark_sts/1", "gamma": 7,
     "settings": {"T1_k0_p1": {"temperatures": [...], "sampling": {...}, "n_rounds": ..,
                               "report": {...}, "grid": {...}}}}

and the engine reads them with :func:`load_temperatures` (``Engine.generate(..., sts=...)``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from dspark_jax.calibration.sts import (
    calibration_report,
    fit_sts,
    make_grid,
    prefix_labels,
    survival,
)
from dspark_jax.calibration.traces import (
    TraceSet,
    load_traces,
    recorded_sampling,
    sampling_key,
)

__all__ = ["STS_FILE", "CalibrationMissingError", "make_grid", "split_by_request", "calibrate_traces",
           "save_temperatures", "load_temperatures", "stored_temperatures", "reliability_diagram", "report_table"]

log = logging.getLogger(__name__)

STS_FILE = "sts.json"
FORMAT = "dspark_sts/1"


class CalibrationMissingError(FileNotFoundError):
    """STS temperatures were requested but are not stored for this drafter / sampling setting."""


def split_by_request(ts: TraceSet, holdout: float, seed: int = 0) -> tuple[TraceSet, TraceSet]:
    """Fit / held-out split by request id (rounds of one request stay together)."""
    if not 0.0 <= holdout < 1.0:
        raise ValueError(f"holdout must be in [0, 1), got {holdout}")
    if holdout == 0.0:
        return ts, ts
    ids = np.unique(ts.request)
    rng = np.random.default_rng(seed)
    held = rng.permutation(ids)[: max(1, int(round(holdout * len(ids))))] if len(ids) > 1 else ids[:0]
    m = np.isin(ts.request, held)
    if not m.any() or m.all():  # too few requests: split rows instead
        m = np.zeros(len(ts), bool)
        m[rng.permutation(len(ts))[: max(1, int(round(holdout * len(ts))))]] = True
    return ts.select(~m), ts.select(m)


def calibrate_traces(ts: TraceSet, *, grid=None, n_bins: int = 20, holdout: float = 0.5, seed: int = 0,
                     min_rounds: int = 50) -> dict:
    """Fit STS on one sampling setting's full-gamma rounds -> {"temperatures", "report", ...}."""
    full = ts.full_gamma()
    if len(full) < min_rounds:
        raise ValueError(f"only {len(full)} rounds verified at full gamma for sampling {ts.key} "
                         f"(need >= {min_rounds}): "
                         "record traces with fixed full-gamma verification (policy 'fixed', gamma = block size)")
    grid = make_grid() if grid is None else np.asarray(grid, np.float64)
    fit, held = split_by_request(full, holdout, seed)
    temps = fit_sts(fit.conf_logits, fit.accepted, grid=grid, n_bins=n_bins)
    rep = calibration_report(held.conf_logits, held.accepted, temps, n_bins=n_bins)
    return {"temperatures": [float(t) for t in temps], "sampling": ts.sampling, "n_rounds": len(full),
            "n_fit": len(fit), "n_heldout": len(held), "n_bins": n_bins,
            "grid": {"size": int(len(grid)), "min": float(grid.min()), "max": float(grid.max())},
            "drafter_kind": ts.meta.get("drafter_kind"), "source": ts.meta.get("source"),
            "target_fingerprint": ts.meta.get("target_fingerprint"), "report": _clean(rep)}


def _clean(rep: dict) -> dict:
    return {k: [None if (v is None or not np.isfinite(v)) else float(v) for v in vals] for k, vals in rep.items()}


def save_temperatures(drafter_dir, sampling, result: dict) -> Path:
    """Store one sampling setting's fit in ``<drafter_dir>/sts.json`` (other settings kept)."""
    d = Path(drafter_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / STS_FILE
    data = json.loads(path.read_text()) if path.exists() else {"format": FORMAT, "settings": {}}
    g = len(result["temperatures"])
    if data.get("gamma", g) != g:
        raise ValueError(f"{path} holds temperatures for gamma {data['gamma']}, the new fit has {g}: "
                         "one drafter has one block size; remove the stale file")
    data["gamma"] = g
    data["settings"][sampling_key(sampling)] = result
    path.write_text(json.dumps(data, indent=1))
    return path


def stored_temperatures(drafter_dir, sampling, gamma: int | None = None) -> np.ndarray | None:
    """`load_temperatures` where the drafter has them; None (logged) where it has none for
    `sampling` (or there is no drafter directory): a default, not a requirement."""
    if drafter_dir is None:
        return None
    try:
        t = load_temperatures(drafter_dir, sampling, gamma)
    except CalibrationMissingError as e:
        log.debug("no stored STS temperatures used: %s", e)
        return None
    log.info("STS temperatures stored with the drafter for %s: %s", sampling_key(sampling), np.round(t, 3).tolist())
    return t


def load_temperatures(drafter_dir, sampling, gamma: int | None = None) -> np.ndarray:
    """STS temperatures [G] for ``sampling`` (dict / SamplingParams / key) stored with the drafter.

    Raises CalibrationMissingError (naming the file, the setting and the fix) when absent."""
    path = Path(drafter_dir) / STS_FILE
    key = sampling_key(sampling)
    fix = (f"run `python -m dspark_jax calibrate --traces <full-gamma traces at {key}> --drafter {drafter_dir}`, "
           "or run without calibration (sts=None)")
    if not path.exists():
        raise CalibrationMissingError(f"no STS temperatures for this drafter: {path} does not exist; {fix}")
    data = json.loads(path.read_text())
    if data.get("format") != FORMAT:
        raise CalibrationMissingError(f"{path} is not an STS file (format {data.get('format')!r}); {fix}")
    if key not in data.get("settings", {}):
        have = ", ".join(sorted(data.get("settings", {}))) or "none"
        raise CalibrationMissingError(f"{path} has no STS temperatures for sampling {key} (has: {have}); {fix}")
    t = np.asarray(data["settings"][key]["temperatures"], np.float32)
    if gamma is not None and t.shape != (gamma,):
        raise CalibrationMissingError(f"{path} holds {t.shape[0]} temperatures for {key}, "
                                      f"the engine needs {gamma}; {fix}")
    if not np.all(t > 0):
        raise CalibrationMissingError(f"{path} holds non-positive temperatures for {key}; {fix}")
    return t


def reliability_diagram(conf_logits, accepted, temps, path, n_bins: int = 20, positions=None, title: str = "") -> Path:
    """Per position: realised prefix acceptance vs predicted survival a_j, before / after STS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    G = np.shape(conf_logits)[1]
    positions = list(range(G)) if positions is None else list(positions)
    y = prefix_labels(accepted, G)
    fig, axes = plt.subplots(1, len(positions), figsize=(3.0 * len(positions), 3.2), squeeze=False)
    edges = np.linspace(0, 1, n_bins + 1)
    curves = [(tag, survival(conf_logits, t), style) for tag, t, style in
              (("before", None, "o--"), ("after", temps, "s-"))]
    for ax, j in zip(axes[0], positions):
        for tag, surv, style in curves:
            a = surv[:, j]
            idx = np.clip(np.digitize(a, edges) - 1, 0, n_bins - 1)
            xs, ys = [], []
            for b in range(n_bins):
                m = idx == b
                if m.sum() >= 5:
                    xs.append(a[m].mean())
                    ys.append(y[m, j].mean())
            ax.plot(xs, ys, style, ms=3, label=tag)
        ax.plot([0, 1], [0, 1], color="grey", lw=0.8)
        ax.set_title(f"position {j + 1}")
        ax.set_xlabel("predicted survival a_j")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
    axes[0][0].set_ylabel("realised prefix acceptance")
    axes[0][0].legend(loc="upper left", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def fmt(v, pct: bool = False) -> str:
    """A report number: "n/a" for a missing metric, else 3 decimals (or a percentage)."""
    return "n/a" if v is None else (f"{100 * v:.1f} %" if pct else f"{v:.3f}")


def report_table(res: dict, extra: dict | None = None) -> str:
    """Markdown table of a fit's per-position temperatures and metrics; ``extra``: more
    columns {header: [value per position]}."""
    r, extra = res["report"], extra or {}
    lines = ["| position | T_j | ECE before | ECE after | Brier before | Brier after | AUC before | AUC after |"
             + "".join(f" {h} |" for h in extra),
             "|---|---|---|---|---|---|---|---|" + "---|" * len(extra)]
    for j, t in enumerate(res["temperatures"]):
        lines.append(f"| {j + 1} | {t:.3g} | {fmt(r['ece_before'][j], True)} | {fmt(r['ece_after'][j], True)} | "
                     f"{fmt(r['brier_before'][j])} | {fmt(r['brier_after'][j])} | {fmt(r['auc_before'][j])} | "
                     f"{fmt(r['auc_after'][j])} |" + "".join(f" {fmt(v[j])} |" for v in extra.values()))
    return "\n".join(lines)




def parse_sampling(text: str) -> dict:
    """'T' or 'T,TOP_K,TOP_P' -> the sampling dict traces record."""
    parts = text.split(",")
    try:
        if len(parts) not in (1, 3):
            raise ValueError
        t = float(parts[0])
        k, p = (int(parts[1]), float(parts[2])) if len(parts) == 3 else (0, 1.0)
    except ValueError:
        raise ValueError(f"--sampling {text!r}: give T or T,TOP_K,TOP_P, e.g. 0 or 1,0,1.0") from None
    return {"temperature": t, "top_k": k, "top_p": p}


def load_trace_file(path, sampling: dict | None) -> TraceSet:
    """A trace file with its sampling setting: the one it records, else --sampling; never a guess
    (an STS fit stored under the wrong temperature would be read by every later run at that one)."""
    if not Path(path).exists():
        return load_traces(path)  # its own error names the file
    rec = recorded_sampling(path)
    if rec is None and sampling is None:
        raise ValueError(f"{path} does not record the sampling setting its rounds were drafted under: pass "
                         "--sampling T[,TOP_K,TOP_P], or write the traces with `python -m dspark_jax generate "
                         "--traces F.npz`, which records it")
    if rec is not None and sampling is not None and sampling_key(rec) != sampling_key(sampling):
        raise ValueError(f"{path} records sampling {sampling_key(rec)} but --sampling says {sampling_key(sampling)}: "
                         "drop --sampling (the file's own setting is used)")
    return load_traces(path, meta=None if rec is not None else {"sampling": sampling})


