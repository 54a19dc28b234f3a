"""What the engine remembers between rounds and reports at the end, checked against what it
should be: the drafter's cache equals a fresh prefill of the committed sequence (every kind,
with and without skipped rounds); tau counts only kept tokens and rounds cut by a stop token or
max_new are marked; every request says why it ended."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.scheduler import prefix as scheduler
from dspark_jax.target.paged_kv import PagedKVCache
from dspark_jax.testing.tiny import tiny_drafter

GREEDY = SamplingParams(0.0, 0, 1.0)
G = 3


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 15, n).tolist() for n in (3, 9, 17, 5, 2, 7, 4, 11)]


def _engine(target, kind, **kw):
    d = tiny_drafter(kind, target, gamma=G)
    lk = dict(gamma=G, layer_ids=[0]) if kind == "eagle3" else {}
    g = 1 if kind == "mtp1" else G
    config = EngineConfig(num_slots=2, max_len=64, buckets=(2, 2 * (g + 1)), prefill_buckets=(16, 64), **lk,
                          **{"policy": "fixed", **kw})
    return Engine(target, d, config)


def _dense(cache):
    """(k, v) [L, R, S, ...] of a dense or paged cache."""
    return cache.dense()


def _rows_equal(a, b, lengths, what):
    """Cache arrays [L, R, S, ...] equal at every row's positions < lengths[row]."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    for r, n in enumerate(np.asarray(lengths)):
        np.testing.assert_allclose(a[:, r, :n], b[:, r, :n], atol=2e-4, rtol=2e-4, err_msg=f"{what} row {r}")


@pytest.mark.parametrize("skip,paged", [(False, False), (True, False), (True, True)],
                         ids=["drafting", "skipped_rounds", "skipped_rounds_paged"])
@pytest.mark.parametrize("kind", ["dspark", "eagle3", "mtp1"])  # dflash: dspark's block kind, the same cache code
def test_drafter_cache_equals_a_fresh_prefill_of_the_committed_sequence(target, prompts, kind, skip, paged):
    """`paged`: target and drafter caches in pages of 4 (a pool of 40, shuffled by a slot that
    held pages first) instead of dense; compared through each row's view."""
    eng = _engine(target, kind, skip_drafting="best_case" if skip else False, kv_pages=(40, 4) if paged else None)
    pays = scheduler.make_table(eng.buckets, t_verify=(1.0, 1.0), t_draft=0.0)
    never = scheduler.make_table(eng.buckets, t_verify=(1.0, 1.0), t_draft=50.0)  # drafting costs 50 steps
    kd = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(0), 2)))
    st = eng.init_state()
    if paged:  # slot 1 takes the first pages, then gives them back: slot 0's pages are not 0, 1, 2, ...
        st = eng._paging.update(st, grow={1: 9})
        st = eng._paging.update(st, release=[1])
    st = eng.prefill_slots(st, [0, 1], prompts[:2], kd, [40, 40])
    if paged:
        assert isinstance(st.dcache, PagedKVCache) and isinstance(st.cache, PagedKVCache)
        np.testing.assert_array_equal(np.asarray(st.dcache.page_table), np.asarray(st.cache.page_table))
    skipped = 0
    for i in range(7):
        table = never if skip and i % 3 != 0 else pays
        st, ro = eng.step(st, eng.control(GREEDY, table=table if skip else None))
        skipped += int((np.asarray(ro.lengths) == 0).all() and (np.asarray(ro.z) == 0).all())
    assert skipped == (4 if skip else 0)
    assert np.asarray(st.active).all()
    n_gen, out, pos = np.asarray(st.n_gen), np.asarray(st.out), np.asarray(st.pos)
    committed = [p + out[r, : n_gen[r]].tolist() for r, p in enumerate(prompts[:2])]
    assert [len(c) - 1 for c in committed] == pos.tolist()

    fresh = eng.prefill_slots(eng.init_state(), [0, 1], committed, kd, [40, 40])
    np.testing.assert_array_equal(np.asarray(st.dcache.lengths), np.asarray(fresh.dcache.lengths))
    (dk, dv), (fk, fv) = _dense(st.dcache), _dense(fresh.dcache)
    _rows_equal(dk, fk, fresh.dcache.lengths, "drafter K")
    _rows_equal(dv, fv, fresh.dcache.lengths, "drafter V")
    np.testing.assert_allclose(np.asarray(st.last, np.float32), np.asarray(fresh.last, np.float32),
                               atol=2e-4, rtol=2e-4)
    _rows_equal(_dense(st.cache)[0], _dense(fresh.cache)[0], pos, "target K")


