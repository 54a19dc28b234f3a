"""The plots of docs/tpu_predictions.md: each method's total against per-user tokens/s per slice
(bench/tpu_report.py simulates them)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["plot_methods"]

PREDICTED = "predicted (XLA:TPU cost model)"


def plot_methods(results: dict, methods, no_overhead: str, plots: Path, lines: list[str], out_dir: Path) -> None:
    """One figure per target: throughput against per-user speed on each slice, one curve per
    method (solid: with the fitted overhead; dashed: the compiler alone), linked from `lines`.
    `results[(preset, slice, concurrency, pass)]` maps method names to SimResults."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    plots.mkdir(parents=True, exist_ok=True)
    for preset in sorted({k[0] for k in results}):
        slices = sorted({k[1] for k in results if k[0] == preset})
        fig, axes = plt.subplots(1, len(slices), figsize=(4.2 * len(slices), 3.8), squeeze=False)
        for ax, slc in zip(axes[0], slices):
            for pname, style in (("gsm8k", "o-"), (no_overhead, "x--")):
                rows = sorted((k[2], v) for k, v in results.items() if k[:2] == (preset, slc) and k[3] == pname)
                for i, m in enumerate(methods):
                    x = [v[m.name].per_user_tps for _, v in rows]
                    y = [v[m.name].total_tps for _, v in rows]
                    ax.plot(x, y, style, color=f"C{i}", alpha=1.0 if pname == "gsm8k" else 0.45,
                            label=m.name if pname == "gsm8k" else None)
                    for c, v in rows:
                        ax.annotate(str(c), (v[m.name].per_user_tps, v[m.name].total_tps), fontsize=6, alpha=0.6)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_xlabel(f"per-user tokens/s, {PREDICTED}", fontsize=7)
            ax.set_ylabel(f"total tokens/s, {PREDICTED}", fontsize=7)
            ax.set_title(f"{preset.removesuffix('_dspark')} on {slc}: {PREDICTED}\nGSM8K acceptance (paper, T = 1)\n"
                         "solid: model B's overhead; dashed: the compiler alone", fontsize=7)
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        path = plots / f"tpu_predicted_{preset}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        lines += [f"![{preset}]({os.path.relpath(path, out_dir)})", "",
                  f"Total against per-user tokens/s, {PREDICTED}, not measured: the serving simulation on the "
                  "predicted cost tables with the paper's Qwen3-4B GSM8K acceptance (temperature 1) "
                  "(`python -m dspark_jax bench tpu-predict --render-only`). Each point is one concurrency "
                  "(its label); "
                  "DSpark gamma=7 lies under DSpark scheduled wherever the scheduler keeps the whole block.", ""]
