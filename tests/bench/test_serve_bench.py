"""`python -m dspark_jax bench serve` drives the real server with concurrent streaming clients
and reports every level of every configuration (tiny embedded target, bounded)."""

import json

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")


def test_serve_bench_sweeps_levels_and_plots(embedded_tiny_dir, tiny_dspark_drafter_dir, tmp_path, capsys):
    from dspark_jax.commands.bench.serve import main

    assert main(["--target", str(embedded_tiny_dir), "--drafter", f"dspark={tiny_dspark_drafter_dir}",
                 "--concurrency", "1", "3", "--requests", "3", "--max-tokens", "8", "--num-prompts", "4",
                 "--max-len", "128", "--kv-pages", "12,16", "--repeats", "2", "--out", str(tmp_path)]) == 0
    whole = json.loads((tmp_path / "results.json").read_text())
    res = whole["results"]
    # paged KV (12 pages of 16 tokens, half of 3 slots x 128): both configurations used the pool
    assert whole["meta"]["kv_pages"] == [12, 16]
    assert set(whole["meta"]["peak_pages"]) == {"target-only", "dspark"}
    assert all(0 < p <= 12 for p in whole["meta"]["peak_pages"].values())
    assert list(res) == ["target-only", "dspark"]
    for levels in res.values():
        assert [lv["concurrency"] for lv in levels] == [1, 3]
        assert all(lv["requests"] == 2 * 3 and lv["tokens"] > 0 and lv["throughput"] > 0 for lv in levels)
        # each level's rounds from the server's /metrics counters (a round decodes a token or forwards a prompt)
        for lv in levels:
            assert 0 < lv["rounds"] <= lv["tokens"] + lv["requests"] and 0 < lv["round_seconds"] < lv["seconds"]
            assert 0 <= lv["skipped_rounds"] <= lv["rounds"]
    assert all(lv["skipped_rounds"] == 0 for lv in res["target-only"])  # no drafter: nothing to skip
    # two runs a level: its figures are their medians (of two: the mean), its counts their totals,
    # and the drafter's ratio the median of the two runs' own ratios
    for levels in res.values():
        for lv in levels:
            a, b = lv["repeats"]
            assert a["requests"] == b["requests"] == 3 and lv["tokens"] == a["tokens"] + b["tokens"]
            assert lv["throughput"] == pytest.approx((a["throughput"] + b["throughput"]) / 2)
    for lv, base in zip(res["dspark"], res["target-only"], strict=True):
        mine = [r["throughput"] / t["throughput"] for r, t in zip(lv["repeats"], base["repeats"], strict=True)]
        assert lv["ratios"] == pytest.approx(mine) and lv["ratio"] == pytest.approx(sum(mine) / 2)
    assert (tmp_path / "pareto.png").stat().st_size > 1000
    out = capsys.readouterr().out
    assert "dspark / target-only throughput: c=1:" in out
    # each server's start: build to ready, and its own cost table's timing apart from the first calls
    starts = {name: c["start"] for name, c in whole["meta"]["configs"].items()}
    assert starts["target-only"]["cost_table"] is None and starts["target-only"]["seconds"] > 0
    own = starts["dspark"]["cost_table"]
    assert own["source"] in ("measured", "read back") and own["repeats"] == 3
    if own["source"] == "measured":
        assert 0 < own["timing_seconds"] < starts["dspark"]["seconds"] and own["first_calls_seconds"] > 0
        assert "timing its own cost table (3 sweeps, after" in out
    # the servers' own warm-up compiled every program serving reached (the skip rule's settled
    # round included): nothing compiled inside a timed level
    assert whole["meta"]["compiled_while_timed"] == {"target-only": 0, "dspark": 0}


def test_repeats_alternate_the_order_and_refuse_zero(capsys):
    from dspark_jax.commands.bench.serve import in_turn, parse_args

    # A B C, C B A, A B C: a drift linear over two repeats costs each configuration alike
    assert [in_turn(["a", "b", "c"], r) for r in range(3)] == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]
    with pytest.raises(SystemExit):
        parse_args(["--repeats", "0"])
    assert "--repeats must be at least 1 (got 0)" in capsys.readouterr().err


def test_each_configuration_names_its_own_policy():
    from dspark_jax.commands.bench.serve import parse_config

    assert parse_config("dspark-sched=/runs/d@production", "fixed") == ("dspark-sched", "/runs/d", "production")
    assert parse_config("dspark=/runs/d", "fixed") == ("dspark", "/runs/d", "fixed")
    assert parse_config("/runs/dflash", "threshold") == ("dflash", "/runs/dflash", "threshold")


def test_skip_drafting_reaches_the_server_and_only_scheduled_configurations():
    from dspark_jax.commands.bench.serve import SCHEDULED_POLICIES
    from dspark_jax.commands.serve import parse_args
    from dspark_jax.engine.policy import SCHEDULED

    assert parse_args(["--skip-drafting"]).skip_drafting == "known"
    args = parse_args([])  # by default the drafter kind's scheduling, STS where the drafter has them
    assert (args.policy, args.skip_drafting, args.calibrated) == ("auto", "auto", "auto")
    assert parse_args(["--no-sts"]).calibrated is None and parse_args(["--calibrated"]).calibrated == 1.0
    assert set(SCHEDULED_POLICIES) == set(SCHEDULED)