def test_tau_counts_kept_tokens_and_cut_rounds_are_marked(target, prompts):
    """max_new 5 with gamma 3: final rounds verify more than they may keep. Every request's tokens
    are accepted + rounds (tau = kept tokens per round); the cut rounds are marked and never
    `full` (STS does not read their discarded drafts as rejections)."""
    eng = _engine(target, "dspark")
    cuts = 0
    for max_new in (1, 2, 3, 5):
        # T = 1 on these flat distributions: most drafts are accepted, so final rounds overshoot
        res = eng.generate(prompts, max_new_tokens=max_new, sampling=SamplingParams(1.0, 0, 1.0), traces=True)
        for r in res.results:
            assert len(r.tokens) == max_new and r.finish_reason == "length"
            assert r.accepted + r.rounds == len(r.tokens), r
        tr = res.traces.arrays()
        assert not (tr["cut"] & tr["full"]).any()
        cuts += int(tr["cut"].sum())
        total = sum(len(r.tokens) for r in res.results)
        assert res.tau == pytest.approx(total / sum(r.rounds for r in res.results))
    assert cuts >= 8  # rounds whose accepted drafts max_new threw away (they used to count in tau)


def test_stop_cut_rounds_and_finish_reasons(target, prompts):
    eng = _engine(target, "dspark")
    free = eng.generate(prompts[:2], max_new_tokens=12, sampling=GREEDY).results
    stop = free[0].tokens[4]  # request 0 stops at its fifth token
    res = eng.generate(prompts[:2], max_new_tokens=12, sampling=GREEDY, stop_ids=[stop], traces=True)
    r0 = res.results[0]
    assert r0.finish_reason == "stop" and r0.tokens == free[0].tokens[: free[0].tokens.index(stop) + 1]
    for r in res.results:
        assert r.accepted + r.rounds == len(r.tokens)
    tr = res.traces.arrays()
    assert not (tr["cut"] & tr["full"]).any()

    # a slot whose context fills before max_new: ends early and says so
    short = Engine(target, tiny_drafter("dspark", target, gamma=G),
                   EngineConfig(policy="fixed", num_slots=2, max_len=24, prefill_buckets=(24,)))
    res = short.generate([prompts[2], prompts[0]], max_new_tokens=40, sampling=GREEDY)
    assert res.results[0].finish_reason == "context" and len(res.results[0].tokens) < 40
    assert res.results[1].finish_reason == "context"
    res = short.generate([prompts[0]], max_new_tokens=3, sampling=GREEDY)
    assert res.results[0].finish_reason == "length" and len(res.results[0].tokens) == 3


def test_per_request_settings_equal_each_request_alone(target, prompts):
    """Sampling, stop ids, max_new and seed per request, 5 requests refilling 2 slots: each
    request's output equals running it alone with its own settings (greedy and sampled rows in
    the same rounds; a slot's settings change when it takes the next request)."""
    eng = _engine(target, "dspark")
    ps = prompts[:5]
    samp = [GREEDY, SamplingParams(1.0, 0, 1.0), SamplingParams(0.7, 3, 1.0), SamplingParams(0.8, 0, 0.6), GREEDY]
    alone0 = eng.generate(ps[:1], max_new_tokens=12, sampling=GREEDY).results[0].tokens
    stops = [[alone0[3]], [], [], [], [15, 14]]
    max_new = [12, 7, 9, 4, 10]
    seeds = [0, 1, 2, 3, 4]
    res = eng.generate(ps, max_new_tokens=max_new, sampling=samp, stop_ids=stops, seed=seeds)
    for i, r in enumerate(res.results):
        one = eng.generate([ps[i]], max_new_tokens=max_new[i], sampling=samp[i], stop_ids=stops[i], seed=seeds[i],
                           sample_index=[i]).results[0]
        assert r.tokens == one.tokens and r.finish_reason == one.finish_reason, i
        assert len(r.tokens) <= max_new[i]
    assert res.results[0].finish_reason == "stop" and res.results[0].tokens[-1] == alone0[3]
    assert res.results[1].finish_reason == "length" and len(res.results[1].tokens) == 7
    # the sampled requests really are sampled: another seed changes request 1
    other = eng.generate([ps[1]], max_new_tokens=7, sampling=samp[1], seed=99, sample_index=[1]).results[0]
    assert other.tokens != res.results[1].tokens
    with pytest.raises(Exception, match="max_new_tokens: 2 values for 5 prompts"):
        eng.generate(ps, max_new_tokens=[3, 4])
