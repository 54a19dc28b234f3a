import json

import numpy as np
import pytest

from dspark_jax.calibration.calibrate import (
    CalibrationMissingError,
    calibrate_traces,
    load_temperatures,
    make_grid,
    save_temperatures,
    split_by_request,
)
from dspark_jax.calibration.traces import TraceSet, save_traces, synthetic_traces
from dspark_jax.commands.calibrate import main


@pytest.fixture(scope="module")
def synth():
    return synthetic_traces(128, 48, 4, seed=3, conf_scale=2.5, conf_noise=0.0)


def test_grid_configurable():
    g = make_grid()
    assert len(g) == 257 and g[0] == pytest.approx(0.05) and g[-1] == pytest.approx(20.0) and 1.0 in g
    g2 = make_grid(16, 0.3, 4.0)
    assert len(g2) == 17 and g2.min() == pytest.approx(0.3) and 1.0 in g2 and g2.max() == pytest.approx(4.0)
    with pytest.raises(ValueError, match="grid"):
        make_grid(8, 0.0, 1.0)


def test_fit_recovers_miscalibration_on_heldout(synth):
    res = calibrate_traces(synth, holdout=0.5)
    t = np.asarray(res["temperatures"])
    np.testing.assert_allclose(t, 2.5, rtol=0.25)  # z = 2.5 * true logit
    r = res["report"]
    for j in range(4):
        assert r["ece_after"][j] < 0.5 * r["ece_before"][j]
        assert r["brier_after"][j] < r["brier_before"][j]
        assert r["auc_after"][j] == pytest.approx(r["auc_before"][j])
    assert res["n_fit"] + res["n_heldout"] == len(synth) and res["n_heldout"] > 0


def test_split_by_request_keeps_requests_whole(synth):
    fit, held = split_by_request(synth, 0.25, seed=1)
    assert set(fit.request).isdisjoint(held.request) and len(fit) + len(held) == len(synth)


def test_censored_rounds_are_ignored(synth):
    n = len(synth)
    # add censored rounds (verified 1 token) with contradicting labels: they must not move the fit
    bad = TraceSet(np.full((n, 4), 5.0), np.zeros(n), np.ones(n), np.zeros(n, bool), synth.request, synth.round,
                   meta=synth.meta)
    from dspark_jax.calibration.traces import concat

    both = concat([synth, bad])
    assert calibrate_traces(both, holdout=0.5)["temperatures"] == calibrate_traces(synth, holdout=0.5)["temperatures"]
    with pytest.raises(ValueError, match="full gamma"):
        calibrate_traces(bad)


def test_save_load_and_missing(tmp_path, synth):
    d = tmp_path / "drafter"
    with pytest.raises(CalibrationMissingError, match="sts.json does not exist"):
        load_temperatures(d, {"temperature": 1.0})
    res = calibrate_traces(synth, holdout=0.0)
    save_temperatures(d, synth.sampling, res)
    t = load_temperatures(d, (1.0, 0, 1.0), gamma=4)
    assert t.dtype == np.float32 and t.shape == (4,)
    np.testing.assert_allclose(t, res["temperatures"], rtol=1e-6)
    with pytest.raises(CalibrationMissingError,
                       match=r"no STS temperatures for sampling T0.7_k20_p0.8 \(has: T1_k0_p1\)"):
        load_temperatures(d, {"temperature": 0.7, "top_k": 20, "top_p": 0.8})
    with pytest.raises(CalibrationMissingError, match="engine needs 7"):
        load_temperatures(d, "T1_k0_p1", gamma=7)
    # a second setting is added, the first kept
    save_temperatures(d, {"temperature": 0.7, "top_k": 20, "top_p": 0.8}, res)
    data = json.loads((d / "sts.json").read_text())
    assert set(data["settings"]) == {"T1_k0_p1", "T0.7_k20_p0.8"}
    with pytest.raises(ValueError, match="gamma"):
        save_temperatures(d, "T2_k0_p1", {**res, "temperatures": [1.0] * 3})


def test_cli_writes_temperatures_report_and_diagram(tmp_path):
    tr = synthetic_traces(40, 30, 3, seed=5, sampling={"temperature": 0.7, "top_k": 20, "top_p": 0.8})
    save_traces(tmp_path / "a.npz", tr)
    assert main(["--traces", str(tmp_path / "a.npz"), "--drafter", str(tmp_path / "d"), "--grid-size", "32",
                 "--bins", "10", "--out", str(tmp_path / "out")]) == 0
    t = load_temperatures(tmp_path / "d", tr.sampling, gamma=3)
    assert np.all(t > 1.0)  # over-confident synthetic logits => T > 1
    png = tmp_path / "out" / "reliability_T0.7_k20_p0.8.png"
    assert png.read_bytes()[:4] == b"\x89PNG"
    rep = json.loads((tmp_path / "out" / "calibration_report.json").read_text())
    assert rep["T0.7_k20_p0.8"]["grid"]["size"] == 33 and rep["T0.7_k20_p0.8"]["n_bins"] == 10


def test_report_table_extra_columns(synth):
    from dspark_jax.calibration.calibrate import report_table

    res = calibrate_traces(synth)
    G = len(res["temperatures"])
    lines = report_table(res, {"extra col": [0.5] * (G - 1) + [None]}).splitlines()
    assert len(lines) == 2 + G and lines[0].endswith("| AUC after | extra col |") and lines[1].count("---") == 9
    assert lines[2].endswith("| 0.500 |") and lines[-1].endswith("| n/a |")
    assert report_table(res).splitlines()[0].endswith("| AUC after |")


def test_missing_traces_are_one_line_and_flags_match_other_commands(tmp_path, capsys):
    from dspark_jax.commands.calibrate import main

    assert main(["--traces", str(tmp_path / "missing.npz"), "--drafter", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "missing.npz does not exist" in err and "Traceback" not in err


def test_sampling_of_a_trace_file_is_read_never_guessed(tmp_path, capsys):
    """A raw engine trace file records no sampling setting: calibrating it needs --sampling (an STS
    fit stored under a guessed temperature would be read by every run at that one); with it the fit
    lands under that key; a --sampling that contradicts a file's own setting is refused."""
    tr = synthetic_traces(40, 30, 3, seed=5)
    raw = tmp_path / "raw.npz"  # what `Traces.save(path.npz)` writes: arrays only, `length` not `verify_len`
    np.savez(raw, conf_logits=tr.conf_logits, length=tr.verify_len, accepted=tr.accepted, full=tr.full,
             request=tr.request, round=tr.round, cut=np.zeros(len(tr), bool))
    d = tmp_path / "d"
    assert main(["--traces", str(raw), "--drafter", str(d), "--grid-size", "16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "does not record the sampling setting" in err and "--sampling" in err
    assert not (d / "sts.json").exists()
    assert main(["--traces", str(raw), "--drafter", str(d), "--grid-size", "16", "--sampling", "0"]) == 0
    data = json.loads((d / "sts.json").read_text())
    assert set(data["settings"]) == {"T0_k0_p1"}
    recorded = tmp_path / "rec.npz"
    save_traces(recorded, synthetic_traces(40, 30, 3, seed=5, sampling={"temperature": 0.7, "top_k": 0, "top_p": 1.0}))
    assert main(["--traces", str(recorded), "--drafter", str(d), "--sampling", "0"]) == 2
    assert "records sampling T0.7_k0_p1 but --sampling says T0_k0_p1" in capsys.readouterr().err
    assert main(["--traces", str(raw), "--drafter", str(d), "--sampling", "0,x"]) == 2
    assert "give T or T,TOP_K,TOP_P" in capsys.readouterr().err
