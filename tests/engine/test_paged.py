"""Paged target KV cache (issue 16): reference paged attention, the host page allocator, the engine.

- paged attention == dense attention bit for bit (several page sizes, shuffled page tables,
  slots with fewer pages than positions), writes through the page table dropped where they must be;
- the allocator: no page owned twice, freed pages reused, pages in use = sum of ceil(tokens / size),
  all-or-nothing growth with a clear out-of-pages error;
- the engine with `kv_pages` gives the dense engine's tokens (greedy and sampled, target-only,
  DSpark, Eagle3 and MTP-1 with their caches paged too, host loop and while loop) with fewer pages
  than R * max_len / page_size, gives every page back when the requests end, and fails with the
  allocator's message when the pool is too small.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.engine import Engine, EngineConfig, EngineError, OutOfPagesError, PageAllocator, page_alloc
from dspark_jax.target.kv_cache import KVCache
from dspark_jax.target.layers import attention
from dspark_jax.target.paged_kv import NO_PAGE, PagedKVCache, gather_pages, paged_attention, pages_per_slot
from dspark_jax.testing.tiny import tiny_drafter

GREEDY = SamplingParams(0.0, 0, 1.0)
SAMPLED = SamplingParams(1.0, 0, 1.0)  # the tiny drafter's acceptance is highest here (tau about 2.3, greedy 1.1):
# the runs then cross page boundaries with accepted drafts, which is where a missing page would show
MAX_NEW = 12
R, S = 3, 40


# ------------------------------------------------------------------ paged attention (random data)


def _shuffled_table(rng, r, m, num_pages, owned):
    """Page table [r, m]: row i owns `owned[i]` distinct random pages of the pool, then NO_PAGE."""
    pages = rng.permutation(num_pages)
    table = np.full((r, m), NO_PAGE, np.int32)
    k = 0
    for i in range(r):
        table[i, : owned[i]] = pages[k: k + owned[i]]
        k += owned[i]
    return table


@pytest.mark.parametrize("page_size", [1, 4, 5, 16])
def test_paged_attention_equals_dense(page_size):
    rng = np.random.default_rng(page_size)
    r, s, t, nkv, g, d, layers = 3, 13, 4, 2, 2, 8, 2
    m = pages_per_slot(s, page_size)
    lengths = np.array([s, 6, 1])  # tokens each row holds: rows 1 and 2 own fewer pages than m
    owned = [-(-n // page_size) for n in lengths]
    num_pages = sum(owned) + 3  # spare pages: never read
    table = _shuffled_table(rng, r, m, num_pages, owned)
    cfg = type("Cfg", (), dict(num_layers=layers, num_kv_heads=nkv, head_dim=d))
    paged = PagedKVCache.create(cfg, r, s, num_pages, page_size).with_page_table(table)
    # garbage in the pool first (spare and not-yet-written pages), then every row's tokens written
    k_all = jnp.asarray(rng.normal(size=paged.k.shape), jnp.float32)
    v_all = jnp.asarray(rng.normal(size=paged.v.shape), jnp.float32)
    dense_k = rng.normal(size=(layers, r, s, nkv, d)).astype(np.float32)
    dense_v = rng.normal(size=(layers, r, s, nkv, d)).astype(np.float32)
    rows = np.arange(r)[:, None]
    pos = np.where(np.arange(s)[None] < lengths[:, None], np.arange(s)[None], s)  # beyond a row's tokens: padding
    for li in range(layers):
        k_all, v_all = paged.write_layer_at(k_all, v_all, li, rows, pos, dense_k[li], dense_v[li])
    q = jnp.asarray(rng.normal(size=(r, t, nkv * g, d)), jnp.float32)
    qpos = lengths[:, None] - t + np.arange(t)[None]  # the last t tokens of each row
    qpos = np.maximum(qpos, 0)
    mask = jnp.asarray(np.arange(s)[None, None] <= qpos[:, :, None])
    for li in range(layers):
        view = np.asarray(gather_pages(k_all[li], jnp.asarray(table), s))
        held = np.arange(s)[None] < lengths[:, None]
        np.testing.assert_array_equal(view[held], dense_k[li][held])
        want = attention(q, jnp.asarray(dense_k[li]), jnp.asarray(dense_v[li]), mask)
        got = paged_attention(q, k_all[li], v_all[li], jnp.asarray(table), mask)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        got2 = paged.attend_layer(q, k_all, v_all, li, mask, jnp.float32)
        np.testing.assert_array_equal(np.asarray(got2), np.asarray(want))
        # the dense cache's own method gives the same
        heads_major = [jnp.asarray(x).swapaxes(2, 3) for x in (dense_k, dense_v)]
        dense = KVCache(*heads_major, jnp.asarray(lengths), "reference")
        np.testing.assert_array_equal(np.asarray(dense.attend_layer(q, *heads_major, li, mask, jnp.float32)),
                                      np.asarray(want))
    # a jitted call traces the cache as a pytree (max_len static)
    f = jax.jit(lambda c, q: c.attend_layer(q, c.k, c.v, 0, mask, jnp.float32))
    np.testing.assert_array_equal(np.asarray(f(paged._replace(k=k_all, v=v_all), q)),
                                  np.asarray(attention(q, jnp.asarray(dense_k[0]), jnp.asarray(dense_v[0]), mask)))


def test_paged_writes_dropped_outside_pages():
    """Writes with no page behind them (padding rows, positions >= max_len or beyond a slot's
    pages) leave the pool as it was; the others land at (table[row, pos // ps], pos % ps)."""
    cfg = type("Cfg", (), dict(num_layers=1, num_kv_heads=1, head_dim=2))
    c = PagedKVCache.create(cfg, 2, 10, 6, 4).with_page_table(np.array([[5, 2, NO_PAGE], [0, NO_PAGE, NO_PAGE]]))
    assert c.page_table.shape == (2, 3) and c.page_size == 4 and c.num_pages == 6 and c.max_len == 10
    rows = np.array([0, 0, 0, 1, 1, 2, 0])
    pos = np.array([1, 6, 9, 3, 4, 0, 10])  # ok, ok, no page, ok, no page, padding row, >= max_len
    val = jnp.asarray(np.arange(1, 8, dtype=np.float32)[:, None, None] * np.ones((7, 1, 2), np.float32))
    k, _ = c.write_layer_at(c.k, c.v, 0, rows, pos, val, val)
    k = np.asarray(k[0, :, 0, :, 0])  # [pages, offset]
    want = np.zeros((6, 4), np.float32)
    want[5, 1], want[2, 2], want[0, 3] = 1, 2, 4
    np.testing.assert_array_equal(k, want)
    with pytest.raises(ValueError, match="page table of shape"):
        c.with_page_table(np.zeros((2, 4), np.int32))


# ------------------------------------------------------------------ allocator (numpy only)


def _check(al: PageAllocator, tokens: dict):
    owned = al.table[al.table != NO_PAGE]
    assert len(set(owned.tolist())) == owned.size  # no page owned twice
    assert al.pages_in_use == owned.size == sum(al.pages_for(n) for n in tokens.values())  # memory = pages in use
    assert sorted(owned.tolist() + al._free) == list(range(al.num_pages))  # every page free or owned, once
    for s in range(al.num_slots):  # a slot's pages are a prefix of its table row
        n = int(al.owned[s])
        assert (al.table[s, :n] >= 0).all() and (al.table[s, n:] == NO_PAGE).all()
    assert al.peak >= al.pages_in_use


def test_allocator_properties():
    assert page_alloc.NO_PAGE == NO_PAGE
    rng = np.random.default_rng(0)
    al = PageAllocator(num_pages=20, page_size=4, num_slots=4, max_pages_per_slot=6)
    tokens: dict[int, int] = {}
    errors = 0
    for _ in range(400):
        s = int(rng.integers(4))
        if rng.random() < 0.3:
            n_before = len(al.pages_of(s))
            assert al.release(s) == n_before
            tokens.pop(s, None)
        else:
            n = max(tokens.get(s, 0), int(rng.integers(0, 25)))
            snapshot = (al.table.copy(), al.pages_in_use)
            try:
                al.grow(s, n)
                tokens[s] = n
            except OutOfPagesError as e:  # all or nothing, and a message that says what to do
                errors += 1
                assert "out of KV cache pages" in str(e) and "kv_pages=" in str(e)
                assert (al.table == snapshot[0]).all() and al.pages_in_use == snapshot[1]
        _check(al, tokens)
    assert errors > 0 and al.peak == 20
    al.release_many(range(4))
    assert al.pages_in_use == 0 and al.free_pages == 20
    with pytest.raises(ValueError, match="more than the 6 pages"):
        al.grow(0, 25)
    with pytest.raises(ValueError, match="outside"):
        al.release(4)
    assert al.grow(1, 0) == 0 and al.grow(1, 4) == 1 and al.grow(1, 3) == 0  # never shrinks
    al.reset()
    assert al.pages_in_use == 0 and al.peak == 0 and (al.table == NO_PAGE).all()


def test_allocator_reuses_freed_pages():
    al = PageAllocator(num_pages=6, page_size=4, num_slots=3, max_pages_per_slot=3)
    al.grow(0, 8)
    al.grow(1, 1)
    assert al.pages_of(0) == [0, 1] and al.pages_of(1) == [2]
    al.release(0)
    al.grow(2, 12)
    assert al.pages_of(2) == [0, 1, 3]  # the freed pages first, in their order
    assert al.peak == 4 and al.pages_in_use == 4


def test_allocator_grow_many_all_or_nothing():
    al = PageAllocator(num_pages=5, page_size=2, num_slots=3, max_pages_per_slot=4)
    al.grow(0, 4)  # 2 pages
    with pytest.raises(OutOfPagesError, match=r"slot\(s\) \[1, 2\] need 4 more page\(s\) of 2 tokens, but only 3 of 5"):
        al.grow_many({1: 3, 2: 4})
    assert al.pages_in_use == 2 and al.owned.tolist() == [2, 0, 0]
    assert al.grow_many({1: 3, 2: 1}) == 3 and al.free_pages == 0


# ------------------------------------------------------------------ engine


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 15, n).tolist() for n in (3, 9, 17, 5, 2)]


