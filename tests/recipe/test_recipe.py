"""`python -m dspark_jax recipe`: every stage runs on the tiny embedded target, a rerun skips them all,
the drafters share one regeneration, and bad input or a failing stage is named."""

import json

import pytest

from dspark_jax.recipe import run as recipe_run
from dspark_jax.recipe.recipes import RECIPES, Recipe
from dspark_jax.recipe.run import RecipeError, run_recipe

SHRINK = ["train.resume=true", "data.num_prompts=24", "data.num_heldout_prompts=8", "data.regen_max_new_tokens=16",
          "data.regen_batch_size=8", "data.seq_len=96", "data.num_anchors=8", "train.anchor_chunk=8",
          "train.batch_size=4", "train.steps=4", "train.eval_batches=1", "train.checkpoint_every=0",
          "drafter.num_layers=1", "drafter.gamma=4", "drafter.markov_rank=16", "drafter.target_layer_ids=[1,3,5]",
          "train.measure_prompts=2", "train.measure_max_new_tokens=8"]
TINY = Recipe(name="tiny", model=None, kinds={"dspark": (None, ()), "dflash": (None, ("drafter.kind=dflash",))},
              eval_sets=("math", "code"), speed_set="math", eval_temperatures=(0.0,), speed_temperatures=(0.0,))


@pytest.fixture()
def eval_dir(tmp_path):
    d = tmp_path / "sets"
    d.mkdir()
    qs = {"math": ["What is 7 * 8?", "Compute 12 + 30.", "Tom has 3 apples and buys 4 more. How many?"],
          "code": ["Write a Python function that reverses a list.", "Explain what `len` does.", "Sort [3, 1, 2]."]}
    for name, items in qs.items():
        (d / f"{name}.jsonl").write_text("".join(json.dumps({"turns": [q]}) + "\n" for q in items))
    return d


