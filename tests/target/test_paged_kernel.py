"""The Pallas paged-attention kernel (target/paged_kernel.py) in interpret mode against the
reference (gather the row's pages, dense attention): shuffled page tables, rows with fewer pages
than positions and with no visible key, queries at several positions, a layer of the whole pool
read in place, split query blocks and head blocks, the merge with a block of new keys, the kernel
per shard on a mesh, and the engine's verification through it."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.target.layers import attention, attention_parts
from dspark_jax.target.paged_kernel import (
    attention_lse,
    merge_parts,
    paged_attention_lse,
    resolve_impl,
)
from dspark_jax.target.paged_kv import NO_PAGE, gather_pages, pages_per_slot


def _case(rng, page_size, r=4, s=13, t=3, nkv=2, g=2, d=8, layers=1):
    m = pages_per_slot(s, page_size)
    kv_len = np.array([s, 6, 0, 3])[:r]  # row 2 sees no key at all
    owned = [-(-int(n) // page_size) for n in kv_len]
    num_pages = sum(owned) + 2  # spare pages hold garbage that must never be read
    perm = rng.permutation(num_pages)
    table = np.full((r, m), NO_PAGE, np.int32)
    k = 0
    for i, n in enumerate(owned):
        table[i, :n] = perm[k: k + n]
        k += n
    pool = lambda: jnp.asarray(rng.normal(size=(layers, num_pages, nkv, page_size, d)), jnp.float32)
    q = jnp.asarray(rng.normal(size=(r, t, nkv * g, d)), jnp.float32)
    q_start = np.array([s - t, 4, 0, 1])[:r]  # query t of row r sits at q_start[r] + t
    return q, pool(), pool(), table, kv_len, q_start


def _reference_mask(kv_len, q_start, s, t):
    pos = np.arange(s)
    qpos = q_start[:, None] + np.arange(t)[None]
    return (pos[None, None] < kv_len[:, None, None]) & (pos[None, None] <= qpos[:, :, None])


@pytest.mark.parametrize("page_size", [1, 4, 5])
def test_kernel_equals_gathered_attention(page_size):
    rng = np.random.default_rng(page_size)
    q, kp, vp, table, kv_len, q_start = _case(rng, page_size, layers=2)
    s, t = 13, q.shape[1]
    mask = _reference_mask(kv_len, q_start, s, t)
    for layer in (0, 1):
        out, lse = paged_attention_lse(q, kp, vp, jnp.asarray(table), jnp.asarray(kv_len), jnp.asarray(q_start),
                                       layer=layer)
        k, v = (gather_pages(x[layer], jnp.asarray(table), s) for x in (kp, vp))
        want = np.asarray(attention(q, k, v, jnp.asarray(mask)))
        _, want_lse = attention_lse(q, k, v, jnp.asarray(mask))
        seen = mask.any(-1)  # [R, T]: queries that see a key
        np.testing.assert_allclose(np.asarray(out)[seen], want[seen], rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(np.asarray(lse)[seen], np.asarray(want_lse)[seen], rtol=2e-5, atol=2e-5)
        assert (np.asarray(out)[~seen] == 0).all() and seen.sum() < seen.size  # row 2: nothing seen, output 0
    # one layer's pages [P, Nkv, ps, D] without the layer axis: the same
    out0, _ = paged_attention_lse(q, kp[0], vp[0], jnp.asarray(table), jnp.asarray(kv_len), jnp.asarray(q_start))
    out_l0, _ = paged_attention_lse(q, kp, vp, jnp.asarray(table), jnp.asarray(kv_len), jnp.asarray(q_start), layer=0)
    np.testing.assert_array_equal(np.asarray(out0), np.asarray(out_l0))


def test_query_blocks_and_head_blocks(monkeypatch):
    """Long query blocks are split (and padded) and KV heads taken one per step when a step would
    hold too many rows (a long prefill chunk): the same numbers, here with blocks of 8 rows."""
    import dspark_jax.target.paged_kernel as pk

    monkeypatch.setattr(pk, "QUERY_BLOCK", 8)  # 7 queries x 2 heads = 14 rows: 2 blocks, 2 padding rows
    monkeypatch.setattr(pk, "MAX_ROWS_PER_STEP", 8)  # one KV head per step
    assert pk._tiling(14, 2, 4, 4, 8) == (8, 16, 1, 4)
    rng = np.random.default_rng(11)
    q, kp, vp, table, kv_len, q_start = _case(rng, 4, t=7)
    mask = _reference_mask(kv_len, q_start, 13, 7)
    out, lse = paged_attention_lse(q, kp, vp, jnp.asarray(table), jnp.asarray(kv_len), jnp.asarray(q_start), layer=0)
    k, v = (gather_pages(x[0], jnp.asarray(table), 13) for x in (kp, vp))
    want, want_lse = attention_lse(q, k, v, jnp.asarray(mask))
    seen = mask.any(-1)
    np.testing.assert_allclose(np.asarray(out)[seen], np.asarray(want)[seen], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(lse)[seen], np.asarray(want_lse)[seen], rtol=2e-5, atol=2e-5)
    assert (np.asarray(out)[~seen] == 0).all()


def test_merge_with_a_block_equals_one_softmax():
    """Committed keys from the pages plus a block of new keys, merged through their log-sum-exp,
    equal `attention_parts` over both (what the verification computes)."""
    rng = np.random.default_rng(7)
    q, kp, vp, table, kv_len, _ = _case(rng, 4)
    r, t, _nq, d = q.shape
    start = kv_len  # the verification: every committed key visible to every query of the block
    kb = jnp.asarray(rng.normal(size=(r, t, 2, d)), jnp.float32)
    vb = jnp.asarray(rng.normal(size=(r, t, 2, d)), jnp.float32)
    causal = jnp.asarray(np.broadcast_to(np.tril(np.ones((t, t), bool)), (r, t, t)))
    got = merge_parts([paged_attention_lse(q, kp, vp, jnp.asarray(table), jnp.asarray(start), jnp.asarray(start),
                                           layer=0), attention_lse(q, kb, vb, causal)])
    k, v = (gather_pages(x[0], jnp.asarray(table), 13) for x in (kp, vp))
    before = jnp.asarray(np.broadcast_to(np.arange(13)[None, None] < start[:, None, None], (r, t, 13)))
    want = attention_parts(q, [(k, v, before), (kb, vb, causal)])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_a_kernel_that_ignores_the_page_table_is_caught():
    """The comparison above catches a kernel reading pages in pool order instead of the table's."""
    rng = np.random.default_rng(3)
    q, kp, vp, table, kv_len, q_start = _case(rng, 4)
    in_order = np.where(table >= 0, np.arange(table.size).reshape(table.shape) % kp.shape[1], NO_PAGE)
    out, _ = paged_attention_lse(q, kp, vp, jnp.asarray(in_order.astype(np.int32)), jnp.asarray(kv_len),
                                 jnp.asarray(q_start), layer=0)
    k, v = (gather_pages(x[0], jnp.asarray(table), 13) for x in (kp, vp))
    want = np.asarray(attention(q, k, v, jnp.asarray(_reference_mask(kv_len, q_start, 13, q.shape[1]))))
    assert not np.allclose(np.asarray(out)[0], want[0], atol=1e-3)


