"""Cost tables predicted by the TPU compiler (engine/predict.py, `costs predict`): compiled for a
v6e-4 slice on this CPU machine, marked as predicted, priced per program, and read by the
simulator; the serving report's arithmetic (bench/tpu_report.py) on them."""

import json

import pytest

from dspark_jax.bench.tpu_report import fixed_speedup
from dspark_jax.calibration.profiles import parse_profile, profile_traces
from dspark_jax.commands.costs import main as costs_main
from dspark_jax.commands.simulate import main as simulate_main
from dspark_jax.config import from_cli
from dspark_jax.scheduler.costs import FORMAT, load_cost_file, table_origin, write_checked
from dspark_jax.scheduler.simulate import Method, simulate_method

pytest.importorskip("libtpu", reason="the TPU compiler ships in libtpu: pip install -e '.[aot]'")


@pytest.fixture(scope="module")
def predicted(tmp_path_factory):
    from dspark_jax.engine.predict import predict_table

    d = predict_table(from_cli(["micro"]), slots=4, context=64, topology="v6e-4", mesh_shape=(2, 1, 2),
                      draft_kinds=("mtp1",))
    d = {"format": FORMAT, "backend": "tpu", "device_kind": "v6e-4", **d, "target": "micro", "drafter": "dspark"}
    return load_cost_file(write_checked(tmp_path_factory.mktemp("p") / "micro.json", d))


def test_every_program_is_priced_with_its_loops_counted(predicted):
    d = predicted
    assert table_origin(d) == "predicted"
    assert d["provenance"].startswith("predicted by the XLA:TPU cost model, v6e-4, libtpu ")
    assert d["buckets"] == [4, 8, 16, 20] and len(d["t_verify"]) == 4
    progs = d["programs"]
    assert set(progs) == {"draft", "round@4", "round@8", "round@16", "round@20", "skip@4", "target_only@R",
                          "draft[mtp1]"}
    for name, p in progs.items():
        assert p["seconds"] > 0 and p["cycles"] >= p["once_cycles"] > 0, name
        assert p["clock_hz"] > 1e8 and not p["unknown_loops"], name
    # compiled for TPU the target's layers run unrolled over per-layer weights and the round writes
    # the cache in one scatter: the target-only step holds no loop; the draft's loop over its
    # block is counted with its trips
    layers = from_cli(["micro"]).target.model.num_layers
    assert not any(n == layers for _, n in progs["target_only@R"]["loops"])
    assert any(n == d["engine"]["gamma"] for _, n in progs["draft"]["loops"])
    # a round drafts, verifies and updates the drafter: more than the target's step alone
    assert all(t > d["t_target_step"] for t in d["t_round"])
    assert d["t_draft"] == pytest.approx(progs["draft"]["seconds"])
    assert d["t_draft_by_kind"]["mtp1"]["gamma"] == 1


def test_simulator_prices_target_only_with_the_predicted_step(predicted):
    ts = profile_traces(parse_profile("tau:3.0", gamma=predicted["engine"]["gamma"]))
    ar = simulate_method(Method("target-only", "ar", None), 4, predicted, {"dspark": ts}, None, n_rounds=20)
    assert ar.total_tps == pytest.approx(4 / predicted["t_target_step"], rel=1e-6)
    fixed = simulate_method(Method("DSpark", "fixed", "dspark"), 4, predicted, {"dspark": ts}, None, n_rounds=200)
    # fixed gamma commits tau tokens per request per round of draft + verify(R (G + 1))
    expect = fixed_speedup(predicted, ts.tau(), predicted["engine"]["gamma"] + 1)
    assert fixed.total_tps / ar.total_tps == pytest.approx(expect, rel=0.1)


def test_simulate_command_on_a_predicted_table(predicted, tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(predicted))
    code = simulate_main(["--costs", str(path), "--acceptance", "tau:3.5", "--concurrency", "1,4", "--rounds", "30",
                          "--overhead-ms", "0.5", "--expect-topology", "v6e-4", "--out", str(tmp_path / "sim")])
    out = capsys.readouterr().out
    assert code == 0 and "PREDICTED (not measured) for v6e-4" in out
    code = simulate_main(["--costs", str(path), "--acceptance", "tau:3.5", "--expect-topology", "v5e-8",
                          "--out", str(tmp_path / "sim2")])
    err = capsys.readouterr().err
    assert code == 2 and "topology 'v6e-4' (wanted 'v5e-8')" in err
    g = predicted["engine"]["gamma"]
    code = simulate_main(["--costs", str(path), "--acceptance", "tpu-inference-4b-dflash-k16",
                          "--out", str(tmp_path / "sim3")])
    err = capsys.readouterr().err
    assert code == 2 and f"is for gamma 15, the cost table's engine drafts gamma {g}" in err


def test_predict_command_refuses_bad_slices_and_meshes(capsys):
    assert costs_main(["predict", "configs/micro.yaml", "--topology", "v6e-3", "--slots", "4", "--out", "x.json"]) == 2
    assert "unknown TPU slice 'v6e-3'" in capsys.readouterr().err
    assert costs_main(["predict", "configs/micro.yaml", "--topology", "v6e-4", "--slots", "4", "--mesh", "1,1,8",
                       "--out", "x.json"]) == 2
    assert "= 8 devices, but slice v6e-4 has 4" in capsys.readouterr().err


