"""The evaluation command: metrics against hand-computed values, the report, bad input."""

import json

import numpy as np
import pytest

from dspark_jax.commands.eval import main
from dspark_jax.eval.evaluate import sts_before_after


def _overconfident_traces(n_req=80, rounds=12, G=4, seed=0):
    """Engine-style trace arrays whose confidence logits are 4x too sharp (STS should cool them)."""
    rng = np.random.default_rng(seed)
    logit = rng.normal(0.3, 1.2, (n_req * rounds, G))
    c = 1 / (1 + np.exp(-logit))
    ok = rng.random(c.shape) < c
    acc = np.where(ok.all(1), G, np.argmin(ok, 1))
    full = rng.random(len(acc)) < 0.9
    return {"conf_logits": 4.0 * logit, "accepted": np.where(full, acc, np.minimum(acc, 2)),
            "length": np.where(full, G, 2), "full": full, "request": np.repeat(np.arange(n_req), rounds),
            "round": np.tile(np.arange(rounds), n_req)}


def test_sts_before_after_measures_on_the_held_out_half():
    from dspark_jax.calibration.calibrate import split_by_request
    from dspark_jax.calibration.sts import calibration_report, fit_sts
    from dspark_jax.calibration.traces import from_engine

    tr = _overconfident_traces()
    out = sts_before_after(tr, drafter_kind="dspark", sampling=(1.0, 0, 1.0), seed=3)
    full = from_engine(tr, drafter_kind="dspark").full_gamma()
    fit, held = split_by_request(full, 0.5, 3)
    assert not set(fit.request) & set(held.request)  # split by request, not by round
    assert (out["n_fit"], out["n_heldout"]) == (len(fit), len(held)) and out["n_rounds"] == int(tr["full"].sum())
    temps = fit_sts(fit.conf_logits, fit.accepted)
    np.testing.assert_allclose(out["temperatures"], temps)
    on_held = calibration_report(held.conf_logits, held.accepted, temps)
    on_fit = calibration_report(fit.conf_logits, fit.accepted, temps)
    np.testing.assert_allclose(out["report"]["ece_after"], on_held["ece_after"])
    assert not np.allclose(out["report"]["ece_after"], on_fit["ece_after"])  # really the other half
    assert np.all(np.asarray(temps) > 1.5)  # over-sharp logits are cooled
    assert out["ece_after_mean"] < 0.5 * out["ece_before_mean"]
    assert out["ece_after_mean"] == pytest.approx(np.mean(on_held["ece_after"]))
    np.testing.assert_allclose(out["prefix_rate"], (held.accepted[:, None] > np.arange(4)).mean(0))
    from dspark_jax.calibration.sts import sigmoid

    np.testing.assert_allclose(out["mean_survival_after"],
                               np.cumprod(sigmoid(held.conf_logits / temps[None]), axis=1).mean(0), rtol=1e-6)


def test_sts_before_after_too_few_rounds_says_why():
    tr = {k: v[:30] for k, v in _overconfident_traces().items()}
    out = sts_before_after(tr, drafter_kind="dspark", sampling=(1.0, 0, 1.0))
    assert set(out) == {"error"} and "need >= 50" in out["error"]


def test_report_end_to_end(embedded_tiny_dir, tiny_dspark_drafter_dir, tmp_path):
    rc = main(["--target", str(embedded_tiny_dir), "--drafter", f"mine={tiny_dspark_drafter_dir}", "--num-prompts", "6",
               "--max-new-tokens", "8", "--out", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "results.json").read_text())["results"]
    assert set(res) == {"code", "math", "prose"}
    r = res["math"]["mine"]
    assert 1.0 <= r["tau"] <= 5.0 and r["ci95"][0] <= r["tau"] <= r["ci95"][1]
    assert len(r["conditional_acceptance"]) == 4 and "threshold_sweep" in r
    assert len(r["conditional_support"]) == 4 and r["conditional_support"][0] >= r["conditional_support"][-1]
    sp = r["sts_split"]  # fitted on half of the requests, or the reason it could not be
    if "error" in sp:
        assert "full gamma" in sp["error"]
    else:
        assert sp["n_fit"] + sp["n_heldout"] == sp["n_rounds"] and len(sp["report"]["ece_after"]) == 4
    assert "STS before / after" in (tmp_path / "report.md").read_text()
    meta = json.loads((tmp_path / "results.json").read_text())["meta"]
    assert meta["drafters"]["mine"]["kind"] == "dspark" and meta["drafters"]["mine"]["gamma"] == 4
    assert meta["sets"]["code"]["stdlib_heldout"] == 6
    assert (tmp_path / "report.md").read_text().startswith("# Drafter evaluation")
    assert (tmp_path / "tau.png").stat().st_size > 1000


