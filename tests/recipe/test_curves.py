"""Held-out tau against steps from the runs' logs (recipe/curves.py)."""

import json

from dspark_jax.recipe.curves import curve_table, plot_curves, training_curves


def _log(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_curves_keep_the_last_record_of_a_step_and_skip_missing_runs(tmp_path):
    key = "eval/expected_accepted_length"
    _log(tmp_path / "dspark" / "log.jsonl", [
        {"step": 10, "loss": 3.0},
        {"step": 50, key: 1.20, f"{key}_ci95": [1.1, 1.3]},
        {"step": 100, key: 1.30, f"{key}_ci95": [1.2, 1.4]},
        {"step": 100, key: 1.35, f"{key}_ci95": [1.25, 1.45]},  # a resumed run evaluated step 100 again
    ])
    _log(tmp_path / "dflash" / "log.jsonl", [{"step": 100, key: 1.25, f"{key}_ci95": [1.2, 1.3]}])
    curves = training_curves(tmp_path, ["dspark", "dflash", "eagle3"])
    assert list(curves) == ["dspark", "dflash"]
    assert curves["dspark"] == [(50, 1.2, 1.1, 1.3), (100, 1.35, 1.25, 1.45)]
    rows = curve_table(curves)
    assert rows[0] == "| step | dspark | dflash | dspark / dflash |"
    assert rows[2] == "| 50 | 1.200 [1.100, 1.300] | - | - |"
    assert rows[3] == f"| 100 | 1.350 [1.250, 1.450] | 1.250 [1.200, 1.300] | {1.35 / 1.25:.3f} |"
    assert plot_curves(curves, tmp_path / "c.png").stat().st_size > 5000
    assert plot_curves({}, tmp_path / "none.png") is None and curve_table({}) == []
