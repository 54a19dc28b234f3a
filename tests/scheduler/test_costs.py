import json

import numpy as np
import pytest

from dspark_jax.engine.timing import measure_engine
from dspark_jax.scheduler.costs import (
    FLOOR_S,
    MEASURED_ON,
    PREDICTED_ON,
    CostTableError,
    MeasureError,
    bucket_plan,
    describe_table,
    draft_time_at,
    draft_time_for,
    expect_table_for,
    load_cost_file,
    load_cost_table,
    measure_table,
    roofline_table,
    save_cost_file,
    table_origin,
    time_call,
    with_overhead,
)

BK = [4, 8, 16]


def _save(tmp_path, **over):
    kw = dict(backend="cpu", device_kind="cpu", provenance="test")
    kw.update(over)
    tv = kw.pop("t_verify", [1e-3, 1.5e-3, 3e-3])
    td = kw.pop("t_draft", 5e-4)
    bk = kw.pop("buckets", BK)
    return save_cost_file(tmp_path / "c.json", bk, tv, td, **kw)


def test_round_trip_and_expectations(tmp_path):
    p = _save(tmp_path)
    t = load_cost_table(p, expect_backend="cpu", expect_buckets=[16, 8, 4])
    np.testing.assert_array_equal(np.asarray(t.buckets), BK)
    np.testing.assert_allclose(np.asarray(t.t_verify), [1e-3, 1.5e-3, 3e-3], rtol=1e-6)
    assert float(t.t_draft) == pytest.approx(5e-4)
    tn = load_cost_table(p, as_numpy=True)
    assert isinstance(tn.buckets, np.ndarray)


def test_other_backend_or_buckets_rejected(tmp_path):
    p = _save(tmp_path, backend="tpu", device_kind="TPU v5 lite")
    with pytest.raises(CostTableError, match=r"measured on backend 'tpu' \(TPU v5 lite\), this run is on 'cpu'"):
        load_cost_table(p, expect_backend="cpu")
    with pytest.raises(CostTableError, match=r"buckets \[4, 8, 16\], the engine compiles \[4, 8, 32\]"):
        load_cost_table(p, expect_buckets=[4, 8, 32])
    load_cost_table(p)  # fine for simulation when nothing is expected


@pytest.mark.parametrize("field,value,msg", [
    ("t_verify", [1e-3, 0.0, 3e-3], "t_verify has non-positive"),
    ("t_verify", [1e-3, -2e-3, 3e-3], "t_verify has non-positive"),
    ("t_verify", [1e-3, float("nan"), 3e-3], "non-finite"),
    ("t_draft", -1e-3, "t_draft has non-positive"),
    ("buckets", [4, 4, 16], "strictly increasing"),
])
def test_bad_times_and_buckets(tmp_path, field, value, msg):
    with pytest.raises(CostTableError, match=msg):
        _save(tmp_path, **{field: value})  # refused on save
    good = json.loads(_save(tmp_path).read_text())
    good[field] = value
    (tmp_path / "bad.json").write_text(json.dumps(good))
    with pytest.raises(CostTableError, match=msg):  # and on load (hand-edited files)
        load_cost_table(tmp_path / "bad.json")


def test_not_a_table(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"buckets": BK}))
    with pytest.raises(CostTableError, match="not a cost table"):
        load_cost_file(tmp_path / "x.json")
    with pytest.raises(CostTableError, match="does not exist"):
        load_cost_file(tmp_path / "missing.json")


