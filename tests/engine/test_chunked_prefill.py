"""Chunked prefill (`EngineConfig(policy="fixed", prefill_chunk=C)`): a request that joins while others decode has its
prompt forwarded C tokens per round, packed beside the others' verification, instead of a
prefill call that stalls them. Checked: the same tokens as whole prefills for every kind (dense
and paged), the caches after chunks equal a whole prefill of the committed sequence, nobody
stalls, a whole chunk fits beside a full round (chunk-only buckets beyond a table's), the
earliest joined goes first."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.engine import Engine, EngineConfig, EngineError
from dspark_jax.testing.tiny import tiny_drafter
from tests.engine.test_bookkeeping import _dense, _rows_equal

GREEDY = SamplingParams(0.0, 0, 1.0)
G = 3


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 15, n).tolist() for n in (3, 9, 17, 5, 2, 7, 4, 11, 23, 6)]


def _engine(target, kind, **kw):
    d = None if kind == "ar" else tiny_drafter(kind, target, gamma=G)
    lk = dict(gamma=G, layer_ids=[0]) if kind == "eagle3" else {}
    cfg = {k: kw.pop(k) for k in list(kw) if k != "table"}
    return Engine(target, d, EngineConfig(policy="fixed", max_len=64, **lk, **cfg), **kw)


# dflash is dspark's block kind with the heads off: the same cache and chunk code (not repeated here)
@pytest.mark.parametrize("kind,paged", [("ar", False), ("dspark", False), ("dspark", True), ("eagle3", True),
                                        ("mtp1", False)])
def test_same_tokens_as_whole_prefills(target, prompts, kind, paged):
    """10 requests through 3 slots: every later request joins while others decode, its prompt
    (up to 23 tokens) forwarded 5 per round over at most 2 slots. Greedy tokens and per-request
    rounds / accepted drafts equal the engine that prefills prompts whole."""
    pages = (60, 4) if paged else None
    max_new = [9, 4, 12, 3, 7, 9, 5, 6, 8, 10]
    whole = _engine(target, kind, num_slots=3, kv_pages=pages).generate(prompts, max_new_tokens=max_new,
                                                                         sampling=GREEDY)
    eng = _engine(target, kind, num_slots=3, kv_pages=pages, prefill_chunk=5, prefill_rows=2)
    chunked = eng.generate(prompts, max_new_tokens=max_new, sampling=GREEDY)
    for i, (a, b) in enumerate(zip(whole.results, chunked.results)):
        assert b.tokens == a.tokens, i
        assert (b.rounds, b.accepted, b.finish_reason) == (a.rounds, a.accepted, a.finish_reason), i
    # the joins were chunked: more round calls (prompt tokens ride in rounds), one compiled round
    assert chunked.round_calls > whole.round_calls
    assert eng.compiled_rounds() == 1


@pytest.mark.parametrize("kind,paged", [("dspark", False), ("eagle3", False), ("mtp1", False), ("eagle3", True)])
def test_caches_after_chunks_equal_a_whole_prefill_and_nobody_stalls(target, prompts, kind, paged):
    """Slot 0 decodes; a 17-token prompt joins slot 1 and is forwarded 5, 5, 5, 1 tokens in four
    rounds while slot 0 gains tokens in each; after more rounds both slots' target cache,
    drafter cache (context K / V or Eagle3 / MTP-1's layer cache and carry) equal a whole
    prefill of the committed sequences. A chunk written at the wrong offset, a drafter
    prefill that ignored the previous chunk's carry, or a stale anchor fails it."""
    eng = _engine(target, kind, num_slots=2, prefill_chunk=5, prefill_rows=1, kv_pages=(40, 4) if paged else None)
    kd = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(0), 2)))
    ctl = eng.control(GREEDY)
    st = eng.init_state()
    st, ctl = eng.start(st, ctl, [0], [prompts[1]], kd[:1], [40], [GREEDY], [[]])
    st, _ = eng.step(st, ctl)
    st, ctl = eng.start(st, ctl, [1], [prompts[2]], kd[1:], [40], [GREEDY], [[]])  # joins while slot 0 runs
    assert int(st.pos[1]) == 0 and bool(st.active[1])
    progress = []
    for _ in range(4):
        before = int(st.n_gen[0])
        st, ro = eng.step(st, ctl)
        progress.append(int(st.pos[1]))
        assert int(st.n_gen[0]) > before  # slot 0 decodes in every round of the prefill
        assert not bool(ro.active[1]) and int(st.n_gen[1]) == 0
    assert progress == [5, 10, 15, 16]  # plen - 1 = 16: x_16 is the first anchor
    assert int(st.anchor[1]) == prompts[2][-1]
    for _ in range(4):
        st, ro = eng.step(st, ctl)
        assert bool(ro.active[1])
    n_gen, out, pos = np.asarray(st.n_gen), np.asarray(st.out), np.asarray(st.pos)
    committed = [p + out[r, : n_gen[r]].tolist() for r, p in enumerate(prompts[1:3])]
    assert [len(c) - 1 for c in committed] == pos.tolist()

    fresh = eng.prefill_slots(eng.init_state(), [0, 1], committed, kd, [40, 40])
    np.testing.assert_array_equal(np.asarray(st.dcache.lengths)[1], np.asarray(fresh.dcache.lengths)[1])
    (dk, dv), (fk, fv) = _dense(st.dcache), _dense(fresh.dcache)
    _rows_equal(dk, fk, fresh.dcache.lengths, "drafter K")
    _rows_equal(dv, fv, fresh.dcache.lengths, "drafter V")
    np.testing.assert_allclose(np.asarray(st.last, np.float32), np.asarray(fresh.last, np.float32),
                               atol=2e-4, rtol=2e-4)
    _rows_equal(_dense(st.cache)[0], _dense(fresh.cache)[0], pos, "target K")
    _rows_equal(_dense(st.cache)[1], _dense(fresh.cache)[1], pos, "target V")


