"""`python -m dspark_jax recipe embedded-study` end to end at toy scale on the tiny embedded target:
every stage runs, the report holds both temperatures with seed-and-prompt intervals, a rerun does no
work, the docs rendering keeps the page's own text; bad input is one clear error."""

import json

import numpy as np
import pytest

from dspark_jax.commands import study as study_command
from dspark_jax.recipe import study as study_mod
from dspark_jax.recipe.run import RecipeError
from dspark_jax.recipe.study import Study, confidence_judgement, render_docs, run_study

TOY = ("data.num_anchors=8", "train.anchor_chunk=8", "train.batch_size=4", "train.steps=2", "train.eval_every=1",
       "train.eval_batches=1", "train.checkpoint_every=0", "drafter.num_layers=1", "drafter.gamma=4",
       "drafter.markov_rank=16", "drafter.target_layer_ids=[1,3,5]", "train.measure_prompts=0")


def test_study_runs_end_to_end_then_resumes_without_work(embedded_tiny_dir, tmp_path, monkeypatch):
    st = Study(variants=("dspark", "dflash"), seeds=(0, 1), num_train_prompts=8, num_heldout_prompts=2,
               regen_max_new_tokens=16, regen_max_prompt_len=72, seq_len=96, eval_max_new_tokens=8,
               samplings=((1.0, 1.0, 0), (0.0, 1.0, 0), (0.7, 0.8, 20)), train=TOY)
    out = tmp_path / "study"
    s = run_study(st, out, embedded_tiny_dir, echo=False)
    assert list(s["eval"]) == ["1", "0", "0.7, top-p 0.8, top-k 20"]
    for t in s["eval"]:
        per = s["eval"][t]
        assert set(per) == {"dspark", "dflash"}
        for r in per.values():
            assert r["seeds"] == [0, 1] and r["prompts"] == 2 and len(r["acceptance_per_position"]) == 4
            assert r["ci95"][0] <= r["tau"] <= r["ci95"][1] and r["tau"] >= 1.0
        assert "vs_dflash" in per["dspark"] and "vs_dflash" not in per["dflash"]
    results = json.loads((out / "eval" / "T1_s0-1" / "results.json").read_text())
    assert results["meta"]["mode"] == "engine" and results["meta"]["temperature"] == 1.0
    assert set(results["meta"]["drafters"]) == {"dspark_s0", "dflash_s0", "dspark_s1", "dflash_s1"}
    assert json.loads((out / "eval" / "T0_s0-1" / "results.json").read_text())["meta"]["mode"] == "forced"
    meta = json.loads((out / "eval" / "T0.7-p0.8-k20_s0-1" / "results.json").read_text())["meta"]
    assert (meta["mode"], meta["temperature"], meta["top_p"], meta["top_k"]) == ("engine", 0.7, 0.8, 20)
    (nd,), (nf,) = s["train"]["dspark"]["trainable_params"], s["train"]["dflash"]["trainable_params"]
    assert nd - nf == 2 * 1024 * 16 + (64 + 16 + 1)  # the Markov head (W1, W2: vocabulary x rank), the confidence head
    assert [p["step"] for p in s["curves"]["dspark"]] == [1, 2]
    assert all(set(p["seeds"]) == {0, 1} for p in s["curves"]["dflash"])
    report = (out / "report.md").read_text()
    assert "## tau at T = 1: engine-sampled rounds" in report and "## tau at T = 0: exact greedy" in report
    assert "## tau at T = 0.7, top-p 0.8, top-k 20: engine-sampled rounds" in report
    assert "- T = 0.7, top-p 0.8, top-k 20 (sampled): DFlash tau" in report
    assert f"| {nd / 1e6:.2f} M |" in report and "## Answer" in report
    for t in s["eval"]:  # the confidence head judged for DSpark, which has one; DFlash has none
        j = s["eval"][t]["dspark"]["confidence"]
        assert "confidence" not in s["eval"][t]["dflash"] and j["seeds"] == 2
        for r in j["sweep"]:
            assert 1.0 <= r["tau"] <= 5.0 and 0 <= r["verified_per_round"] <= 4
            # fixed lengths verify at most gamma, and reach tau 1 with none
            assert np.isnan(r["fixed_verified_per_round"]) or 0 <= r["fixed_verified_per_round"] <= 4
        assert j["sweep"][0]["threshold"] == 0.0 and j["sweep"][0]["verified_per_round"] == 4  # no threshold: full
    assert "## The confidence head at T = 1: calibration and tokens verified at equal tau" in report
    for t in s["eval"]:  # position 1 per seed: what the variants' first-position means are made of
        for r in s["eval"][t].values():
            assert len(r["position1_per_seed"]) == 2
            assert np.isclose(np.nanmean(r["position1_per_seed"]), r["acceptance_per_position"][0], equal_nan=True)
    assert "## Position 1: acceptance of the first draft" in report
    assert (out / "study.png").is_file()

    docs = tmp_path / "study.md"
    docs.write_text("# Study\n\nPhase 1 notes stay.\n")
    render_docs(out, docs)
    render_docs(out, docs)  # idempotent: the block is replaced, not appended again
    text = docs.read_text()
    assert text.startswith("# Study\n\nPhase 1 notes stay.") and text.count(study_mod.BEGIN) == 1
    assert "(study.png)" in (out / "report.md").read_text() and "](study.png)" in text and docs.with_suffix(
        ".png").is_file()

    def no_work(name, *a, **k):
        raise AssertionError(f"stage {name} ran again")

    monkeypatch.setattr(study_mod, "run_stage", no_work)
    again = run_study(st, out, embedded_tiny_dir, echo=False)
    assert json.dumps(again["eval"]) == json.dumps(s["eval"])


