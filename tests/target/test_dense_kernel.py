"""The Pallas kernel reading the dense heads-major cache (`paged_kernel.dense_attention_lse`) in
interpret mode against the reference (the row's keys, dense attention): rows that see all, some
or none of their keys, queries at several positions, a cache length that is not a whole number of
the kernel's blocks (the last block runs past the cache end), chosen rows (a prefill chunk's
slots), and the merge with a block of new keys; and the backend choice itself."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.target.attention_backend import AttentionBackend, attention_backend
from dspark_jax.target.kv_cache import KVCache
from dspark_jax.target.layers import attention, attention_parts
from dspark_jax.target.own_keys import OwnKeys
from dspark_jax.target.paged_kernel import attention_lse, dense_attention_lse, merge_parts


def _case(rng, s, r=4, t=3, nkv=2, g=2, d=8, layers=2):
    cache = lambda: jnp.asarray(rng.normal(size=(layers, r, nkv, s, d)), jnp.float32)
    q = jnp.asarray(rng.normal(size=(r, t, nkv * g, d)), jnp.float32)
    kv_len = np.array([s, 6, 0, s - 1])[:r]  # row 2 sees no key at all
    q_start = np.array([s - t, 4, 0, 1])[:r]
    return q, cache(), cache(), kv_len, q_start


def _mask(kv_len, q_start, s, t):
    pos = np.arange(s)
    qpos = q_start[:, None] + np.arange(t)[None]
    return (pos[None, None] < kv_len[:, None, None]) & (pos[None, None] <= qpos[:, :, None])


def _keys(x, layer, rows=None):
    view = x[layer] if rows is None else x[layer][rows]
    return view.swapaxes(1, 2)  # [R, S, Nkv, D]


@pytest.mark.parametrize("s", [13, 160, 300])  # one whole block; 128 + a partial one; 2 blocks + a partial one
def test_dense_kernel_equals_reference(s):
    rng = np.random.default_rng(s)
    q, k, v, kv_len, q_start = _case(rng, s)
    k = k.at[:, :, :, 200:].set(jnp.nan) if s > 200 else k  # beyond every row's kv_len: never read into a result
    v = v.at[:, :, :, 200:].set(jnp.inf) if s > 200 else v
    kv_len = np.minimum(kv_len, 200)
    mask = _mask(kv_len, q_start, s, q.shape[1])
    seen = mask.any(-1)
    for layer in (0, 1):
        out, lse = dense_attention_lse(q, k, v, jnp.asarray(kv_len), jnp.asarray(q_start), layer=layer)
        kr, vr = _keys(k, layer), _keys(v, layer)
        kr, vr = jnp.nan_to_num(kr, posinf=0.0), jnp.nan_to_num(vr, posinf=0.0)
        want, want_lse = attention_lse(q, kr, vr, jnp.asarray(mask))
        np.testing.assert_allclose(np.asarray(out)[seen], np.asarray(want)[seen], rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(np.asarray(lse)[seen], np.asarray(want_lse)[seen], rtol=2e-5, atol=2e-5)
        assert (np.asarray(out)[~seen] == 0).all() and seen.sum() < seen.size


def test_chosen_rows_read_their_slots():
    """Queries of slots [2, 0] (a prefill chunk's rows) read those slots' keys."""
    rng = np.random.default_rng(5)
    q, k, v, kv_len, q_start = _case(rng, 13)
    rows = np.array([3, 0])
    q, kv_len, q_start = q[:2], kv_len[:2], q_start[:2]
    out, _ = dense_attention_lse(q, k, v, jnp.asarray(kv_len), jnp.asarray(q_start), layer=1, rows=jnp.asarray(rows))
    want = attention(q, _keys(k, 1, rows), _keys(v, 1, rows), jnp.asarray(_mask(kv_len, q_start, 13, q.shape[1])))
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-5, atol=2e-5)
    wrong, _ = dense_attention_lse(q, k, v, jnp.asarray(kv_len), jnp.asarray(q_start), layer=1)  # slots 0, 1
    assert not np.allclose(np.asarray(wrong), np.asarray(want), atol=1e-3)


def test_backends_agree_through_the_cache():
    """`KVCache.attend_committed` with a verification block: the kernel backend (interpreted) equals
    the reference backend, and a kernel reading one position too few is caught."""
    rng = np.random.default_rng(9)
    q, k, v, kv_len, _ = _case(rng, 40)
    r, t, _, d = q.shape
    kb, vb = (jnp.asarray(rng.normal(size=(r, t, 2, d)), jnp.float32) for _ in range(2))
    full = jnp.full((r,), t, jnp.int32)
    causal = jnp.asarray(np.broadcast_to(np.tril(np.ones((t, t), bool)), (r, t, t)))
    start = jnp.asarray(kv_len)
    kernel = KVCache(k, v, start, "pallas")
    reference = KVCache(k, v, start, "reference")
    got = kernel.attend_committed(q, k, v, 1, start, OwnKeys(kb, vb, full), jnp.float32)
    want = reference.attend_committed(q, k, v, 1, start, OwnKeys(kb, vb, full), jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    before = jnp.asarray(np.arange(40)[None, None] < kv_len[:, None, None]).repeat(t, 1)
    direct = attention_parts(q, [(_keys(k, 1), _keys(v, 1), before), (kb, vb, causal)])
    np.testing.assert_allclose(np.asarray(want), np.asarray(direct), rtol=2e-5, atol=2e-5)
    short = merge_parts([dense_attention_lse(q, k, v, start - 1, start, layer=1), attention_lse(q, kb, vb, causal)])
    assert not np.allclose(np.asarray(short), np.asarray(want), atol=1e-3)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("query_block", [256, 4])  # one query block; blocks of 4 rows (2 queries of 2 heads)
def test_own_keys_in_the_kernel_equal_one_softmax(causal, query_block, monkeypatch):
    """The own keys taken into the kernel's online softmax (out and log-sum-exp) equal one softmax
    over the cache's keys and the own ones, masked causally or not, with rows holding fewer own
    tokens than columns (rows 0 and 3) and a row that sees no cache key."""
    import dspark_jax.target.paged_kernel as pk

    monkeypatch.setattr(pk, "QUERY_BLOCK", query_block)
    rng = np.random.default_rng(21)
    q, k, v, kv_len, _ = _case(rng, 40)
    r, t, _, d = q.shape
    kb, vb = (jnp.asarray(rng.normal(size=(r, t, 2, d)), jnp.float32) for _ in range(2))
    own = OwnKeys(kb, vb, jnp.asarray([1, t, t, 2], jnp.int32), causal=causal)
    start = jnp.asarray(kv_len)
    out, lse = dense_attention_lse(q, k, v, start, start, layer=1, own=own)
    before = jnp.asarray(np.arange(40)[None, None] < kv_len[:, None, None]).repeat(t, 1)
    parts = [attention_lse(q, _keys(k, 1), _keys(v, 1), before), attention_lse(q, kb, vb, own.mask(t))]
    want = attention_parts(q, [(_keys(k, 1), _keys(v, 1), before), (kb, vb, own.mask(t))])
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-5, atol=2e-5)
    want_lse = jnp.logaddexp(parts[0][1], parts[1][1])
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=2e-5, atol=2e-5)
    other = attention_parts(q, [(_keys(k, 1), _keys(v, 1), before), (kb, vb, OwnKeys(kb, vb, own.lengths,
                                                                                      not causal).mask(t))])
    assert not np.allclose(np.asarray(other), np.asarray(want), atol=1e-3)  # the causal flag matters here


def test_backend_is_chosen_by_the_compile_platform():
    assert attention_backend("auto") == AttentionBackend(kernel=False, interpret=True)  # this CPU
    assert attention_backend("pallas") == AttentionBackend(kernel=True, interpret=True, forced=True)
    assert attention_backend("reference").kernel is False
    with pytest.raises(ValueError, match="not one of"):
        attention_backend("flash")
    assert jax.default_backend() == "cpu"


def test_engine_over_the_dense_kernel_gives_the_reference_tokens():
    """The engine with its dense caches read by the kernel (interpret mode: prefill, verification,
    the drafter's context attention) decodes the reference engine's greedy tokens with a DSpark
    drafter. (Interpreted kernels compile slowly on a CPU: one drafter kind, short runs.)"""
    from dspark_jax.decoding.sampling import SamplingParams
    from dspark_jax.engine import Engine, EngineConfig
    from dspark_jax.testing.tiny import tiny_config, tiny_drafter, tiny_target

    target = tiny_target(tiny_config(vocab_size=16, hidden_size=32, num_layers=2), logit_scale=1.0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 15, n).tolist() for n in (3, 9)]
    greedy = SamplingParams(0.0, 0, 1.0)
    d = tiny_drafter("dspark", target, gamma=3)
    kw = dict(num_slots=2, max_len=24, buckets=(8,), prefill_buckets=(12,))
    tokens = {}
    for impl in ("reference", "pallas"):
        eng = Engine(target, d, EngineConfig(paged_attention=impl, **{"policy": "fixed", **kw}))
        st = eng.init_state()
        assert st.cache.impl == impl and st.dcache.impl == impl
        tokens[impl] = [r.tokens for r in eng.generate(prompts, max_new_tokens=6, sampling=greedy).results]
    assert tokens["pallas"] == tokens["reference"]
