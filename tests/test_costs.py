import json

import numpy as np
import pytest

from dspark_jax.costs import (CostTableError, draft_time_at, draft_time_for, load_cost_file, load_cost_table,
                              measure_table, roofline_table, save_cost_file, time_call)

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


def test_measure_table_with_callables():
    calls = []
    res = measure_table(lambda b: calls.append(b) or 1e-4 * b, [16, 4, 8], lambda: 2e-3)
    assert calls == [4, 8, 16] and res["buckets"] == [4, 8, 16]
    np.testing.assert_allclose(res["t_verify"], [4e-4, 8e-4, 16e-3 / 10])
    assert res["t_draft"] == 2e-3
    n = []
    assert time_call(lambda: n.append(1), repeats=3, warmup=2) >= 0 and len(n) == 5


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

    shipped = json.loads((Path(__file__).parent.parent / "configs/costs/accelerator_synthetic.json").read_text())
    ref = roofline_table()
    assert shipped["buckets"] == ref["buckets"] and "SYNTHETIC" in shipped["provenance"]
    np.testing.assert_allclose(shipped["t_verify"], ref["t_verify"], rtol=1e-9)


def test_measure_cli_on_the_engine(tmp_path):
    """End to end on a tiny engine: per-bucket verification of the engine's forward, draft time, JSON."""
    import jax

    from dspark_jax.costs import main

    out = tmp_path / "m.json"
    assert main(["measure", "--model", "tiny", "--num-slots", "2", "--gamma", "2", "--max-len", "16",
                 "--buckets", "2,4,6", "--repeats", "1", "--warmup", "1", "--out", str(out)]) == 0
    d = load_cost_file(out, expect_backend=jax.default_backend(), expect_buckets=[2, 4, 6])
    assert d["engine"]["num_slots"] == 2 and d["engine"]["gamma"] == 2 and d["t_draft"] > 0
    assert d["device_kind"] == jax.devices()[0].device_kind