SEEDS = [1, 2, 3, 4, 5]


def _run(eng, prompts, sampling, **kw):
    res = eng.generate(prompts, max_new_tokens=MAX_NEW, sampling=sampling, seed=SEEDS, **kw)
    return [r.tokens for r in res.results]


@pytest.fixture(scope="module")
def dense_ar(target, prompts):
    eng = Engine(target, None, EngineConfig(policy="fixed",
                                            num_slots=R, max_len=S, buckets=(R,), prefill_buckets=(20,)))
    return {"greedy": _run(eng, prompts, GREEDY), "sampled": _run(eng, prompts, SAMPLED)}


def test_engine_paged_target_only(target, prompts, dense_ar):
    """16 pages of 4 tokens (the dense cache is R * S / 4 = 30 pages): the dense tokens, greedy
    and sampled, and every page back in the pool when the requests are done."""
    eng = Engine(target, None, EngineConfig(policy="fixed",
                                            num_slots=R, max_len=S, buckets=(R,), prefill_buckets=(20,), kv_pages=(16,
                                                                                                                   4)))
    assert isinstance(eng.init_state().cache, PagedKVCache)
    assert _run(eng, prompts, GREEDY) == dense_ar["greedy"]
    assert 0 < eng.pages.peak <= 16 < R * S // 4 and eng.pages.pages_in_use == 0
    assert _run(eng, prompts, SAMPLED) == dense_ar["sampled"]
    assert eng.compiled_rounds() == 1
    # short requests: pages in use follow the tokens held (3 slots x at most 2 pages of 4)
    short = [[1, 2], [3], [4, 5, 6]]
    res = eng.generate(short, max_new_tokens=3, sampling=GREEDY)
    assert all(len(r.tokens) == 3 for r in res.results)
    assert eng.pages.peak <= 3 * 2 and eng.pages.pages_in_use == 0