def test_bad_prompts_file_names_the_line(embedded_tiny_dir, tiny_dspark_drafter_dir, tmp_path, capsys):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"turns": ["hi"]}\n{"turn": ["oops"]}\n')
    rc = main(["--target", str(embedded_tiny_dir), "--drafter", str(tiny_dspark_drafter_dir), "--prompts", str(bad),
               "--out", str(tmp_path / "o")])
    assert rc == 2 and ":2:" in capsys.readouterr().err
    notjson = tmp_path / "q.jsonl"
    notjson.write_text("turns: [a]\n")
    rc = main(["--target", str(embedded_tiny_dir), "--drafter", str(tiny_dspark_drafter_dir), "--prompts", str(notjson),
               "--out", str(tmp_path / "o")])
    assert rc == 2 and ":1:" in capsys.readouterr().err


def test_missing_prompt_set(embedded_tiny_dir, tiny_dspark_drafter_dir, tmp_path, capsys):
    rc = main(["--target", str(embedded_tiny_dir), "--drafter", str(tiny_dspark_drafter_dir), "--prompts",
               str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o")])
    assert rc == 2 and "does not exist" in capsys.readouterr().err


def test_drafter_for_another_target(embedded_tiny_dir, tiny_dspark_drafter_dir, tmp_path, capsys):
    rc = main(["--target", str(embedded_tiny_dir), "--drafter", str(tiny_dspark_drafter_dir), "--drafter",
               str(_foreign_drafter(tmp_path)), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "different target" in err


def _foreign_drafter(tmp_path):
    """A drafter saved for a random micro target (another vocabulary and fingerprint)."""
    from flax import nnx

    from dspark_jax.config import from_cli
    from dspark_jax.drafter import registry
    from dspark_jax.drafter.frozen import attach_target
    from dspark_jax.io import drafter_dir as drafter_io
    from dspark_jax.parallel.sharding import create_model
    from dspark_jax.target import TargetModel

    cfg = from_cli(["micro"])
    t = create_model(lambda: TargetModel(cfg.target.model, rngs=nnx.Rngs(0)))
    d = create_model(lambda: registry.build(cfg.target.model, cfg.drafter, rngs=nnx.Rngs(1)))
    attach_target(d, t)
    out = tmp_path / "foreign"
    drafter_io.save(d, out)
    return out


def test_forced_mode_reports_what_the_engine_reports_at_t0(embedded_tiny_dir, tiny_dspark_drafter_dir, tmp_path):
    """`--mode forced` (the default at temperature 0) against `--mode engine` on the embedded target:
    the same tau, intervals, conditional acceptance and round count per set."""
    args = ["--target", str(embedded_tiny_dir), "--drafter", f"mine={tiny_dspark_drafter_dir}", "--num-prompts", "4",
            "--max-new-tokens", "12", "--temperature", "0"]
    assert main(args + ["--out", str(tmp_path / "f")]) == 0
    assert main(args + ["--mode", "engine", "--out", str(tmp_path / "e")]) == 0
    f, e = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("f", "e"))
    assert f["meta"]["mode"] == "forced" and e["meta"]["mode"] == "engine"
    for s in ("code", "math", "prose"):
        rf, re_ = f["results"][s]["mine"], e["results"][s]["mine"]
        assert rf["mode"] == "forced" and re_["mode"] == "engine"
        for k in ("tau", "ci95", "rounds", "prompts", "conditional_support"):
            assert rf[k] == re_[k], (s, k)
        np.testing.assert_allclose(rf["conditional_acceptance"], re_["conditional_acceptance"])
    assert "teacher forcing along the target's greedy continuation" in (tmp_path / "f" / "report.md").read_text()
    # where the time went, per set and part: the forced run's three parts, the engine run's drafter
    assert {k for v in f["meta"]["seconds"].values() for k in v} == {"continuations", "forced pass", "summaries"}
    assert all(x >= 0 for v in f["meta"]["seconds"].values() for x in v.values())
    assert set(e["meta"]["seconds"]["code"]) == {"engine mine"}


def test_forced_mode_at_t1_says_it_reports_an_expectation(embedded_tiny_dir, tiny_dspark_drafter_dir, tmp_path,
                                                          capsys):
    rc = main(["--target", str(embedded_tiny_dir), "--drafter", f"mine={tiny_dspark_drafter_dir}", "--num-prompts",
               "3", "--max-new-tokens", "10", "--mode", "forced", "--engine-check", "2", "--out", str(tmp_path)])
    assert rc == 0
    assert "EXPECTED accepted length" in capsys.readouterr().err
    res = json.loads((tmp_path / "results.json").read_text())["results"]
    r = res["math"]["mine"]
    assert r["mode"] == "forced-expected" and 1.0 <= r["tau"] <= 5.0
    # one engine run for every set's first prompts, split back per set
    assert {s: res[s]["mine"]["engine_check"]["prompts"] for s in res} == {"code": 2, "math": 2, "prose": 2}
    assert all(1.0 <= res[s]["mine"]["engine_check"]["tau"] <= 5.0 for s in res)
    assert "engine check" in (tmp_path / "report.md").read_text()
    secs = json.loads((tmp_path / "results.json").read_text())["meta"]["seconds"]
    assert set(secs["math"]) == {"continuations", "forced pass"} and "engine check mine" in secs