def test_measure_table_sweeps_the_buckets_and_pairs_draft_and_round():
    calls = []
    load = [0.0, 1e-3, 0.0]  # one warm-up sweep, then two timed ones; the first timed one under extra load
    sweep = lambda: load[sum(c == "skip" for c in calls)]

    def draft_fn():
        return 2e-3 + sweep()

    def round_fn(b):
        calls.append(b)
        return 2e-3 + 1e-4 * b + sweep()

    def skip_fn():
        t = 2.2e-3 + sweep()
        calls.append("skip")
        return t

    res = measure_table(round_fn, [16, 4, 8], draft_fn, repeats=2, warmup=1, stat="median", skip_fn=skip_fn)
    # every bucket and the skipped round in each sweep: a load that comes and goes hits them alike
    assert calls == [4, 8, 16, "skip"] * 3 and res["buckets"] == [4, 8, 16]
    assert res["clipped"] == res["repriced"] == []
    np.testing.assert_allclose(res["t_verify"], [4e-4, 8e-4, 16e-4])  # the paired drafts' load is subtracted
    np.testing.assert_allclose(res["t_round"], [2.4e-3 + 5e-4, 2.8e-3 + 5e-4, 3.6e-3 + 5e-4])
    np.testing.assert_allclose(res["t_draft_paired"], [2.5e-3] * 3)
    assert res["t_draft"] == pytest.approx(2.5e-3) and res["t_skip"] == pytest.approx(2.7e-3)
    assert "t_skip" not in measure_table(lambda b: 3e-3, [4], lambda: 1e-3, repeats=1)
    n = []
    assert time_call(lambda: n.append(1), repeats=3, warmup=2) >= 0 and len(n) == 5


def test_measure_table_can_warm_each_program_once_and_price_the_draft_by_the_skipped_round():
    calls = []

    def round_fn(b):
        calls.append(b)
        return 2e-3 + 1e-4 * b + (1.0 if len(calls) == 1 else 0.0)  # the first call compiles

    def skip_fn():
        calls.append("skip")
        return 2.1e-3 + (1.0 if calls.count("skip") == 1 else 0.0)

    res = measure_table(round_fn, [16, 4, 8], repeats=3, warmup=0, warm_programs=True, skip_fn=skip_fn,
                        draft_from_skip=4)
    assert calls == [4, "skip"] + [4, 8, 16, "skip"] * 3  # one untimed call of each program, no warm-up sweep
    assert res["draft_from"] == "skip" and res["t_skip"] == pytest.approx(2.1e-3)
    assert res["t_draft"] == pytest.approx(0.3e-3)  # the round at 4 (every slot, no draft verified) - the skip
    np.testing.assert_allclose(res["t_verify"], [2.1e-3, 2.5e-3, 3.3e-3])  # t_verify(4) is the skipped round
    with pytest.raises(MeasureError, match="draft_from_skip"):
        measure_table(round_fn, [4], lambda: 1e-3, skip_fn=skip_fn, draft_from_skip=4)
    with pytest.warns(RuntimeWarning, match="no slower than the round that skips drafting"):
        res = measure_table(lambda b: 2e-3, [4, 8], repeats=1, skip_fn=lambda: 3e-3, draft_from_skip=4)
    assert res["t_draft"] == FLOOR_S


def test_a_larger_bucket_measured_cheaper_stands_only_when_every_sweep_says_so():
    # the rounds of buckets 16 and 32 beat 8's in two of three sweeps and by their medians: noise, so 8
    # takes the cheaper of their prices (a round would otherwise move there for good); 32's beats
    # 16's in every sweep: that inversion stands (as a larger bucket packed in place on a TPU)
    times = {4: [3.0, 3.0, 3.0], 8: [5.0, 4.9, 3.5], 16: [4.0, 4.5, 4.0], 32: [3.8, 4.2, 3.9]}
    it = {b: iter([t[0]] + t) for b, t in times.items()}  # the warm-up sweep first
    res = measure_table(lambda b: 1e-3 * next(it[b]), [4, 8, 16, 32], lambda: 1e-3, repeats=3, stat="median")
    np.testing.assert_allclose(res["t_round"], [3e-3, 4.9e-3, 4e-3, 3.9e-3])
    assert res["repriced"] == [8]
    np.testing.assert_allclose(res["t_verify"], [2e-3, 2.9e-3, 3e-3, 2.9e-3])
    # (with the noisy price kept, a one-token round would run in bucket 16: `prefix.holding_cost`
    # is the suffix minimum either way, the bucket a round picks is what changed)