def test_engine_paged_dspark(target, prompts, dense_ar):
    """DSpark drafter (gamma 3), paged target KV with 40 pages of 2 (dense: 60): the dense engine's greedy
    tokens (= the target's, test_greedy.py) and its sampled tokens for the same seeds, host loop
    and while loop (which reserves each request's pages up front)."""
    d = tiny_drafter("dspark", target, gamma=3)
    kw = dict(num_slots=R, max_len=S, buckets=(R * 4,), prefill_buckets=(20,))
    dense = Engine(target, d, EngineConfig(**{"policy": "fixed", **kw}))
    paged = Engine(target, d, EngineConfig(kv_pages=(40, 2), **{"policy": "fixed", **kw}))
    assert _run(paged, prompts, GREEDY) == dense_ar["greedy"]
    assert paged.pages.peak <= 40 < R * S // 2 and paged.pages.pages_in_use == 0
    want = _run(dense, prompts, SAMPLED)
    assert _run(paged, prompts, SAMPLED) == want
    assert _run(paged, prompts, SAMPLED, loop="while") == want
    assert paged.pages.pages_in_use == 0 and paged.compiled_rounds() == 1


@pytest.mark.parametrize("kind", ["eagle3", "mtp1"])
def test_engine_paged_recurrent_drafters(target, prompts, kind):
    """Eagle3 and MTP-1 keep a one-layer cache of their own, paged with the target's page table:
    the dense engine's sampled tokens for the same seeds, every page back at the end."""
    d = tiny_drafter(kind, target, gamma=3)
    g = 1 if kind == "mtp1" else 3
    kw = dict(num_slots=R, max_len=S, buckets=(R * (g + 1),), prefill_buckets=(20,),
              **(dict(gamma=3, layer_ids=[0]) if kind == "eagle3" else {}))
    want = _run(Engine(target, d, EngineConfig(**{"policy": "fixed", **kw})), prompts, SAMPLED)
    paged = Engine(target, d, EngineConfig(kv_pages=(40, 2), **{"policy": "fixed", **kw}))
    st = paged.init_state()
    assert isinstance(st.dcache, PagedKVCache) and st.dcache.k.shape[:2] == (1, 40) and st.dcache.page_size == 2
    assert _run(paged, prompts, SAMPLED) == want
    assert paged.pages.pages_in_use == 0 and 0 < paged.pages.peak <= 40


