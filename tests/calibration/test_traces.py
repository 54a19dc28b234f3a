import numpy as np
import pytest

from dspark_jax.calibration.traces import (
    TraceError,
    TraceSet,
    concat,
    from_engine,
    load_traces,
    sampling_key,
    save_traces,
    synthetic_traces,
)


def _ts(n=6, g=3, seed=0, **meta):
    rng = np.random.default_rng(seed)
    vl = rng.integers(0, g + 1, n)
    acc = np.minimum(rng.integers(0, g + 1, n), vl)
    return TraceSet(rng.normal(size=(n, g)), acc, vl, vl == g, np.arange(n) // 2, np.arange(n) % 2,
                    meta={"drafter_kind": "dspark", "sampling": {"temperature": 0.7, "top_k": 20, "top_p": 0.8},
                          "target_fingerprint": "abc", **meta})


def test_round_trip(tmp_path):
    ts = _ts(extra_note="x")
    p = save_traces(tmp_path / "t.npz", ts)
    back = load_traces(p)
    for f in ("conf_logits", "accepted", "verify_len", "full", "request", "round"):
        np.testing.assert_array_equal(getattr(back, f), getattr(ts, f))
    assert back.conf_logits.dtype == np.float32 and back.full.dtype == bool
    assert back.meta == ts.meta and back.meta["extra_note"] == "x" and back.gamma == 3
    assert back.key == "T0.7_k20_p0.8" == sampling_key((0.7, 20, 0.8)) == sampling_key(back.sampling)
    full = back.full_gamma()
    assert np.all(full.verify_len == 3) and len(full) == int(ts.full.sum())


def test_engine_format_and_from_engine(tmp_path):
    ts = _ts()
    raw = {"request": ts.request, "round": ts.round, "conf_logits": ts.conf_logits, "length": ts.verify_len,
           "accepted": ts.accepted, "full": ts.full}
    np.savez(tmp_path / "raw.npz", **raw)  # what engine.Traces.save writes
    back = load_traces(tmp_path / "raw.npz", meta={"drafter_kind": "dspark"})
    np.testing.assert_array_equal(back.verify_len, ts.verify_len)
    assert back.meta["drafter_kind"] == "dspark" and back.key == "T1_k0_p1"

    class FakeEngineTraces:
        def arrays(self):
            return raw

    conv = from_engine(FakeEngineTraces(), drafter_kind="dflash", sampling=(1.0, 0, 0.9))
    assert conv.meta["source"] == "engine" and conv.key == "T1_k0_p0.9"
    np.testing.assert_array_equal(conv.accepted, ts.accepted)


def test_bad_input(tmp_path):
    with pytest.raises(TraceError, match="rows"):
        TraceSet(np.zeros((3, 2)), [0, 1], [2, 2, 2], [1, 1, 1], [0, 0, 0], [0, 1, 2])
    with pytest.raises(TraceError, match="accepted must lie"):
        TraceSet(np.zeros((2, 2)), [2, 0], [1, 2], [0, 1], [0, 0], [0, 1])
    with pytest.raises(TraceError, match="verify_len"):
        TraceSet(np.zeros((1, 2)), [0], [3], [0], [0], [0])
    with pytest.raises(TraceError, match=".npz"):
        save_traces(tmp_path / "t.json", _ts())
    with pytest.raises(TraceError, match="does not exist"):
        load_traces(tmp_path / "nope.npz")
    np.savez(tmp_path / "partial.npz", conf_logits=np.zeros((2, 2)))
    with pytest.raises(TraceError, match="lacks field"):
        load_traces(tmp_path / "partial.npz")
    other = _ts(seed=1)
    other.meta["sampling"] = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    with pytest.raises(TraceError, match="sampling"):
        concat([_ts(), other])


def test_concat_keeps_requests_apart():
    a, b = _ts(seed=0), _ts(seed=1)
    c = concat([a, b])
    assert len(c) == len(a) + len(b)
    assert set(c.request[: len(a)]).isdisjoint(c.request[len(a):])


def test_synthetic_model():
    d = synthetic_traces(64, 32, 7, kind="dspark", seed=0)
    f = synthetic_traces(64, 32, 7, kind="dflash", seed=0)
    m = synthetic_traces(64, 32, kind="mtp1", seed=0)
    assert d.gamma == 7 and m.gamma == 1 and d.full.all() and np.all(d.verify_len == 7)
    assert d.tau() > f.tau() + 0.3 and 1.5 < m.tau() < 2.0  # suffix decay hurts DFlash
    # the confidence logit is informative: accepted rounds have higher z_0
    assert d.conf_logits[d.accepted >= 1, 0].mean() > d.conf_logits[d.accepted == 0, 0].mean() + 1.0
    assert "synthetic" in d.meta["source"]
    with pytest.raises(TraceError, match="unknown synthetic kind"):
        synthetic_traces(2, 2, kind="eagle9")
