"""The evaluation's statistics as pure numpy functions: tau with bootstrap intervals (alone, per
group, and the paired ratio of two drafters), conditional acceptance per draft position (also
pooled over an engine run's traces, with an interval over requests), the static-threshold
replay, and the fixed-length replay it is judged against (tokens verified at equal tau)."""

from __future__ import annotations

import warnings

import numpy as np

from dspark_jax.calibration.sts import survival

__all__ = ["THRESHOLDS", "acceptance_by_position", "bootstrap_tau", "paired_tau_ratio", "conditional_acceptance",
           "conditional_support", "tau_by_group", "threshold_sweep", "fixed_length_sweep", "fixed_verified_at"]

THRESHOLDS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def bootstrap_tau(accepted: np.ndarray, rounds: np.ndarray, n: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """tau = (sum accepted + sum rounds) / sum rounds over requests, and its 95 % percentile interval."""
    accepted, rounds = np.asarray(accepted, float), np.asarray(rounds, float)
    tau = (accepted.sum() + rounds.sum()) / max(rounds.sum(), 1.0)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(rounds), (n, len(rounds)))
    a, r = accepted[idx].sum(1), rounds[idx].sum(1)
    boot = (a + r) / np.maximum(r, 1.0)
    return float(tau), float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))


def paired_tau_ratio(acc_a, rounds_a, acc_b, rounds_b, n: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """tau_a / tau_b over the same requests, and its 95 % percentile interval from resampling the
    requests once for both (paired: the prompts' difficulty cancels in the ratio)."""
    acc_a, rounds_a, acc_b, rounds_b = (np.asarray(x, float) for x in (acc_a, rounds_a, acc_b, rounds_b))
    if not (len(acc_a) == len(rounds_a) == len(acc_b) == len(rounds_b)):
        raise ValueError("a paired ratio needs both drafters' totals on the same requests")
    tau = lambda a, r: (a.sum(-1) + r.sum(-1)) / np.maximum(r.sum(-1), 1.0)
    idx = np.random.default_rng(seed).integers(0, len(acc_a), (n, len(acc_a)))
    boot = tau(acc_a[idx], rounds_a[idx]) / tau(acc_b[idx], rounds_b[idx])
    return (float(tau(acc_a, rounds_a) / tau(acc_b, rounds_b)), float(np.percentile(boot, 2.5)),
            float(np.percentile(boot, 97.5)))


def conditional_acceptance(accepted: np.ndarray, length: np.ndarray, G: int) -> np.ndarray:
    """[G]: position k = j+1: #(accepted >= k) / #(accepted >= k-1 and length >= k)."""
    accepted, length = np.asarray(accepted), np.asarray(length)
    out = np.full((G,), np.nan)
    den = conditional_support(accepted, length, G)
    for k in range(1, G + 1):
        if den[k - 1]:
            out[k - 1] = np.sum(accepted >= k) / den[k - 1]
    return out


def conditional_support(accepted: np.ndarray, length: np.ndarray, G: int) -> np.ndarray:
    """[G] int: the denominators of `conditional_acceptance` (rounds that reached position k),
    so plots can tell a measured rate from one resting on a handful of rounds."""
    accepted, length = np.asarray(accepted), np.asarray(length)
    return np.asarray([int(np.sum((accepted >= k - 1) & (length >= k))) for k in range(1, G + 1)], np.int64)


def tau_by_group(accepted, rounds, groups, seed: int = 0) -> dict:
    """{label: {"tau", "ci95", "prompts"}} over the requests of each group label (in first-seen order)."""
    acc, rnd, g = np.asarray(accepted), np.asarray(rounds), np.asarray(groups)
    if not (len(acc) == len(rnd) == len(g)):
        raise ValueError(f"one group label per request needed: {len(g)} labels for {len(acc)} requests")
    out = {}
    for label in dict.fromkeys(g.tolist()):
        m = g == label
        t, lo, hi = bootstrap_tau(acc[m], rnd[m], seed=seed)
        out[label] = {"tau": t, "ci95": [lo, hi], "prompts": int(m.sum())}
    return out


def threshold_sweep(conf_logits, accepted, temps=None, thresholds=THRESHOLDS) -> list[dict]:
    """Static thresholds on prefix survival, replayed exactly on full-gamma rounds: a round
    verifying l drafts accepts min(k, l) of them when k were accepted at full gamma."""

    a = survival(conf_logits, temps)
    acc = np.asarray(accepted)
    rows = []
    for th in thresholds:
        l = np.sum(np.cumprod(a >= th, axis=1), axis=1)
        got = np.minimum(acc, l)
        rows.append({"threshold": float(th), "verified_per_round": float(l.mean()),
                     "accepted_share": float(got.sum() / max(l.sum(), 1)), "tau": float((got + 1).mean())})
    return rows


def acceptance_by_position(traces: dict, gamma: int, *, n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> dict:
    """Conditional acceptance per draft position k = 1..gamma pooled over every round of every
    request (`Traces.arrays()`: "request", "accepted", "length"), and its `level` bootstrap interval
    over requests. Keys: "position", "rate", "lo", "hi" (nan where no round reached k), "rounds"
    (rounds that reached k: the denominators), "requests". Rounds cut short by a stop token or the
    token budget ("cut") are left out, as in `eval.evaluate`."""
    req, acc, length = (np.asarray(traces[k]) for k in ("request", "accepted", "length"))
    if "cut" in traces:  # rounds cut by a stop token or max_new discarded drafts: not rejections
        keep = ~np.asarray(traces["cut"], bool)
        req, acc, length = req[keep], acc[keep], length[keep]
    ids, inv = np.unique(req, return_inverse=True)
    ks = np.arange(1, gamma + 1)
    num = np.zeros((len(ids), gamma))
    den = np.zeros((len(ids), gamma))
    np.add.at(num, inv, (acc[:, None] >= ks).astype(float))
    np.add.at(den, inv, ((acc[:, None] >= ks - 1) & (length[:, None] >= ks)).astype(float))
    tot_n, tot_d = num.sum(0), den.sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        rate = np.where(tot_d > 0, tot_n / np.maximum(tot_d, 1), np.nan)
        lo = hi = np.full(gamma, np.nan)
        if len(ids) > 1:
            rng = np.random.default_rng(seed)
            w = rng.multinomial(len(ids), np.full(len(ids), 1 / len(ids)), size=n_boot).astype(float)
            bn, bd = w @ num, w @ den
            boot = np.where(bd > 0, bn / np.maximum(bd, 1), np.nan)
            q = (1 - level) / 2
            ok = ~np.isnan(boot).all(0)
            lo, hi = np.full(gamma, np.nan), np.full(gamma, np.nan)
            if ok.any():
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    lo[ok] = np.nanquantile(boot[:, ok], q, axis=0)
                    hi[ok] = np.nanquantile(boot[:, ok], 1 - q, axis=0)
    return {"position": ks.tolist(), "rate": rate.tolist(), "lo": lo.tolist(), "hi": hi.tolist(),
            "rounds": tot_d.astype(int).tolist(), "requests": len(ids)}


def fixed_length_sweep(accepted, gamma: int) -> list[dict]:
    """Fixed verification lengths 1..gamma, replayed exactly on full-gamma rounds as the threshold
    sweep is: a round verifying l drafts accepts min(k, l) of them. The frontier a confidence
    schedule must beat: fewer tokens verified per round at the same tau (docs/method.md, §5)."""
    acc = np.asarray(accepted)
    return [{"length": l, "verified_per_round": float(l), "tau": float((np.minimum(acc, l) + 1).mean())}
            for l in range(1, gamma + 1)]


def fixed_verified_at(tau: float, fixed: list[dict]) -> float:
    """Tokens verified per round by fixed lengths reaching `tau`: between two lengths, a mixture of
    their rounds (tau and verified tokens both interpolate linearly); beyond the longest, nan."""
    taus = np.array([r["tau"] for r in fixed])
    lengths = np.array([r["verified_per_round"] for r in fixed])
    if tau > taus[-1] + 1e-12:
        return float("nan")
    # tau is non-decreasing in the length; flat stretches keep the shortest length that reaches it
    taus = np.concatenate([[1.0], taus])
    lengths = np.concatenate([[0.0], lengths])
    i = int(np.searchsorted(taus, tau, side="left"))
    if i == 0:
        return 0.0
    lo, hi = taus[i - 1], taus[i]
    w = 0.0 if hi == lo else (tau - lo) / (hi - lo)
    return float(lengths[i - 1] + w * (lengths[i] - lengths[i - 1]))