def test_engine_waits_for_pages(target, prompts, dense_ar):
    """A pool that holds one or two requests' reach at a time, not three: requests wait for pages
    (first come, first served) instead of failing, and each still gets its dense tokens (a
    request's randomness does not depend on its batch)."""
    eng = Engine(target, None, EngineConfig(policy="fixed",
                                            num_slots=R, max_len=S, buckets=(R,), prefill_buckets=(20,), kv_pages=(8,
                                                                                                                   4)))
    reach = [eng.pages_to_reserve(len(p), MAX_NEW) for p in prompts]
    assert max(reach) <= 8 < sum(sorted(reach)[:3])  # never 3 at once
    assert eng.pages.admits([min(len(p) + MAX_NEW, S) for p in prompts[:3]], 0) < 3
    for loop in ("host", "while"):
        assert _run(eng, prompts, GREEDY, loop=loop) == dense_ar["greedy"]
        assert eng.pages.peak <= 8 and eng.pages.pages_in_use == 0


def test_engine_out_of_pages(target, prompts):
    """A request larger than the whole pool fails before anything runs, saying what to change;
    the allocator itself refuses growth beyond the free pages (all or nothing)."""
    eng = Engine(target, None, EngineConfig(policy="fixed",
                                            num_slots=R, max_len=S, buckets=(R,), prefill_buckets=(20,), kv_pages=(3,
                                                                                                                   4)))
    with pytest.raises(OutOfPagesError, match="more than the whole pool of 3.*kv_pages=\\(num_pages, page_size\\)"):
        eng.generate(prompts, max_new_tokens=MAX_NEW, sampling=GREEDY)
    assert eng.round_calls == 0
    with pytest.raises(EngineError, match="kv_pages must be"):
        Engine(target, None, EngineConfig(policy="fixed", num_slots=R, max_len=S, kv_pages=4))
    with pytest.raises(EngineError, match="page_size >= 1"):
        Engine(target, None, EngineConfig(policy="fixed", num_slots=R, max_len=S, kv_pages=(4, 0)))


# ------------------------------------------------------------------ compiled memory, kernel contract


