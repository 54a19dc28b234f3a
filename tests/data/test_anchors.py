import numpy as np

from dspark_jax.data.anchors import block_valid_mask, sample_anchors, valid_anchor_positions
from dspark_jax.data.pipeline import RecordSpec, make_example, make_pipeline


def test_valid_anchors_need_both_tokens_assistant():
    m = np.array([0, 1, 1, 1, 0, 1, 1, 0], bool)
    np.testing.assert_array_equal(valid_anchor_positions(m), [1, 2, 5])


def test_sampling_is_without_replacement_sorted_padded_and_deterministic():
    m = np.zeros(100, bool)
    m[10:60] = True
    a, k = sample_anchors(m, 16, seed=3, index=7)
    assert k.all() and np.all(np.diff(a) > 0) and a.min() >= 10 and a.max() <= 58
    a2, _ = sample_anchors(m, 16, seed=3, index=7)
    np.testing.assert_array_equal(a, a2)
    a3, _ = sample_anchors(m, 16, seed=3, index=8)
    assert not np.array_equal(a, a3)
    # fewer candidates than anchors: all taken, rest dummy
    a, k = sample_anchors(m, 64, seed=0, index=0)
    assert k.sum() == 49 and not k[49:].any() and np.array_equal(a[:49], np.arange(10, 59))


def test_uniform_over_candidates():
    m = np.ones(12, bool)  # 11 candidates, draw 3
    counts = np.zeros(12)
    for i in range(3000):
        a, _ = sample_anchors(m, 3, 0, i)
        counts[a] += 1
    freq = counts[:11] / 3000
    assert counts[11] == 0 and np.all(np.abs(freq - 3 / 11) < 0.04)


def test_block_valid_is_a_prefix_inside_assistant_span():
    m = np.array([0, 1, 1, 1, 1, 0, 1, 1], bool)
    anchors = np.array([1, 3, 6, 0])
    keep = np.array([True, True, True, False])
    v = block_valid_mask(m, anchors, keep, 4)
    np.testing.assert_array_equal(v, [
        [1, 1, 1, 0],  # labels 2,3,4 assistant, 5 not
        [1, 0, 0, 0],  # label 4 ok, 5 not -> prefix stops (even though 6 is assistant)
        [1, 0, 0, 0],  # label 7 ok, 8 outside the sequence
        [0, 0, 0, 0],  # dummy
    ])


class _ListDS:
    def __init__(self, recs):
        self.recs = recs

    def __len__(self):
        return len(self.recs)

    def __getitem__(self, i):
        return self.recs[i]


def test_pipeline_resumes_exactly():
    rng = np.random.default_rng(0)
    recs = []
    for _ in range(10):
        n = int(rng.integers(20, 40))
        recs.append({"tokens": rng.integers(0, 50, n).astype(np.int32),
                     "loss_mask": np.r_[np.zeros(5, bool), np.ones(n - 5, bool)]})
    spec = RecordSpec(seq_len=32, num_anchors=4, gamma=3, pad_id=0, seed=1)
    it = iter(make_pipeline(_ListDS(recs), spec, 2, process_index=0, process_count=1))
    first = [next(it) for _ in range(3)]
    state = it.get_state()
    rest = [next(it) for _ in range(4)]
    it2 = iter(make_pipeline(_ListDS(recs), spec, 2, process_index=0, process_count=1))
    it2.set_state(state)
    for a, b in zip(rest, [next(it2) for _ in range(4)]):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    assert first[0]["tokens"].shape == (2, 32) and first[0]["block_valid"].shape == (2, 4, 3)
    # two hosts read disjoint halves
    h0 = make_pipeline(_ListDS(recs), spec, 1, shuffle=False, num_epochs=1, process_index=0, process_count=2)
    h1 = make_pipeline(_ListDS(recs), spec, 1, shuffle=False, num_epochs=1, process_index=1, process_count=2)
    t0 = {tuple(b["tokens"][0][:10]) for b in h0}
    t1 = {tuple(b["tokens"][0][:10]) for b in h1}
    assert len(t0) == 5 and len(t1) == 5 and not (t0 & t1)


def _recs(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        k = int(rng.integers(20, 40))
        out.append({"tokens": rng.integers(0, 50, k).astype(np.int32),
                    "loss_mask": np.r_[np.zeros(5, bool), np.ones(k - 5, bool)]})
    return out


def test_host_batches_concatenate_to_the_single_host_batches():
    """2 hosts x 2 rows, in process order, are the 1-host 4-row batches (shuffled, across epochs):
    what makes a 2-process run equal to a 1-process run. A per-host shard of the records would not."""
    recs = _recs(10)
    spec = RecordSpec(seq_len=32, num_anchors=4, gamma=3, pad_id=0, seed=3)
    one = iter(make_pipeline(_ListDS(recs), spec, 4, process_index=0, process_count=1))
    hosts = [iter(make_pipeline(_ListDS(recs), spec, 2, process_index=p, process_count=2)) for p in range(2)]
    for _ in range(6):  # 24 rows: past two epochs of 10
        want = next(one)
        got = [next(h) for h in hosts]
        for key in want:
            np.testing.assert_array_equal(np.concatenate([g[key] for g in got]), want[key])


def test_heldout_batches_are_even_across_hosts_and_drop_nothing():
    """23 records on 2 hosts x 4 rows: 12 / 11 records would be 3 / 2 full batches (a hang in the
    collective evaluation step, and 3 records dropped); both hosts get 3 batches, every record
    appears exactly once, and padding rows carry no blocks."""
    from dspark_jax.data.pipeline import heldout_batches

    recs = _recs(23, seed=1)
    spec = RecordSpec(seq_len=40, num_anchors=4, gamma=3, pad_id=0, seed=1)
    per_host = [list(heldout_batches(_ListDS(recs), spec, 4, process_index=p, process_count=2)) for p in range(2)]
    assert [len(b) for b in per_host] == [3, 3]
    rows = [(b["tokens"][i], b["keep"][i]) for bs in per_host for b in bs for i in range(4)]
    real = [tuple(t[:20]) for t, k in rows if k.any()]
    assert sorted(real) == sorted(tuple(r["tokens"][:20]) for r in recs)
    assert sum(not k.any() for _, k in rows) == 24 - 23


def test_make_example_truncates_and_pads():
    rec = {"tokens": np.arange(10, dtype=np.int32), "loss_mask": np.ones(10, bool)}
    ex = make_example(rec, 0, RecordSpec(seq_len=6, num_anchors=8, gamma=2, pad_id=99))
    assert ex["tokens"].tolist() == [0, 1, 2, 3, 4, 5] and ex["keep"].sum() == 5
    ex = make_example(rec, 0, RecordSpec(seq_len=12, num_anchors=2, gamma=2, pad_id=99))
    assert ex["tokens"][10:].tolist() == [99, 99] and not ex["loss_mask"][10:].any()