MESH_CODE = r"""
import json, numpy as np, jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from dspark_jax.parallel.sharding import make_mesh
from dspark_jax.target.paged_kernel import paged_attention_lse
from dspark_jax.target.paged_kv import NO_PAGE
rng = np.random.default_rng(0)
r, t, nkv, g, d, ps, pages = 4, 3, 2, 2, 8, 4, 16
q = rng.normal(size=(r, t, nkv * g, d)).astype(np.float32)
k, v = (rng.normal(size=(2, pages, nkv, ps, d)).astype(np.float32) for _ in range(2))
table = rng.permutation(pages)[: r * 4].reshape(r, 4).astype(np.int32)
table[1, 2:] = NO_PAGE
kv_len, q_start = np.array([13, 6, 0, 9], np.int32), np.array([10, 4, 0, 2], np.int32)
f = jax.jit(lambda *a: paged_attention_lse(*a, layer=1))
want = f(q, k, v, table, kv_len, q_start)
mesh = make_mesh(2, 1, 2)
with jax.set_mesh(mesh):
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
    args = (put(q, "data", None, "tensor"), put(k, None, None, "tensor"), put(v, None, None, "tensor"),
            put(table, "data"), put(kv_len, "data"), put(q_start, "data"))
    got = f(*args)
    text = f.lower(*args).as_text()
err = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(got, want))
# with own keys and raw queries prepared in the kernel: their inputs split as the queries' rows and heads
from dspark_jax.target.own_keys import OwnKeys
from dspark_jax.target.query_prep import QueryPrep
ko, vo = (rng.normal(size=(r, t, nkv, d)).astype(np.float32) for _ in range(2))
own_len = np.array([3, 1, 0, 2], np.int32)
cos, sin = (rng.uniform(-1, 1, size=(r, t, d)).astype(np.float32) for _ in range(2))
norm = rng.uniform(0.5, 1.5, size=(d,)).astype(np.float32)
g = jax.jit(lambda q, k, v, tb, kl, qs, ko, vo, ol, c, s, n: paged_attention_lse(
    q, k, v, tb, kl, qs, layer=1, own=OwnKeys(ko, vo, ol), q_prep=QueryPrep(n, c, s)))
want_own = g(q, k, v, table, kv_len, q_start, ko, vo, own_len, cos, sin, norm)
with jax.set_mesh(mesh):
    got_own = g(*args, put(ko, "data", None, "tensor"), put(vo, "data", None, "tensor"), put(own_len, "data"),
                put(cos, "data"), put(sin, "data"), put(norm))
err_own = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(got_own, want_own))
print(json.dumps({"err": err, "err_own": err_own, "per_shard": "manual_computation" in text,
                  "out_spec": str(got[0].sharding.spec)}))
"""