def test_recipe_runs_every_stage_then_resumes_without_work(embedded_tiny_dir, eval_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_JAX_CACHE", str(tmp_path / "cache"))  # a cold regeneration cache
    out = tmp_path / "run"
    s = run_recipe(TINY, out, embedded_tiny_dir, overrides=SHRINK, eval_dir=eval_dir, num_eval_prompts=3,
                   eval_max_new_tokens=12, speed_prompts=2, speed_max_new_tokens=8, speed_repeats=1,
                   speed_batch_sizes=(1,), echo=False)
    assert set(s["train"]) == {"dspark", "dflash"} and all(t["heldout_tau"] >= 1.0 for t in s["train"].values())
    # one regeneration for both drafters: the second finds the first one's cache
    regen = {k: t["phases_s"].get("regeneration", 0.0) for k, t in s["train"].items()}
    assert regen["dflash"] < 0.2 * regen["dspark"], regen
    res = s["eval"]["0"]
    assert set(res) == {"math", "code"} and all(set(per) == {"dspark", "dflash"} for per in res.values())
    assert all(per[k]["tau"] >= 1.0 for per in res.values() for k in per)
    for k in ("dspark", "dflash"):
        sp = s["speed"][k]["0"]
        assert sp["speed_b1"]["drafter"] == k and sp["speed_b1"]["temperature"] == 0.0 and "speed_b8" not in sp
    # DSpark's speed stage also times the scheduled policy on a cost table measured at that T for these models
    assert "scheduled_speedup" in s["speed"]["dspark"]["0"]["speed_b1"]
    assert "scheduled_speedup" not in s["speed"]["dflash"]["0"]["speed_b1"]
    table = json.loads((out / "costs" / "dspark_r1_T0.json").read_text())
    assert table["measure"]["temperature"] == 0 and table["engine"]["num_slots"] == 1 and table["engine"]["gamma"] == 4
    report = (out / "report.md").read_text()
    assert "scheduled speedup" in report and "(tau " in report
    assert "dspark / dflash" in report and "| math |" in report and "| dflash | 0 | 1 |" in report
    assert json.loads((out / "summary.json").read_text())["recipe"] == "tiny"
    wall = s["wall_s"]  # every stage's wall time, summed over runs of the recipe
    assert wall["train dspark"] > 0 and wall["eval T=0"] > 0 and wall["total"] == pytest.approx(
        sum(v for k, v in wall.items() if k != "total"))
    assert "Wall clock:" in report and "forced" not in report.split("## Training")[0]
    assert "(exact greedy rounds, teacher forced)" in report

    def no_work(name, *a, **k):
        raise AssertionError(f"stage {name} ran again")

    monkeypatch.setattr(recipe_run, "run_stage", no_work)
    again = run_recipe(TINY, out, embedded_tiny_dir, overrides=SHRINK, eval_dir=eval_dir,
                       num_eval_prompts=3, echo=False)
    assert again["eval"] == s["eval"]


def test_missing_prompt_sets_are_named(tmp_path, embedded_tiny_dir):
    with pytest.raises(RecipeError, match=r"code\.jsonl.*--eval-dir"):
        run_recipe(TINY, tmp_path / "o", embedded_tiny_dir, eval_dir=tmp_path, echo=False)


def test_failing_stage_names_its_log(tmp_path, embedded_tiny_dir, eval_dir):
    with pytest.raises(RecipeError, match=r"stage 'train dspark' failed .*train_dspark\.log.*rerun"):
        run_recipe(TINY, tmp_path / "o", embedded_tiny_dir, overrides=["train.no_such_key=1"], eval_dir=eval_dir,
                   stages=("train",), echo=False)
    assert "no_such_key" in (tmp_path / "o" / "logs" / "train_dspark.log").read_text()
    assert not (tmp_path / "o" / "dspark" / "summary.json").exists()


def test_smollm2_recipe_names_its_sets_and_presets():
    r = RECIPES["smollm2-135m-instruct"]
    assert r.kinds["dspark"][0] == "smollm2_135m_dspark" and r.kinds["dflash"][0] == "smollm2_135m_dflash"
    from dspark_jax.config import from_cli

    a, b = from_cli(["smollm2_135m_dspark"]), from_cli(["smollm2_135m_dflash"])
    assert b.drafter.kind == "dflash" and a.data == b.data  # same data section: one shared regeneration
    assert a.data.features == "cache"  # ... and one feature cache for both trainings
    assert r.speed_temperatures == (0.0,) and r.eval_temperatures == (0.0, 1.0)
    assert {"gsm8k", "math500", "humaneval", "mbpp", "mt-bench"} <= set(r.eval_sets)


def test_overrides_may_follow_the_options(tmp_path, monkeypatch):
    """`recipe NAME --out D --stages train data.x=1` (overrides last) reaches the run like overrides
    first (argparse's plain parse_args rejects them as unrecognized)."""
    from dspark_jax.commands import recipe as cli
    from dspark_jax.recipe import run

    got = []
    monkeypatch.setattr(run, "run_recipe", lambda *a, **k: got.append(k["overrides"]))
    for argv in (["smollm2-135m-instruct", "data.num_prompts=4", "--out", str(tmp_path), "--target", str(tmp_path)],
                 ["smollm2-135m-instruct", "--out", str(tmp_path), "--target", str(tmp_path), "--stages", "train",
                  "data.num_prompts=4"]):
        assert cli.main(argv) == 0
    assert got == [["data.num_prompts=4"]] * 2


@pytest.mark.parametrize("measured, shown", [(None, "| - |"), (float("nan"), "| - |"), (1.2345, "| 1.234 |")])
def test_training_table_shows_a_dash_when_nothing_was_decoded(measured, shown):
    train = {"steps": 240, "heldout_tau": 1.36, "heldout_tau_ci95": [1.32, 1.40], "measured_tau": measured,
             "wall_s": 60.0, "phases_s": None}
    if measured is None:  # no held-out evaluation either
        train.update(heldout_tau=None, heldout_tau_ci95=None)
    s = {"recipe": "r", "notes": "", "target": "t", "kinds": ["dspark"], "train": {"dspark": train}, "eval": {},
         "speed": {}}
    row = next(line for line in recipe_run.report_markdown(s).splitlines() if line.startswith("| dspark | 240"))
    assert shown in row and "nan" not in row
    assert ("| 240 | - | - |" in row) == (measured is None)