def test_reprice_rederives_every_time_from_the_cycles(predicted):
    from dspark_jax.engine.predict import reprice

    clock = predicted["programs"]["draft"]["clock_hz"]
    before = json.dumps(predicted, sort_keys=True)
    fast = reprice(predicted, 2 * clock)
    assert json.dumps(predicted, sort_keys=True) == before  # the input is left as it was
    assert fast["t_draft"] == pytest.approx(predicted["t_draft"] / 2)
    assert fast["t_target_step"] == pytest.approx(predicted["t_target_step"] / 2)
    assert fast["t_round"] == pytest.approx([t / 2 for t in predicted["t_round"]])
    assert fast["t_draft_by_kind"]["mtp1"]["t_draft_by_requests"] == pytest.approx(
        [t / 2 for t in predicted["t_draft_by_kind"]["mtp1"]["t_draft_by_requests"]])
    assert reprice(predicted, clock)["t_verify"] == pytest.approx(predicted["t_verify"])


def test_with_collectives_adds_each_programs_collectives(predicted):
    """mesh 2 x 1 x 2 on v6e-4: tensor-parallel pairs, every program records its collectives'
    stated price beside the compiler's seconds, and the table's times gain exactly them."""
    from dspark_jax.engine.predict import with_collectives

    progs = predicted["programs"]
    assert all(p["collective_seconds"] > 0 for p in progs.values()), {n: p["collectives"] for n, p in progs.items()}
    more = with_collectives(predicted)
    assert more["t_draft"] == pytest.approx(predicted["t_draft"] + progs["draft"]["collective_seconds"])
    assert more["t_target_step"] == pytest.approx(predicted["t_target_step"]
                                                  + progs["target_only@R"]["collective_seconds"])
    assert "collectives added" in more["provenance"]
    old = {**predicted, "programs": {n: {k: v for k, v in p.items() if k != "collective_seconds"}
                                     for n, p in progs.items()}}
    with pytest.raises(ValueError, match="predict the table again"):
        with_collectives(old)


def test_show_labels_a_predicted_table(predicted, tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(predicted))
    assert costs_main(["show", str(path)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == f"cost table {path}: PREDICTED (not measured) for v6e-4 by the XLA:TPU cost model"


def test_the_bucket_only_undrafted_rows_reach_is_priced_on_the_one_column_view(predicted):
    """Bucket R (every row verifying no drafts: a skipped or scheduled-to-none round) runs the
    round's one-column attention view in the engine and in a measured table; the prediction prices
    that view, the other buckets the full G + 1 view."""
    g = predicted["engine"]["gamma"]
    widths = {n: p.get("view_width") for n, p in predicted["programs"].items() if n.startswith("round@")}
    assert widths == {"round@4": 1, "round@8": g + 1, "round@16": g + 1, "round@20": g + 1}


def test_programs_recompiles_only_the_named_programs_of_a_kept_table(predicted, tmp_path, capsys):
    path = tmp_path / "t.json"
    kept = json.loads(json.dumps(predicted))
    for name in ("draft", "round@4"):  # marks: what is recompiled loses its mark, what is kept keeps it
        kept["programs"][name]["seconds"] = 1.0
    path.write_text(json.dumps(kept))
    args = ["predict", "configs/micro.yaml", "--topology", "v6e-4", "--slots", "4", "--context", "64",
            "--mesh", "2,1,2", "--draft-kinds", "mtp1", "--dtype", from_cli(["micro"]).target.dtype, "--out", str(path)]
    assert costs_main(args + ["--programs", "round@R"]) == 0  # a program the kept table lacks is left out
    d = json.loads(path.read_text())
    assert d["programs"]["draft"]["seconds"] == 1.0 and d["t_draft"] == 1.0
    assert d["programs"]["round@4"]["seconds"] == pytest.approx(predicted["programs"]["round@4"]["seconds"])
    assert d["programs"]["round@8"] == predicted["programs"]["round@8"]
    capsys.readouterr()
    assert costs_main(args + ["--programs", "round@5"]) == 2
    assert "--programs: no program named round@5 in this prediction" in capsys.readouterr().err
    assert costs_main(args[:-1] + [str(tmp_path / "none.json"), "--programs", "draft"]) == 2
    assert "predict the whole table first" in capsys.readouterr().err


def test_a_paged_table_prices_the_kernel_once_per_layer(tmp_path):
    """With a paged KV cache the target's attention is the Pallas kernel, which carries no cycle
    estimate of its own: each call is priced from its declared cost (parallel/tpu_cost.py), once per
    layer of the target-only step and per layer of target and drafter in a round."""
    out = tmp_path / "paged.json"
    assert costs_main(["predict", "configs/micro.yaml", "--topology", "v6e-4", "--slots", "4", "--context", "64",
                       "--mesh", "2,1,2", "--kv-pages", "32,16", "--buckets", "4,20", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    layers = from_cli(["micro"]).target.model.num_layers
    progs = d["programs"]
    assert progs["target_only@R"]["kernels"] == layers
    assert all(progs[f"round@{b}"]["kernels"] == layers + 1 for b in (4, 20))  # the drafter's layer reads pages too
    assert "paged KV" in d["provenance"] and d["engine"]["kv_pages"] == [32, 16]


def test_the_skipped_round_is_priced_without_its_draft(predicted):
    """A round that skips drafting is the engine's round without a draft (`round.plain_round`,
    recorded with the program): it holds none of the draft's loops, costs less than the round at
    bucket R, which drafts, and no less than the target-only step, which it runs (with the
    drafter's context for the verified position)."""
    from dspark_jax.scheduler.costs import SKIPPED_ROUND

    progs = predicted["programs"]
    skip, drafted = progs["skip@4"], progs["round@4"]
    assert skip["program"] == SKIPPED_ROUND == "plain_round"
    draft_loops = {n for _, n in progs["draft"]["loops"]}
    assert draft_loops and not ({n for _, n in skip["loops"]} >= {n for _, n in drafted["loops"]})
    assert predicted["t_skip"] == pytest.approx(skip["seconds"]) and skip["seconds"] < drafted["seconds"]
    assert predicted["t_target_step"] <= predicted["t_skip"]