def test_bad_input_is_one_clear_error(tmp_path):
    with pytest.raises(RecipeError, match="unknown variant.*dspark"):
        Study(variants=("dspark", "medusa"))
    with pytest.raises(RecipeError, match="seeds repeat"):
        Study(seeds=(0, 0))
    with pytest.raises(RecipeError, match="top-p 1.5.*0 < top-p <= 1"):
        Study(samplings=((0.7, 1.5, 20),))
    assert study_command._sampling("0.7/0.8/20") == (0.7, 0.8, 20) and study_command._sampling("1") == (1.0, 1.0, 0)
    with pytest.raises(SystemExit) as exit_:
        study_command.main(["--out", str(tmp_path / "o"), "--eval-sampling", "1/0.8"])
    assert exit_.value.code == 2
    assert study_command.main(["--out", str(tmp_path / "o"), "--variants", "eagle"]) == 2
    held = tmp_path / "s" / "data" / "heldout"
    held.mkdir(parents=True)
    (held / "meta.json").write_text(json.dumps({"count": 5}))
    with pytest.raises(RecipeError, match="holds 5 regenerated records.*asks for 2.*new --out"):
        run_study(Study(num_heldout_prompts=2, num_train_prompts=3), tmp_path / "s", tmp_path,
                  stages=("prompts", "regen"), echo=False)


def test_confidence_judgement_averages_seeds_and_prices_fixed_lengths_at_equal_tau():
    """Seed 0: thresholds give tau 2.5 verifying 1.5 (fixed lengths need 2.0 for tau 2.5); seed 1:
    tau 2.0 verifying 1.0 (fixed lengths need 1.0). The means: tau 2.25, 1.25 verified, 1.5 fixed."""
    fixed = [{"length": n, "verified_per_round": float(n), "tau": 1.5 + n / 2} for n in (1, 2, 3)]
    sts = {"auc_before_mean": 0.6, "auc_after_mean": 0.7, "ece_before_mean": 0.2, "ece_after_mean": 0.1}
    sweep = lambda tau, v: [{"threshold": 0.5, "tau": tau, "verified_per_round": v, "accepted_share": (tau - 1) / v}]
    seeds = [{"threshold_sweep": sweep(2.5, 1.5), "fixed_length_sweep": fixed, "sts_split": sts},
             {"threshold_sweep": sweep(2.0, 1.0), "fixed_length_sweep": fixed, "sts_split": {"error": "too few"}},
             {"per_request": {}}]  # a drafter without a confidence head is left out
    j = confidence_judgement(seeds)
    assert j["seeds"] == 2 and j["auc_before_mean"] == 0.6 and j["ece_after_mean"] == 0.1
    assert j["sweep"] == [{"threshold": 0.5, "tau": 2.25, "verified_per_round": 1.25, "fixed_verified_per_round": 1.5,
                           "accepted_share": 1.0}]
    assert confidence_judgement([{"per_request": {}}]) is None
