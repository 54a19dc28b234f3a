"""Sequential Temperature Scaling (STS) and calibration metrics (docs/method.md §2.4). Host-side numpy.

Data layout: ``conf_logits[N, G]`` = confidence logits z_j of N held-out rounds, and
``accepted[N]`` = number of accepted draft tokens of each round. Fitting needs rounds
verified at full length G (shorter rounds censor the labels). The realised prefix
acceptance label of slot j is ``1[accepted > j]``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["make_grid", "default_grid", "ece", "brier", "roc_auc", "fit_sts", "calibration_report", "sigmoid",
           "survival", "prefix_labels"]


def sigmoid(z):
    z = np.asarray(z, np.float64)
    return 0.5 * (1.0 + np.tanh(0.5 * z))  # overflow-free


def survival(conf_logits, temps=None) -> np.ndarray:
    """[N, G] predicted prefix survival a_j = prod_{i<=j} sigmoid(z_i / T_i) (T = 1 when ``temps`` is None)."""
    z = np.asarray(conf_logits, np.float64)
    t = np.ones(z.shape[1]) if temps is None else np.asarray(temps, np.float64)
    return np.cumprod(sigmoid(z / t[None, :]), axis=1)


def make_grid(size: int = 256, lo: float = 0.05, hi: float = 20.0, include_one: bool = True) -> np.ndarray:
    """``size`` log-spaced temperatures in [lo, hi] (plus 1.0), ascending, unique."""
    if size < 1 or not (0 < lo <= hi):
        raise ValueError(f"bad STS grid: size {size} >= 1 and 0 < lo {lo} <= hi {hi} required")
    g = np.geomspace(lo, hi, size)
    return np.unique(np.concatenate([g, [1.0]]) if include_one else g)


def default_grid() -> np.ndarray:
    """256 log-spaced temperatures in [0.05, 20] plus 1.0, ascending."""
    return make_grid()


def ece(probs, labels, n_bins: int = 20) -> float:
    """Expected calibration error with ``n_bins`` equal-width bins on [0, 1]
    (bin i = [i/n, (i+1)/n), the last bin closed)."""
    p = np.asarray(probs, np.float64).ravel()
    y = np.asarray(labels, np.float64).ravel()
    if p.size == 0:
        return 0.0
    idx = np.clip(np.floor(p * n_bins).astype(np.int64), 0, n_bins - 1)
    sp = np.bincount(idx, weights=p, minlength=n_bins)
    sy = np.bincount(idx, weights=y, minlength=n_bins)
    return float(np.sum(np.abs(sp - sy)) / p.size)  # sum_b n_b/N |mean p_b - mean y_b|


def brier(probs, labels) -> float:
    p = np.asarray(probs, np.float64).ravel()
    y = np.asarray(labels, np.float64).ravel()
    return float(np.mean((p - y) ** 2)) if p.size else float("nan")


def roc_auc(scores, labels) -> float:
    """Area under the ROC curve (Mann-Whitney U, ties count 1/2). NaN if one class is empty."""
    s = np.asarray(scores, np.float64).ravel()
    y = np.asarray(labels).ravel().astype(bool)
    n1, n0 = int(y.sum()), int((~y).sum())
    if n1 == 0 or n0 == 0:
        return float("nan")
    order = np.argsort(s, kind="stable")
    ss = s[order]
    ranks = np.empty(s.size, np.float64)
    # average ranks over tie groups
    starts = np.r_[0, np.flatnonzero(np.diff(ss)) + 1]
    ends = np.r_[starts[1:], s.size]
    avg = (starts + ends + 1) / 2.0  # 1-based average rank of each group
    ranks[order] = np.repeat(avg, ends - starts)
    u = ranks[y].sum() - n1 * (n1 + 1) / 2.0
    return float(u / (n1 * n0))


def prefix_labels(accepted, G) -> np.ndarray:
    """[N, G] float: the realised prefix acceptance label 1[accepted > j]."""
    acc = np.asarray(accepted).reshape(-1, 1)
    return (acc > np.arange(G)[None, :]).astype(np.float64)


def fit_sts(conf_logits, accepted, grid=None, n_bins: int = 20) -> np.ndarray:
    """Fit T_0..T_{G-1} left to right; T_j minimises the ECE of prod_{i<=j} sigmoid(z_i/T_i)
    against 1[accepted > j] with T_{<j} fixed. Ties: the smallest grid temperature."""
    z = np.asarray(conf_logits, np.float64)
    N, G = z.shape
    grid = default_grid() if grid is None else np.asarray(grid, np.float64)
    y = prefix_labels(accepted, G)
    temps = np.ones(G)
    prefix = np.ones(N)
    for j in range(G):
        errs = [ece(prefix * sigmoid(z[:, j] / t), y[:, j], n_bins) for t in grid]
        temps[j] = grid[int(np.argmin(errs))]
        prefix = prefix * sigmoid(z[:, j] / temps[j])
    return temps


def calibration_report(conf_logits, accepted, temps, n_bins: int = 20) -> dict:
    """Per-position metrics before (T = 1) and after (``temps``).

    Keys ``ece_before/after``, ``brier_before/after`` (cumulative survival a_j vs
    1[accepted > j], all rounds) and ``auc_before/after`` (conditional c_j vs
    1[accepted > j] on rounds with accepted >= j), each a list of length G."""
    z = np.asarray(conf_logits, np.float64)
    N, G = z.shape
    acc = np.asarray(accepted)
    y = prefix_labels(acc, G)
    out = {}
    for tag, t in (("before", np.ones(G)), ("after", np.asarray(temps, np.float64))):
        c = sigmoid(z / t[None, :])
        a = np.cumprod(c, axis=1)  # = survival(z, t); c is needed for the conditional AUC
        out[f"ece_{tag}"] = [ece(a[:, j], y[:, j], n_bins) for j in range(G)]
        out[f"brier_{tag}"] = [brier(a[:, j], y[:, j]) for j in range(G)]
        out[f"auc_{tag}"] = [roc_auc(c[acc >= j, j], y[acc >= j, j]) for j in range(G)]
    return out
