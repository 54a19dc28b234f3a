"""Held-out tau against training steps, per drafter, from the runs' log.jsonl (the trainer logs
the held-out expected accepted length every `train.eval_every` steps): whether a drafter's gain
grows with training."""

from __future__ import annotations

from pathlib import Path

from dspark_jax.toolkit.metrics import read_jsonl

__all__ = ["training_curves", "curve_table", "plot_curves"]

KEY = "eval/expected_accepted_length"


def training_curves(out: Path, kinds) -> dict[str, list[tuple[int, float, float, float]]]:
    """{kind: [(step, tau, ci low, ci high)]} from OUT/<kind>/log.jsonl (a resumed run's repeated
    steps keep their last record); kinds without a log are left out."""
    curves = {}
    for kind in kinds:
        log = Path(out) / kind / "log.jsonl"
        if not log.is_file():
            continue
        points = {}
        for rec in read_jsonl(log):
            if KEY in rec and "step" in rec:
                lo, hi = rec.get(f"{KEY}_ci95") or (float("nan"), float("nan"))
                points[int(rec["step"])] = (int(rec["step"]), float(rec[KEY]), float(lo), float(hi))
        if points:
            curves[kind] = [points[s] for s in sorted(points)]
    return curves


def curve_table(curves: dict) -> list[str]:
    """Markdown rows: one per step, one column per drafter (tau [95 % CI]), and the ratio of the
    first two drafters where both were evaluated at that step."""
    kinds = list(curves)
    if not kinds:
        return []
    steps = sorted({p[0] for c in curves.values() for p in c})
    at = {k: {p[0]: p for p in c} for k, c in curves.items()}
    ratio = len(kinds) >= 2
    head = "| step | " + " | ".join(kinds) + (f" | {kinds[0]} / {kinds[1]} |" if ratio else " |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in steps:
        cells = [f"{at[k][s][1]:.3f} [{at[k][s][2]:.3f}, {at[k][s][3]:.3f}]" if s in at[k] else "-" for k in kinds]
        row = f"| {s} | " + " | ".join(cells) + " |"
        if ratio:
            a, b = at[kinds[0]].get(s), at[kinds[1]].get(s)
            row += f" {a[1] / b[1]:.3f} |" if a and b else " - |"
        rows.append(row)
    return rows


def plot_curves(curves: dict, path: Path) -> Path | None:
    """tau against steps with its interval as a band, one line per drafter."""
    if not curves:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 3.6))
    for i, (kind, pts) in enumerate(curves.items()):
        s, t, lo, hi = zip(*pts)
        ax.plot(s, t, "o-", color=f"C{i}", label=kind)
        ax.fill_between(s, lo, hi, color=f"C{i}", alpha=0.2)
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out expected tau (95 % CI)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
