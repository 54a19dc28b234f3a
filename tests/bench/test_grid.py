"""`python -m dspark_jax bench grid`: tables and plots from fake eval results, clear errors on bad dirs."""

import json

import pytest

from dspark_jax.commands.bench import grid
from dspark_jax.commands.bench import main as bench_main


def _result(tau, G, sts=True):
    r = {"tau": tau, "ci95": [tau - 0.05, tau + 0.05], "prompts": 200, "rounds": 3000,
         "conditional_acceptance": [0.5 - 0.02 * j for j in range(G)],
         "conditional_support": [400 // (j + 1) for j in range(G)],
         "by_source": {"stdlib_heldout": {"tau": tau + 0.1, "ci95": [tau, tau + 0.2], "prompts": 108},
                       "dependencies": {"tau": tau - 0.1, "ci95": [tau - 0.2, tau], "prompts": 92}}}
    if sts:
        r["sts_split"] = {"n_fit": 600, "n_heldout": 590, "n_rounds": 1190, "temperatures": [2.0] * G,
                          "ece_before_mean": 0.08, "ece_after_mean": 0.02, "brier_before_mean": 0.2,
                          "brier_after_mean": 0.15, "report": {"ece_before": [0.123] + [0.05] * (G - 1),
                                                              "ece_after": [0.0456] + [0.01] * (G - 1),
                                                              "auc_before": [0.7] * G, "auc_after": [0.7] * G}}
    return r


def _write(root, name, kind, G, depth, tau, with_meta=True):
    d = root / f"eval_{name}"
    d.mkdir(parents=True)
    meta = {"command": f"python -m dspark_jax eval --drafter {name}=/nowhere"}
    if with_meta:
        meta["drafters"] = {name: {"kind": kind, "gamma": G, "num_layers": depth, "confidence_head": kind == "dspark"}}
    res = {s: {name: _result(tau + off, G, sts=kind == "dspark")} for s, off in (("code", 0.2), ("math", 0.0))}
    (d / "results.json").write_text(json.dumps({"meta": meta, "results": res}))
    return d


@pytest.fixture()
def fake_grid(tmp_path):
    root = tmp_path / "evals"
    for kind, G, depth, tau in (("dspark", 4, 2, 1.8), ("dspark", 7, 2, 1.9), ("dflash", 7, 2, 1.6),
                                ("dspark", 7, 1, 1.7), ("dflash", 4, 2, 1.55), ("eagle3", 7, 1, 1.65)):
        name = f"{kind}_g{G}" + ("" if kind == "eagle3" else f"_d{depth}")
        _write(root, name, kind, G, depth, tau, with_meta=kind != "eagle3")  # eagle3: params from its name
    return root


def test_renders_tables_and_plots(fake_grid, tmp_path):
    out = tmp_path / "fig"
    assert bench_main(["grid", "--out", str(out), "--from", str(fake_grid)]) == 0
    md = (out / "grid.md").read_text()
    assert "| dspark_g7_d2 | dspark | 7 | 2 | 2.100 [2.050, 2.150] | 1.900 [1.850, 1.950] |" in md
    assert "| eagle3_g7 | eagle3 | 7 | ? |" in md  # no depth in the name and no metadata
    assert "code: dependencies" in md and "1.800 [1.700, 1.900] (n=92)" in md
    assert "| dspark_g4_d2 | code | 600 / 590 | 12.3 -> 4.6 | 8.0 -> 2.0 |" in md
    assert "dflash_g7_d2 | code" not in md  # no confidence head, no STS row
    summary = json.loads((out / "grid.json").read_text())
    assert [c["name"] for c in summary["cells"]][:3] == ["dspark_g4_d2", "dflash_g4_d2", "dspark_g7_d2"]
    assert summary["plots"] == ["conditional_acceptance.png", "tau_vs_gamma.png", "tau_vs_depth.png"]
    for p in summary["plots"]:
        assert (out / p).stat().st_size > 5000
    assert "![tau_vs_gamma.png](tau_vs_gamma.png)" in md and "--from" in md  # the command is recorded


def test_sweeps_pick_the_right_cells(fake_grid):
    cells = grid.sort_cells([grid.load_cell(p.name[5:], p) for p in sorted(fake_grid.iterdir())])
    rows = dict(grid.sweeps(cells))
    assert {c["name"] for c in rows["gamma sweep, depth 2"]} == {"dspark_g4_d2", "dspark_g7_d2", "dflash_g4_d2",
                                                                  "dflash_g7_d2"}
    assert {c["name"] for c in rows["depth sweep, gamma 7"]} == {"dspark_g7_d1", "dspark_g7_d2", "dflash_g7_d2"}
    assert {c["name"] for c in rows["kinds at gamma 7"]} == {"dspark_g7_d2", "dflash_g7_d2", "eagle3_g7"}


def test_explicit_cells_and_eval_cache(fake_grid, tmp_path, monkeypatch):
    """--drafter NAME=EVAL_DIR renders as is; NAME=DRAFTER_DIR uses a cached eval instead of re-running it."""
    drafter_dir = tmp_path / "trained"
    drafter_dir.mkdir()
    (drafter_dir / "drafter_config.json").write_text("{}")
    evals = tmp_path / "cache"
    _write(evals, "mine_g7_d2", "dspark", 7, 2, 2.0)
    import dspark_jax.commands.eval as ev

    monkeypatch.setattr(ev, "main", lambda argv: pytest.fail("cached eval must not be re-run"))
    out = tmp_path / "o"
    rc = grid.main(["--out", str(out), "--drafter", f"dspark_g7_d2={fake_grid / 'eval_dspark_g7_d2'}",
                    "--drafter", f"mine_g7_d2={drafter_dir}", "--evals", str(evals)])
    assert rc == 0
    names = [c["name"] for c in json.loads((out / "grid.json").read_text())["cells"]]
    assert sorted(names) == ["dspark_g7_d2", "mine_g7_d2"]


def test_missing_and_invalid_results_dirs(tmp_path, capsys):
    out = str(tmp_path / "o")
    assert grid.main(["--out", out, "--drafter", f"x={tmp_path / 'nope'}"]) == 2
    err = capsys.readouterr().err
    assert "nope does not exist" in err and "python -m dspark_jax eval" in err
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "results.json").write_text("{not json")
    assert grid.main(["--out", out, "--drafter", f"x={bad}"]) == 2
    assert "is not valid JSON" in capsys.readouterr().err
    (bad / "results.json").write_text(json.dumps({"meta": {}}))
    assert grid.main(["--out", out, "--drafter", f"x={bad}"]) == 2
    assert "has no \"results\"" in capsys.readouterr().err
    (bad / "results.json").write_text(json.dumps({"results": {"code": {"x": {"tau": 1.5}}}}))
    assert grid.main(["--out", out, "--drafter", f"x={bad}"]) == 2
    assert "lacks 'ci95'" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert grid.main(["--out", out, "--from", str(empty)]) == 2
    assert "no eval_<name>/results.json inside" in capsys.readouterr().err
    assert grid.main(["--out", out, "--drafter", "noequals"]) == 2
    assert "expected NAME=DIR" in capsys.readouterr().err
    assert grid.main(["--out", out]) == 2
    assert "no cells to render" in capsys.readouterr().err
