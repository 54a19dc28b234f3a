"""Numpy references shared by the sampling / rejection / scheduler tests (float64, loops)."""

from __future__ import annotations

import itertools
import math

import numpy as np


# ---------------------------------------------------------------- sampling transforms
def ref_sampling_probs(logits, temperature, top_k, top_p):
    """One row: temperature -> top-k (ties: lower index) -> top-p (stable order) -> renorm."""
    x = np.asarray(logits, np.float64)
    V = x.size
    if temperature <= 0:
        out = np.zeros(V)
        out[int(np.argmax(x))] = 1.0
        return out
    s = x / temperature
    order = sorted(range(V), key=lambda i: (-s[i], i))
    kept = order[:top_k] if 0 < top_k < V else order
    pr = np.zeros(V)
    m = max(s[i] for i in kept)
    for i in kept:
        pr[i] = math.exp(s[i] - m)
    pr /= pr.sum()
    if top_p < 1.0:
        keep, mass = [], 0.0
        for i in kept:  # kept is in stable descending order
            if mass >= top_p and keep:
                break
            keep.append(i)
            mass += pr[i]
        out = np.zeros(V)
        out[keep] = pr[keep]
        pr = out / out.sum()
    return pr


# ---------------------------------------------------------------- chi-square
def chi2_sf(x, df):
    """Upper tail of chi-square (Wilson-Hilferty; accurate to a few % of p for df >= 3)."""
    if df <= 0:
        return 1.0
    z = ((x / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def chi2_test(counts, probs, min_expected=5.0):
    """Pearson chi-square of counts vs probs; cells with expected < min_expected are pooled.
    Observations in zero-probability cells give p-value 0. Returns (stat, df, p_value)."""
    counts = np.asarray(counts, np.float64).ravel()
    probs = np.asarray(probs, np.float64).ravel()
    n = counts.sum()
    if np.any(counts[probs <= 0] > 0):
        return np.inf, 0, 0.0
    exp = probs * n
    big = exp >= min_expected
    obs_c = list(counts[big]) + [counts[~big & (probs > 0)].sum()]
    exp_c = list(exp[big]) + [exp[~big & (probs > 0)].sum()]
    obs_c, exp_c = np.array(obs_c), np.array(exp_c)
    keep = exp_c > 0
    stat = float(np.sum((obs_c[keep] - exp_c[keep]) ** 2 / exp_c[keep]))
    df = int(keep.sum()) - 1
    return stat, df, chi2_sf(stat, df)


# ---------------------------------------------------------------- rejection sampling law
def verify_law(d, q_rows, p_rows, length, q_verify_rows=None, residual=True):
    """Exact law of one row's verification: list of (prob, out_tokens tuple).

    d: drafts (len G); q_rows[j]: distribution d_j was sampled from; p_rows[j], j = 0..G.
    q_verify_rows: what the verifier believes q is (default q_rows; broken variant (b)).
    residual=False: broken variant (a), sample the correction from p_j."""
    qv = q_rows if q_verify_rows is None else q_verify_rows
    out, pref = [], 1.0
    for j in range(length + 1):
        if j == length:  # all accepted: bonus
            for v, pv in enumerate(p_rows[j]):
                if pv > 0:
                    out.append((pref * pv, tuple(d[:j]) + (v,)))
            break
        pj, qj = np.asarray(p_rows[j], np.float64), np.asarray(qv[j], np.float64)
        alpha = 1.0 if qj[d[j]] <= 0 else min(1.0, pj[d[j]] / qj[d[j]])
        if alpha < 1.0:
            if residual:
                res = np.maximum(pj - qj, 0.0)
                res = res / res.sum() if res.sum() > 0 else pj / pj.sum()
            else:
                res = pj / pj.sum()
            for v, rv in enumerate(res):
                if rv > 0:
                    out.append((pref * (1 - alpha) * rv, tuple(d[:j]) + (v,)))
        pref *= alpha
        if pref == 0:
            break
    return out


def extend_with_target(tokens, n_tokens, target_cond):
    """Law of the first n_tokens when the output so far is `tokens` and the rest is sampled
    from the target: list of (prob, tuple). target_cond(prefix_tuple) -> probs."""
    tokens = tuple(tokens[:n_tokens])
    if len(tokens) == n_tokens:
        return [(1.0, tokens)]
    out = []
    for v, pv in enumerate(target_cond(tokens)):
        if pv > 0:
            for pr, t in extend_with_target(tokens + (v,), n_tokens, target_cond):
                out.append((pv * pr, t))
    return out


def target_law(n_tokens, V, target_cond):
    law = np.zeros((V,) * n_tokens)
    for pr, t in extend_with_target((), n_tokens, target_cond):
        law[t] += pr
    return law


def all_seqs(V, n):
    return list(itertools.product(range(V), repeat=n))