def test_measure_table_clips_noise_with_a_warning():
    with pytest.warns(RuntimeWarning, match="bucket 8: round .* <= draft .* clipped"):
        res = measure_table(lambda b: {4: 3e-3, 8: 1.9e-3}[b], [4, 8], lambda: 2e-3, floor=1e-6)
    assert res["clipped"] == [8]
    np.testing.assert_allclose(res["t_verify"], [1e-3, 1e-6])


def test_bucket_plan_lands_in_each_bucket():
    R, G = 4, 3
    bk = [1, 2, 3, 4, 8, 12, 16]
    plan = bucket_plan(bk, R, G)
    lo = 0
    for b in bk:
        k, g = plan[b]
        assert 1 <= k <= R and 0 <= g <= G and lo < k * (1 + g) <= b
        lo = b
    assert plan[16] == (4, 3) and plan[8] == (4, 1)  # fullest count, then most slots
    with pytest.raises(MeasureError, match=r"bucket\(s\) \[5, 32\] on an engine with num_slots 4 and gamma 3"
                                           r".*--buckets"):
        bucket_plan([4, 5, 16, 32], R, G)  # 5: no k * (1 + g) in (4, 5]; 32: above R * (G + 1) = 16


@pytest.fixture(scope="module")
def tiny_engine():
    from dspark_jax.engine import Engine, EngineConfig
    from dspark_jax.testing.tiny import tiny_config, tiny_drafter, tiny_target

    target = tiny_target(tiny_config())
    drafter = tiny_drafter("dspark", target, gamma=2)
    return Engine(target, drafter, EngineConfig(num_slots=2, max_len=16, buckets=[1, 2, 3, 4, 6],
                                                policy="fixed"))


@pytest.mark.filterwarnings("ignore:bucket .* clipped:RuntimeWarning")  # timing noise, not under test here
def test_measure_engine_times_each_bucket_on_the_round(tiny_engine):
    res = measure_engine(tiny_engine, repeats=2, warmup=1)
    assert res["buckets"] == [1, 2, 3, 4, 6]
    assert len(res["t_verify"]) == 5 and all(t > 0 for t in res["t_verify"]) and res["t_draft"] > 0
    for i, b in enumerate(res["buckets"]):  # every timed round (warm-up included) ran in its own bucket
        assert res["buckets_used"][b] == [i] * 3
    assert [(p["active_slots"], p["verify_len"]) for p in res["plan"]] == [(1, 0), (2, 0), (1, 2), (2, 1), (2, 2)]


@pytest.mark.filterwarnings("ignore:bucket .* clipped:RuntimeWarning")
def test_measure_engine_pins_each_round_whatever_the_policy(tiny_engine):
    """Each timed round's verification length is pinned (`Control.pin`), so an engine whose own
    policy never verifies a draft still lands every timed round in the bucket it is timed for."""
    import jax.numpy as jnp

    from dspark_jax.engine import Engine, EngineConfig

    def never_verify(a, active, ctl, a_stale, stale_valid):  # ignores ctl.gamma: every round packs 1 token / slot
        return jnp.zeros(active.shape, jnp.int32)

    eng = Engine(tiny_engine.target, tiny_engine.drafter, EngineConfig(num_slots=2, max_len=16, buckets=[2, 6],
                                                                       policy=never_verify))
    res = measure_engine(eng, repeats=1, warmup=1)
    assert res["buckets_used"] == {2: [0, 0], 6: [1, 1]}


def test_accelerator_shape_and_draft_curves(tmp_path):
    d = roofline_table()
    p = tmp_path / "a.json"
    p.write_text(json.dumps(d))
    d = load_cost_file(p)
    b, t = np.asarray(d["buckets"]), np.asarray(d["t_verify"])
    assert np.all(np.diff(t) >= 0)
    assert t[b == 32][0] / t[0] < 1.01  # flat at small batches (weight-read bound)
    assert t[-1] / t[b == 256][0] > 6.0  # then rising ~linearly (compute bound)
    assert draft_time_at(d, 1) < draft_time_at(d, 256)
    assert draft_time_for(d, 256, "mtp1") < draft_time_for(d, 256, "dspark")
    assert draft_time_for(d, 7, "ar") == 0.0
    plain = json.loads(_save(tmp_path).read_text())
    assert draft_time_for(plain, 64, "mtp1") == pytest.approx(0.5 * plain["t_draft"])