def test_kernel_per_shard_on_a_mesh():
    """On a mesh (4 fake CPU devices: rows over data 2, KV heads over tensor 2) the kernel runs per
    shard through shard_map and gives the single-device numbers, also with own keys and raw
    queries prepared in the kernel."""
    import json

    from tests.conftest import run_multidevice

    res = json.loads(run_multidevice(MESH_CODE, n=4).strip().splitlines()[-1])
    assert res["per_shard"] and res["err"] < 1e-6 and res["err_own"] < 1e-5, res
    assert res["out_spec"] == "P('data', None, 'tensor')", res  # out [R, T, Nq, D]: rows and heads split


def test_resolve_impl():
    assert resolve_impl("auto") == "reference"  # these tests run on CPU
    assert resolve_impl("pallas") == "pallas"
    with pytest.raises(ValueError, match="not one of"):
        resolve_impl("flash")


def test_target_prefill_through_the_kernel():
    """The target's forward over a paged cache (a prompt chunk, then a second chunk after it)
    reads the pages through the kernel when the cache says "pallas": its logits equal the
    reference's."""
    from dspark_jax.target.paged_kv import PagedKVCache
    from dspark_jax.testing.tiny import tiny_config, tiny_target

    target = tiny_target(tiny_config(vocab_size=32, hidden_size=32, num_layers=2), logit_scale=1.0)
    table = np.array([[4, 0, 7, NO_PAGE], [2, 5, 1, 3]], np.int32)
    out = {}
    for impl in ("reference", "pallas"):
        cache = PagedKVCache.create(target.cfg, 2, 16, 8, 4, impl=impl).with_page_table(table)
        logits = []
        for start, n in ((0, 6), (6, 3)):
            toks = jnp.asarray(np.random.default_rng(start).integers(0, 32, (2, n)))
            pos = jnp.broadcast_to(jnp.arange(start, start + n, dtype=jnp.int32), (2, n))
            fo = target(toks, positions=pos, valid=jnp.ones((2, n), bool), cache=cache)
            cache = fo.cache.with_lengths(jnp.full((2,), start + n, jnp.int32))
            logits.append(np.asarray(fo.logits))
        out[impl] = logits
    for a, b in zip(out["reference"], out["pallas"]):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)


def test_engine_verification_through_the_kernel():
    """The engine with paged KV read by the kernel (interpret mode: prefill, verification and
    the drafters' cached attention) gives the dense engine's greedy tokens, target-only and with
    DSpark, Eagle3 and MTP-1 drafters."""
    from dspark_jax.decoding.sampling import SamplingParams
    from dspark_jax.engine import Engine, EngineConfig, EngineError
    from dspark_jax.testing.tiny import tiny_config, tiny_drafter, tiny_target

    target = tiny_target(tiny_config(vocab_size=16, hidden_size=32, num_layers=2), logit_scale=1.0)

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 15, n).tolist() for n in (3, 9, 17, 5)]
    greedy = SamplingParams(0.0, 0, 1.0)
    for kind in (None, "dspark", "eagle3", "mtp1"):
        d = None if kind is None else tiny_drafter(kind, target, gamma=3)
        assert kind != "dspark" or d.dcfg.sliding_window is None  # (a window falls back to the gather)
        g = {None: 0, "mtp1": 1}.get(kind, 3)
        kw = dict(num_slots=2, max_len=40, buckets=(2 * (g + 1),), prefill_buckets=(20,), policy="fixed",
                  **({"gamma": 3, "layer_ids": [0]} if kind == "eagle3" else {}))
        want = [r.tokens for r in Engine(target, d, EngineConfig(**kw)).generate(prompts, max_new_tokens=10,
                                                                                 sampling=greedy).results]
        eng = Engine(target, d, EngineConfig(kv_pages=(24, 4), paged_attention="pallas", **kw))
        st = eng.init_state()
        assert st.cache.impl == "pallas" and (kind is None or st.dcache.impl == "pallas")
        got = [r.tokens for r in eng.generate(prompts, max_new_tokens=10, sampling=greedy).results]
        assert got == want
    with pytest.raises(EngineError, match="not one of"):
        EngineConfig(policy="fixed", num_slots=2, max_len=40, kv_pages=(24, 4), paged_attention="flash")
