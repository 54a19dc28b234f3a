import numpy as np
import pytest

from dspark_jax.calibration.sts import brier, calibration_report, default_grid, ece, fit_sts, roc_auc, sigmoid


def ref_ece(p, y, n_bins):
    tot = 0.0
    for b in range(n_bins):
        lo, hi = b / n_bins, (b + 1) / n_bins
        m = (p >= lo) & ((p < hi) if b < n_bins - 1 else (p <= hi))
        if m.any():
            tot += m.sum() / len(p) * abs(p[m].mean() - y[m].mean())
    return tot


def ref_auc(s, y):
    pos, neg = s[y == 1], s[y == 0]
    return ((pos[:, None] > neg[None]).sum() + 0.5 * (pos[:, None] == neg[None]).sum()) / (len(pos) * len(neg))


def test_metrics_match_reference():
    rng = np.random.default_rng(0)
    p = np.r_[rng.random(500), [0.0, 1.0, 0.05, 0.5]]
    y = (rng.random(p.size) < p ** 1.5).astype(float)
    for nb in (1, 7, 20):
        assert ece(p, y, nb) == pytest.approx(ref_ece(p, y, nb), abs=1e-12)
    s = np.round(rng.normal(size=400), 1)  # ties
    ys = (rng.random(400) < sigmoid(s)).astype(int)
    assert roc_auc(s, ys) == pytest.approx(ref_auc(s, ys), abs=1e-12)
    assert np.isnan(roc_auc(s, np.ones(400)))
    assert brier(p, y) == pytest.approx(np.mean((p - y) ** 2))
    g = default_grid()
    assert len(g) == 257 and g[0] == pytest.approx(0.05) and g[-1] == pytest.approx(20.0) and 1.0 in g


def simulate(rng, n, scales, mu=1.0, sd=1.5):
    """True conditional acceptance logit of slot j is z_j / scales[j]; rounds at full gamma."""
    G = len(scales)
    zt = rng.normal(mu, sd, (n, G))
    z = zt * np.asarray(scales)[None]
    acc_j = rng.random((n, G)) < sigmoid(zt)
    accepted = np.cumprod(acc_j, axis=1).sum(1)
    return z, accepted


def test_sts_fixes_known_miscalibration_and_keeps_ranking():
    rng = np.random.default_rng(1)
    scales = [2.5, 2.5, 0.5, 2.5]
    z_tr, a_tr = simulate(rng, 20000, scales)
    z_te, a_te = simulate(rng, 20000, scales)
    temps = fit_sts(z_tr, a_tr)
    np.testing.assert_allclose(temps, scales, rtol=0.2)
    rep = calibration_report(z_te, a_te, temps)
    for j in range(len(scales)):
        assert rep["ece_after"][j] < rep["ece_before"][j] and rep["ece_after"][j] < 0.02, rep
        assert rep["brier_after"][j] <= rep["brier_before"][j] + 1e-9
        assert rep["auc_after"][j] == pytest.approx(rep["auc_before"][j])  # ranking at one position kept
        assert 0.6 < rep["auc_after"][j] < 1.0
        c_before, c_after = sigmoid(z_te[:, j]), sigmoid(z_te[:, j] / temps[j])
        assert np.array_equal(np.argsort(c_before, kind="stable"), np.argsort(c_after, kind="stable"))
    # sequential: a fit of c_j alone against the conditional label would not use the prefix product;
    # here the fitted T_j minimises the ECE of the CUMULATIVE survival, so no grid value does better
    a_prev = np.cumprod(sigmoid(z_tr[:, :1] / temps[0]), 1)[:, -1]
    y1 = (a_tr > 1).astype(float)
    best = ece(a_prev * sigmoid(z_tr[:, 1] / temps[1]), y1)
    assert all(best <= ece(a_prev * sigmoid(z_tr[:, 1] / t), y1) + 1e-12 for t in default_grid())


def test_survival_and_prefix_labels_by_hand():
    from dspark_jax.calibration.sts import prefix_labels, survival

    z = np.array([[0.0, 0.0], [np.log(3.0), -np.log(3.0)]])  # sigmoid: [.5, .5] and [.75, .25]
    np.testing.assert_allclose(survival(z), [[0.5, 0.25], [0.75, 0.1875]])
    np.testing.assert_allclose(survival(z, [1.0, 1e9]), [[0.5, 0.25], [0.75, 0.375]])  # T -> inf: c_2 -> 1/2
    np.testing.assert_array_equal(prefix_labels([0, 1, 2], 2), [[0, 0], [1, 0], [1, 1]])