def test_shipped_accelerator_table_is_the_documented_model():
    from pathlib import Path

    shipped = json.loads((Path(__file__).resolve().parents[2] / "configs/costs/accelerator_synthetic.json").read_text())
    ref = roofline_table()
    assert shipped["buckets"] == ref["buckets"] and "SYNTHETIC" in shipped["provenance"]
    np.testing.assert_allclose(shipped["t_verify"], ref["t_verify"], rtol=1e-9)


def test_measure_cli_on_the_engine(tmp_path):
    """End to end, target-only (G = 0: rounds of k slots x 1 token, no draft): JSON from the compiled round."""
    import jax

    from dspark_jax.commands.costs import main

    out = tmp_path / "m.json"
    assert main(["measure", "--target", "tiny", "--drafter", "none", "--slots", "2", "--max-len", "16",
                 "--buckets", "1,2", "--repeats", "1", "--warmup", "1", "--temperature", "0", "--out", str(out)]) == 0
    d = load_cost_file(out, expect_backend=jax.default_backend(), expect_buckets=[1, 2])
    assert d["engine"]["num_slots"] == 2 and d["engine"]["gamma"] == 0 and d["t_draft"] == 0
    assert d["measured_on"] == MEASURED_ON and [p["active_slots"] for p in d["plan"]] == [1, 2]
    assert d["device_kind"] == jax.devices()[0].device_kind
    assert d["measure"]["temperature"] == 0 and "temperature 0," in d["provenance"]  # priced at the setting served