@pytest.mark.parametrize("kind", [None, "dspark"])
def test_round_memory_paged_vs_dense(target, kind):
    """XLA's memory analysis of one compiled round, 4 slots x 256 positions, target-only and with
    a DSpark drafter: with 16 pages of 16 (a quarter of the dense caches' 64) the round's arguments
    shrink by exactly the cache bytes saved, the drafter's cache included. The reference paged
    attention still gathers each layer's [R, S] view, so the temporaries stay those of the dense
    round (reading pages in place needs a kernel)."""
    import functools

    from dspark_jax.engine.round import round_step

    d = None if kind is None else tiny_drafter(kind, target, gamma=3)
    out = {}
    for kv in (None, (16, 16)):
        g = 0 if d is None else 3
        eng = Engine(target, d, EngineConfig(policy="fixed",
                                             num_slots=4, max_len=256, buckets=(4 * (g + 1),), prefill_buckets=(16,),
                                             kv_pages=kv))
        st, ctl = eng.init_state(), eng.control()
        m = jax.jit(functools.partial(round_step, eng.spec), donate_argnums=(2,)).lower(
            eng.tp, eng.dp, st, ctl).compile().memory_analysis()
        caches = sum(x.nbytes for x in jax.tree.leaves((st.cache, st.dcache)))
        dcache = sum(x.nbytes for x in jax.tree.leaves(st.dcache))
        out[kv] = (caches, dcache, m.argument_size_in_bytes, m.temp_size_in_bytes)
    (c_d, dc_d, a_d, t_d), (c_p, dc_p, a_p, t_p) = out[None], out[(16, 16)]
    assert c_p < c_d / 3 and a_d - a_p == c_d - c_p
    if d is not None:
        assert dc_p < dc_d / 3  # the drafter's cache is paged too
    assert t_p <= 1.1 * t_d + 4096


def test_paged_layout_matches_ragged_kernel_contract():
    """The page table / positions convention is the one of JAX's TPU ragged paged-attention kernel
    (`jax.experimental.pallas.ops.tpu.ragged_paged_attention`): its pure-JAX reference, fed the
    packed queries of a verification (row r: 1 + l_r queries ending at its kv length), the pages
    with K / V interleaved on the head axis and our page table, gives `paged_attention`'s rows.
    (The kernel itself does not run in Pallas interpret mode on CPU in jax 0.10.2.)"""
    rpa = pytest.importorskip("jax.experimental.pallas.ops.tpu.ragged_paged_attention")
    rng = np.random.default_rng(1)
    r, s, ps, nkv, g, d = 3, 24, 4, 2, 2, 8
    m = pages_per_slot(s, ps)
    pos = np.array([5, 0, 13])  # committed tokens (the anchor's position)
    l = np.array([3, 2, 0])  # drafts verified
    kv_len = pos + l + 1
    owned = [-(-int(n) // ps) for n in kv_len]
    table = _shuffled_table(rng, r, m, sum(owned) + 2, owned)
    k_pages = jnp.asarray(rng.normal(size=(sum(owned) + 2, nkv, ps, d)), jnp.float32)
    v_pages = jnp.asarray(rng.normal(size=k_pages.shape), jnp.float32)
    t = int(l.max()) + 1
    q = jnp.asarray(rng.normal(size=(r, t, nkv * g, d)), jnp.float32)
    qpos = pos[:, None] + np.arange(t)[None]
    mask = jnp.asarray(np.arange(s)[None, None] <= qpos[:, :, None])
    ours = np.asarray(paged_attention(q, k_pages, v_pages, jnp.asarray(table), mask))
    valid = np.arange(t)[None] <= l[:, None]
    packed = jnp.asarray(np.asarray(q)[valid])  # [sum(1 + l_r), Nq, D], row-major like verify's packing
    combined = jnp.stack([k_pages, v_pages], axis=2).transpose(0, 3, 1, 2, 4).reshape(k_pages.shape[0], ps, 2 * nkv, d)
    cu = np.concatenate([[0], np.cumsum(l + 1)]).astype(np.int32)
    theirs = rpa.ref_ragged_paged_attention(packed, combined, jnp.asarray(kv_len, jnp.int32),
                                            jnp.asarray(np.maximum(table, 0)), jnp.asarray(cu),
                                            jnp.asarray([r], jnp.int32), sm_scale=d ** -0.5)
    np.testing.assert_allclose(np.asarray(theirs), ours[valid], rtol=1e-5, atol=1e-5)