def test_chunk_only_bucket_gives_a_whole_chunk_and_the_earliest_joined_goes_first(target, prompts):
    """3 slots, gamma 3, buckets (3, 12) as a cost table would give them: the engine compiles a
    chunk-only bucket 12 + 10 = 22 beyond them, so beside slot 0's full verification (4 tokens) a
    joining prompt forwards a whole chunk of 10 (capped by the table's 12, it got 8), and the
    table need not price 22; of two joined slots the one that joined first takes the whole chunk;
    in one join, the second row gets what the first leaves."""
    from dspark_jax import scheduler

    eng = _engine(target, "dspark", num_slots=3, buckets=(3, 12), prefill_chunk=10, prefill_rows=2)
    assert (eng.priced_buckets, eng.buckets) == ((3, 12), (3, 12, 22))
    kd = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(0), 3)))
    table = scheduler.make_table((3, 12), t_verify=[1.0, 2.0])
    # from the table
    assert _engine(target, "dspark", num_slots=3, table=table, prefill_chunk=10).buckets == (3, 12, 22)
    ctl = eng.control(GREEDY, table=table)
    with pytest.raises(EngineError, match="unpriced|do not match"):
        eng.control(GREEDY, table=scheduler.make_table((3, 12, 22), t_verify=[1.0, 2.0, 3.0]))
    st = eng.init_state()
    st, ctl = eng.start(st, ctl, [0], [prompts[1]], kd[:1], [60], [GREEDY], [[]])
    st, _ = eng.step(st, ctl)
    st, ctl = eng.start(st, ctl, [2], [prompts[8]], kd[2:], [10], [GREEDY], [[]])  # joins first, slot 2
    st, out = eng.step(st, ctl)
    assert int(st.pos[2]) == 10 and int(out.bucket) == 2  # the whole chunk, in the chunk-only bucket
    st, ctl = eng.start(st, ctl, [1], [prompts[2]], kd[1:2], [10], [GREEDY], [[]])  # joins later, slot 1
    st, _ = eng.step(st, ctl)
    assert (int(st.pos[2]), int(st.pos[1])) == (20, 0)  # the earlier request takes the whole chunk
    # default buckets end at a full round plus a chunk; two joining together: the first row
    # (lower slot) forwards its 4 tokens, the second takes the 2 left of the chunk's 6
    roomy = _engine(target, "dspark", num_slots=3, prefill_chunk=6, prefill_rows=2)
    assert roomy.buckets == roomy.priced_buckets and roomy.buckets[-1] == 3 * (G + 1) + 6
    st = roomy.init_state()
    st, ctl = roomy.start(st, ctl, [0], [prompts[1]], kd[:1], [60], [GREEDY], [[]])
    st, ctl = roomy.start(st, ctl, [1, 2], [prompts[3], prompts[8]], kd[1:], [10, 10], [GREEDY] * 2, [[], []])
    st, _ = roomy.step(st, ctl)
    assert (int(st.pos[1]), int(st.pos[2])) == (4, 2)


def test_with_chunk_room():
    """Doubling beyond the largest given bucket, then a full round plus a chunk; nothing added
    when the given buckets already have the room or chunks are off."""
    from dspark_jax.engine import with_chunk_room

    assert with_chunk_room((4, 8, 16, 32), 4, 7, 64) == (4, 8, 16, 32, 64, 96)
    assert with_chunk_room((3, 12), 3, 3, 10) == (3, 12, 22)
    assert with_chunk_room((4, 8, 16, 32, 96), 4, 7, 64) == (4, 8, 16, 32, 96)
    assert with_chunk_room((4, 8, 16, 32), 4, 7, 0) == (4, 8, 16, 32)


def test_bad_prefill_chunk_is_an_error(target):
    for bad, field in ((dict(prefill_chunk=0), "prefill_chunk"),
                       (dict(prefill_chunk=4, prefill_rows=0), "prefill_rows"),
                       (dict(prefill_chunk=-2), "prefill_chunk")):
        with pytest.raises(EngineError, match=field):
            _engine(target, "dspark", num_slots=2, **bad)
