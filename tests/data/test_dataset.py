import json

import grain
import numpy as np
import pytest

from dspark_jax.data.dataset import DatasetWriter, TokenDataset


def _records(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        L = int(rng.integers(0 if i == 3 else 1, 40))
        out.append((rng.integers(0, 5000, L).astype(np.int32), rng.random(L) < 0.5))
    return out


def _check(ds, recs):
    assert len(ds) == len(recs)
    for i, (t, m) in enumerate(recs):
        r = ds[i]
        assert r["tokens"].dtype == np.int32 and r["loss_mask"].dtype == np.bool_
        np.testing.assert_array_equal(r["tokens"], t)
        np.testing.assert_array_equal(r["loss_mask"], m)


def test_round_trip_and_meta(tmp_path):
    recs = _records(20)
    d = tmp_path / "ds"
    with DatasetWriter(d, vocab_size=5000, tokenizer_hash="abc", info={"split": "train"}) as w:
        assert not d.exists()  # published only on close
        for t, m in recs:
            w.add(t, m)
    assert not (tmp_path / "ds.partial").exists()
    ds = TokenDataset(d)
    _check(ds, recs)
    np.testing.assert_array_equal(ds[-1]["tokens"], recs[-1][0])
    with pytest.raises(IndexError):
        ds[20]
    meta = json.loads((d / "meta.json").read_text())
    assert meta["count"] == 20 and meta["vocab_size"] == 5000 and meta["tokenizer_hash"] == "abc"
    assert meta["info"] == {"split": "train"} and meta["num_tokens"] == sum(len(t) for t, _ in recs)
    assert np.load(d / "offsets.npy").dtype == np.int64
    with pytest.raises(ValueError):
        DatasetWriter(tmp_path / "x").add([1, 2], [True])


def test_refuse_overwrite_and_overwrite(tmp_path):
    d = tmp_path / "ds"
    with DatasetWriter(d) as w:
        w.add([1, 2, 3], [0, 1, 1])
    with pytest.raises(FileExistsError, match="overwrite"):
        DatasetWriter(d)
    _check(TokenDataset(d), [([1, 2, 3], [False, True, True])])
    with DatasetWriter(d, overwrite=True) as w:
        w.add([7], [1])
    _check(TokenDataset(d), [([7], [True])])


def test_resume_after_crash_with_torn_tail(tmp_path):
    recs = _records(12, seed=1)
    d = tmp_path / "ds"
    with pytest.raises(RuntimeError):
        with DatasetWriter(d, vocab_size=5000, info={"run": 1}) as w:
            for t, m in recs[:7]:
                w.add(t, m)
            raise RuntimeError("crash")
    assert not d.exists()
    part = tmp_path / "ds.partial"
    with open(part / "tokens.bin", "ab") as f:  # torn write of an 8th record
        f.write(b"\x01\x02\x03\x04\x05\x06")
    with open(part / "offsets.log", "ab") as f:
        f.write(b"\x01\x02\x03")
    w = DatasetWriter(d, resume=True)
    assert len(w) == 7
    for t, m in recs[len(w):]:
        w.add(t, m)
    w.close()
    ds = TokenDataset(d)
    _check(ds, recs)
    assert ds.meta["vocab_size"] == 5000 and ds.meta["info"] == {"run": 1}
    # resume a finished dataset: append more records
    more = _records(3, seed=2)
    with DatasetWriter(d, resume=True) as w:
        assert len(w) == 12
        for t, m in more:
            w.add(t, m)
    _check(TokenDataset(d), recs + more)


def test_grain_reads(tmp_path):
    recs = _records(10, seed=3)
    d = tmp_path / "ds"
    with DatasetWriter(d) as w:
        for t, m in recs:
            w.add(t, m)
    ds = grain.MapDataset.source(TokenDataset(d)).shuffle(seed=0).map(lambda r: int(r["tokens"].sum()))
    got = [ds[i] for i in range(len(ds))]
    assert sorted(got) == sorted(int(t.sum()) for t, _ in recs)
    assert got != [int(t.sum()) for t, _ in recs]  # shuffled
    it = iter(grain.MapDataset.source(TokenDataset(d)).to_iter_dataset())
    np.testing.assert_array_equal(next(it)["tokens"], recs[0][0])


@pytest.mark.parametrize("victim", ["tokens.bin", "loss_mask.bin", "offsets.npy", "meta.json"])
def test_missing_or_corrupt_files_named(tmp_path, victim):
    d = tmp_path / "ds"
    with DatasetWriter(d) as w:
        for t, m in _records(5):
            w.add(t, m)
    (d / victim).write_bytes(b"garbage!")
    with pytest.raises(ValueError) as e:
        TokenDataset(d)
    assert victim in str(e.value)
    (d / victim).unlink()
    with pytest.raises(FileNotFoundError) as e:
        TokenDataset(d)
    assert victim in str(e.value)