def test_plot_before_and_after(tmp_path):
    """`costs plot`: one line per table, before* dashed in its after*'s colour; a PNG is written."""
    from dspark_jax.commands.costs import main

    for name, tv in (("before_R4", [1e-3, 1.1e-3, 1.2e-3]), ("after_R4", [0.7e-3, 0.9e-3, 1.2e-3])):
        save_cost_file(tmp_path / f"{name}.json", BK, tv, 5e-4, backend="cpu", device_kind="cpu", provenance="test")
    out = tmp_path / "fig" / "curve.png"
    paths = [str(tmp_path / "before_R4.json"), str(tmp_path / "after_R4.json")]
    assert main(["plot", *paths, "--out", str(out), "--per-slot"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plot", str(tmp_path / "missing.json"), "--out", str(out)]) == 2


def test_measure_builds_the_presets_drafter_in_its_dtype():
    """With a config target, `costs measure` times the drafter that preset trains (its layers, feature
    layers and Markov rank, not the rank-8 toy) in the requested dtype: a SmolLM2 table's t_draft
    would otherwise price W2 at 8 x 49,152 instead of 256 x 49,152."""
    import argparse

    import jax.numpy as jnp

    from dspark_jax.commands.costs import _build_engine

    args = argparse.Namespace(model="micro", drafter="dspark", gamma=3, dtype="bfloat16", num_slots=1,
                              max_len=32, buckets=None)
    eng, cfg, _ = _build_engine(args)
    d = eng.drafter
    assert d.dcfg.markov_rank == 16 and d.dcfg.gamma == 3 and d.markov_w2[...].shape == (16, 512)
    assert eng.target.embed[...].dtype == jnp.bfloat16 and d.dtype == jnp.bfloat16
    args.dtype, args.model = "float32", "tiny"
    eng, _, _ = _build_engine(args)
    assert eng.drafter.dcfg.markov_rank == 8 and eng.target.embed[...].dtype == jnp.float32


def test_measure_a_checkpoint_and_its_trained_drafter(tmp_path, embedded_tiny_dir, tiny_dspark_drafter_dir):
    """`--target DIR --drafter DIR`: the table is timed on the models that will serve (the drafter's own
    gamma and shape), recorded as such; a trained drafter with a config target is refused by name."""
    import jax

    from dspark_jax.commands.costs import main

    out = tmp_path / "c.json"
    assert main(["measure", "--target", str(embedded_tiny_dir), "--drafter", str(tiny_dspark_drafter_dir),
                 "--slots", "1", "--max-len", "48", "--repeats", "1", "--warmup", "1", "--temperature", "0",
                 "--out", str(out)]) == 0
    d = load_cost_file(out, expect_backend=jax.default_backend())
    assert d["engine"]["gamma"] == 4 and d["buckets"] == [1, 2, 4, 5] and d["t_draft"] > 0
    assert d["t_skip"] > 0  # the round that skips drafting, timed: what the skip rule prices a skipped round at
    assert "the checkpoint weights" in d["provenance"]
    with pytest.raises(SystemExit):
        main(["measure", "--drafter", str(tmp_path / "no_such_dir"), "--out", str(tmp_path / "x.json")])
    with pytest.raises(ValueError, match="trained drafter: give --target the checkpoint directory"):
        import argparse

        from dspark_jax.commands.costs import _build_engine

        _build_engine(argparse.Namespace(model="micro", drafter=str(tiny_dspark_drafter_dir), gamma=4,
                                         dtype="float32", num_slots=1, max_len=32, buckets=None))


def _predicted(tmp_path, **over):
    d = json.loads(_save(tmp_path, backend="tpu", device_kind="v6e-8").read_text())
    d.update({"predicted_on": PREDICTED_ON, "topology": "v6e-8", "target": "qwen3_8b_dspark", "drafter": "dspark",
              "provenance": "predicted by the XLA:TPU cost model, v6e-8, libtpu 0.0.42.1", **over})
    path = tmp_path / "predicted.json"
    path.write_text(json.dumps(d))
    return path


def test_a_table_without_provenance_is_refused(tmp_path):
    d = json.loads(_save(tmp_path).read_text())
    for missing in ({}, {"provenance": "  "}):
        d.pop("provenance", None)
        d.update(missing)
        (tmp_path / "x.json").write_text(json.dumps(d))
        with pytest.raises(CostTableError, match="says nowhere where its times come from"):
            load_cost_file(tmp_path / "x.json")


def test_a_predicted_table_is_refused_where_a_measured_one_is_required(tmp_path):
    p = _predicted(tmp_path)
    d = load_cost_file(p)  # for the simulator
    assert table_origin(d) == "predicted" and "PREDICTED (not measured) for v6e-8" in describe_table(d, "p")
    with pytest.raises(CostTableError, match=r"PREDICTED .* a live engine schedules with times measured .* "
                                             r"costs measure"):
        load_cost_table(p, expect_backend="tpu")  # even on the backend it names
    assert table_origin(load_cost_file(_save(tmp_path))) == "measured"
    assert table_origin(roofline_table()) == "synthetic"


def test_a_table_for_another_slice_target_or_drafter_is_refused_naming_both(tmp_path):
    d = load_cost_file(_predicted(tmp_path))
    expect_table_for(d, "t.json", topology="v6e-8", target="qwen3_8b_dspark", drafter="dspark")  # all match
    with pytest.raises(CostTableError, match=r"topology 'v6e-8' \(wanted 'v5e-8'\), target 'qwen3_8b_dspark' "
                                             r"\(wanted 'qwen3_4b_dspark'\)"):
        expect_table_for(d, "t.json", topology="v5e-8", target="qwen3_4b_dspark", drafter="dspark")


def test_overhead_is_added_to_every_round_and_recorded(tmp_path):
    d = {**load_cost_file(_predicted(tmp_path)), "t_target_step": 2e-3}
    o = with_overhead(d, 1e-3, "fitted to a published point")
    np.testing.assert_allclose(o["t_verify"], np.asarray(d["t_verify"]) + 1e-3)
    assert o["t_target_step"] == pytest.approx(3e-3) and o["t_draft"] == d["t_draft"]
    assert o["overhead_s"] == 1e-3 and o["overhead_source"] == "fitted to a published point"
    with pytest.raises(CostTableError, match=">= 0"):
        with_overhead(d, -1e-3, "x")
