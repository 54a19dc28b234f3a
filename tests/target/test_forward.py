"""The target's one forward: every attention variant against a numpy forward, and the dispatch.

Each variant computes the same function of a sequence (cache-free causal, explicit positions, a
dense or paged cache written chunk by chunk, packed verification reading a filled cache), so all
agree with one numpy reference. The dispatch tests run `layer_attention` on inputs where the
variants give different answers, so a metadata routed to the wrong variant is caught.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.engine.verify import verify_forward
from dspark_jax.target import KVCache, PagedKVCache
from dspark_jax.target import attention as attention_mod
from dspark_jax.target.attention import (
    CausalSelf,
    MaskedSelf,
    PackedVerify,
    VerifyView,
    cache_update,
    causal_self,
    layer_attention,
    masked_self,
    view_rows,
)
from dspark_jax.target.forward import forward
from dspark_jax.target.layers import rope_inv_freq
from dspark_jax.target.packing import pack, pack_in_place
from dspark_jax.testing.tiny import tiny_config, tiny_target

R, T, S = 2, 11, 16  # rows, sequence length, cache positions
PREFIX = (6, 3)  # tokens of each row in the cache before the second chunk
LENGTHS = (11, 8)  # valid tokens of each row
FEATURE_LAYERS = (0, 2)
PAGE_SIZE, NUM_PAGES = 4, 12


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_config(vocab_size=48, hidden_size=32, num_layers=3).replace(num_heads=4, num_kv_heads=2, head_dim=8)
    model = tiny_target(cfg, seed=5)
    params = model.arrays()
    rng = np.random.default_rng(0)
    # q norm weights away from their initial ones, so a forward that skips them is caught
    params["layers"]["q_norm"] = params["layers"]["q_norm"] * jnp.asarray(rng.uniform(0.5, 1.5, (cfg.head_dim,)))
    tokens = rng.integers(0, cfg.vocab_size, (R, T)).astype(np.int32)
    ref = [_np_forward(jax.tree.map(np.asarray, params), cfg, tokens[r, :LENGTHS[r]]) for r in range(R)]
    return cfg, params, tokens, ref


def _np_rms(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _np_rope(x, cos, sin):
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None] + rot * sin[:, None]


def _np_forward(p, cfg, tokens):
    """float64 forward of one sequence at positions 0..n-1 -> (logits [n, V], features [n, m, H])."""
    n, nq, nkv, d = len(tokens), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    ang = np.arange(n)[:, None] * rope_inv_freq(d, cfg.rope).astype(np.float64)[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    x = p["embed"][tokens]
    feats = []
    for li in range(cfg.num_layers):
        w = {k: v[li] for k, v in p["layers"].items()}
        h = _np_rms(x, w["input_norm"], cfg.rms_norm_eps)
        q = _np_rms((h @ w["q_proj"]).reshape(n, nq, d), w["q_norm"], cfg.rms_norm_eps)
        k = _np_rms((h @ w["k_proj"]).reshape(n, nkv, d), w["k_norm"], cfg.rms_norm_eps)
        v = (h @ w["v_proj"]).reshape(n, nkv, d)
        q, k = _np_rope(q, cos, sin), _np_rope(k, cos, sin)
        k, v = np.repeat(k, nq // nkv, axis=1), np.repeat(v, nq // nkv, axis=1)  # query head i reads kv head i // G
        s = np.einsum("tnd,snd->nts", q, k) / np.sqrt(d)
        s = np.where(np.tril(np.ones((n, n), bool))[None], s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        x = x + np.einsum("nts,snd->tnd", a, v).reshape(n, -1) @ w["o_proj"]
        h = _np_rms(x, w["post_norm"], cfg.rms_norm_eps)
        g = h @ w["gate_proj"]
        x = x + (g / (1 + np.exp(-g)) * (h @ w["up_proj"])) @ w["down_proj"]
        feats.append(x)
    hidden = _np_rms(x, p["final_norm"], cfg.rms_norm_eps)
    return hidden @ p["lm_head"], np.stack([feats[i] for i in FEATURE_LAYERS], axis=1)


def _check(got_logits, got_feats, ref, rows_cols):
    """rows_cols: (row, columns of the output, positions in the sequence) to compare."""
    for r, cols, pos in rows_cols:
        np.testing.assert_allclose(np.asarray(got_logits)[r, cols], ref[r][0][pos], rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(np.asarray(got_feats)[r, cols], ref[r][1][pos], rtol=1e-4, atol=1e-4)


def _valid(lengths, width=T):
    return jnp.asarray(np.arange(width)[None] < np.asarray(lengths)[:, None])


def _positions(start, width):
    return jnp.asarray(np.asarray(start)[:, None] + np.arange(width)[None], jnp.int32)


def _paged(cfg, impl):
    cache = PagedKVCache.create(cfg, R, S, NUM_PAGES, PAGE_SIZE, impl=impl)
    table = np.random.default_rng(1).permutation(NUM_PAGES)[: R * (S // PAGE_SIZE)].reshape(R, -1)
    return cache.with_page_table(table)


def _cache(cfg, kind):
    """"dense": the dense cache (read by the reference here); "dense-pallas": the dense cache read by
    the TPU kernel (interpreted: it takes the own keys and prepares the queries itself); else a
    paged cache read as `kind` says."""
    if kind.startswith("dense"):
        return KVCache.create(cfg, R, S, impl="pallas" if kind == "dense-pallas" else "auto")
    return _paged(cfg, kind)


@pytest.mark.parametrize("kind", ["causal", "masked"])
def test_cache_free_forward_equals_numpy(setup, kind):
    cfg, params, tokens, ref = setup
    valid = _valid(LENGTHS)
    positions = _positions([0, 0], T)
    attn = causal_self(valid, "dense", cfg.head_dim) if kind == "causal" else masked_self(positions, valid)
    out = jax.jit(lambda p, t, pos, a: forward(p, cfg, t, pos, a, feature_layers=FEATURE_LAYERS))(
        params, jnp.asarray(tokens), positions, attn)
    assert out.cache is None and out.layer_out is None
    _check(out.logits, out.features, ref, [(r, slice(0, n), slice(0, n)) for r, n in enumerate(LENGTHS)])


def _prefill(cfg, params, tokens, cache, ref=None):
    """Two chunks written into `cache`: each row's prefix, then the rest; checks both against `ref`."""
    fwd = jax.jit(lambda p, t, pos, a: forward(p, cfg, t, pos, a, feature_layers=FEATURE_LAYERS))
    prefix = np.asarray(PREFIX)
    out = fwd(params, jnp.asarray(tokens), _positions([0, 0], T), cache_update(cache, _positions([0, 0], T),
                                                                                _valid(prefix)))
    if ref is not None:
        _check(out.logits, out.features, ref, [(r, slice(0, n), slice(0, n)) for r, n in enumerate(PREFIX)])
    cache = out.cache.with_lengths(jnp.asarray(prefix, jnp.int32))
    rest = np.zeros_like(tokens)
    for r in range(R):
        rest[r, : LENGTHS[r] - PREFIX[r]] = tokens[r, PREFIX[r]: LENGTHS[r]]
    out = fwd(params, jnp.asarray(rest), _positions(prefix, T), cache_update(cache, _positions(prefix, T),
                                                                              _valid(np.asarray(LENGTHS) - prefix)))
    if ref is not None:
        _check(out.logits, out.features, ref,
               [(r, slice(0, LENGTHS[r] - PREFIX[r]), slice(PREFIX[r], LENGTHS[r])) for r in range(R)])
    return out.cache.with_lengths(jnp.asarray(LENGTHS, jnp.int32))


@pytest.mark.parametrize("kind", ["dense", "reference", "pallas"])
def test_cache_update_forward_equals_numpy(setup, kind):
    """Prefill in two chunks into a dense cache, a paged cache read by the gather, and by the kernel."""
    cfg, params, tokens, ref = setup
    _prefill(cfg, params, tokens, _cache(cfg, kind), ref)


def _packed_forward(cfg, params, cache, tokens, start, valid, bucket, in_place=False):
    pk = (pack_in_place(tokens, start, valid, bucket, S) if in_place else pack(tokens, start, valid, bucket, S))
    attn = PackedVerify(cache, VerifyView(pk, start, valid, in_place=in_place))
    out = forward(params, cfg, pk.tok[None], jnp.minimum(pk.pos, S - 1)[None], attn, feature_layers=FEATURE_LAYERS)
    return out, pk


@pytest.mark.parametrize("kind,in_place", [("dense", False), ("reference", False), ("dense", True),
                                           ("reference", True), ("dense-pallas", False), ("dense-pallas", True)])
def test_packed_verification_equals_numpy(setup, kind, in_place):
    """The cache holds each row's prefix; the packed forward of the rest reads it (never writes).
    `in_place`: a bucket that holds the whole view (and padding past it) packs without compacting."""
    cfg, params, tokens, ref = setup
    prefix = np.asarray(PREFIX)
    cache = _prefill(cfg, params, tokens, _cache(cfg, kind)).with_lengths(jnp.asarray(prefix, jnp.int32))
    width = T - min(PREFIX)
    rest = np.zeros((R, width), np.int32)
    for r in range(R):
        rest[r, : LENGTHS[r] - PREFIX[r]] = tokens[r, PREFIX[r]: LENGTHS[r]]
    valid = _valid(np.asarray(LENGTHS) - prefix, width)
    bucket = (R * width if in_place else int(np.sum(np.asarray(LENGTHS) - prefix))) + 3  # padded packed tokens too
    out, pk = jax.jit(lambda c, p: _packed_forward(cfg, p, c, jnp.asarray(rest), jnp.asarray(prefix, jnp.int32),
                                                   valid, bucket, in_place))(cache, params)
    if in_place:
        live = np.asarray(valid)
        np.testing.assert_array_equal(np.asarray(pk.dest).reshape(R, width)[live],
                                      np.arange(R * width).reshape(R, width)[live])
    assert out.cache is None
    k_views, v_views = out.layer_out  # [L, R, width, Nkv, D]: the block's keys, for the caller to write
    assert k_views.shape == (cfg.num_layers, R, width, cfg.num_kv_heads, cfg.head_dim)
    dest = np.asarray(pk.dest).reshape(R, width)
    logits, feats = np.asarray(out.logits[0]), np.asarray(out.features[0])
    for r in range(R):
        n = LENGTHS[r] - PREFIX[r]
        np.testing.assert_allclose(logits[dest[r, :n]], ref[r][0][PREFIX[r]: LENGTHS[r]], rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(feats[dest[r, :n]], ref[r][1][PREFIX[r]: LENGTHS[r]], rtol=1e-4, atol=1e-4)
    # the views' keys are those the cache-writing forward stored at the same positions
    full = _prefill(cfg, params, tokens, _cache(cfg, kind))
    full_k = full.dense()[0]
    for r in range(R):
        n = LENGTHS[r] - PREFIX[r]
        np.testing.assert_allclose(np.asarray(k_views)[:, r, :n], np.asarray(full_k)[:, r, PREFIX[r]: LENGTHS[r]],
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["dense", "dense-pallas"])
def test_one_column_verification_equals_numpy(setup, kind):
    """The target-only step's view, one column a slot in a bucket of 8: read by the kernel it takes
    every row of the bucket (`view_rows`; rows past the slots hold no token). Logits and the view's
    keys are the numpy forward's for the slot with a token; the other slot's token is invalid."""
    cfg, params, tokens, ref = setup
    prefix = np.asarray(PREFIX)
    cache = _prefill(cfg, params, tokens, _cache(cfg, kind)).with_lengths(jnp.asarray(prefix, jnp.int32))
    assert view_rows(cache, R, 1, 8) == (8 if kind == "dense-pallas" else R)
    step = tokens[np.arange(R), prefix][:, None]
    valid = jnp.asarray([[True], [False]])
    out = jax.jit(lambda c, p: verify_forward(p, cfg, c, jnp.asarray(step), jnp.asarray(prefix, jnp.int32), valid,
                                              bucket=8, feature_layers=FEATURE_LAYERS))(cache, params)
    np.testing.assert_allclose(np.asarray(out.logits)[0, 0], ref[0][0][PREFIX[0]], rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(np.asarray(out.features)[0, 0], ref[0][1][PREFIX[0]], rtol=1e-4, atol=1e-4)
    assert out.k_new.shape == (cfg.num_layers, R, 1, cfg.num_kv_heads, cfg.head_dim)
    full_k = _prefill(cfg, params, tokens, _cache(cfg, kind)).dense()[0]
    np.testing.assert_allclose(np.asarray(out.k_new)[:, 0, 0], np.asarray(full_k)[:, 0, PREFIX[0]], rtol=1e-5,
                               atol=1e-5)


# --- dispatch: each metadata runs its own variant ------------------------------------------------


@pytest.fixture(scope="module")
def qkv():
    rng = np.random.default_rng(2)
    b, t, nq, nkv, d, s = 2, 5, 4, 2, 8, 12
    q = jnp.asarray(rng.normal(size=(b, t, nq, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, t, nkv, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, t, nkv, d)), jnp.float32)
    cached_k = jnp.asarray(rng.normal(size=(1, b, nkv, s, d)), jnp.float32)  # heads-major
    cached_v = jnp.asarray(rng.normal(size=(1, b, nkv, s, d)), jnp.float32)
    start = np.array([4, 2], np.int32)  # committed keys per row
    cache = KVCache(cached_k, cached_v, jnp.asarray(start))
    return q, k, v, cache, start


def _np_attend(q, keys, values, visible):
    """q [T, Nq, D], keys / values [S, Nkv, D], visible [T, S] -> [T, Nq, D]."""
    g = q.shape[1] // keys.shape[1]
    keys, values = np.repeat(keys, g, axis=1), np.repeat(values, g, axis=1)
    s = np.einsum("tnd,snd->nts", q, keys) / np.sqrt(q.shape[-1])
    s = np.where(visible[None], s, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("nts,snd->tnd", a / a.sum(-1, keepdims=True), values)


def _expected(kind, q, k, v, cache, start):
    """Each variant's answer in numpy: [B, T, Nq, D]."""
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    t = q.shape[1]
    causal = np.tril(np.ones((t, t), bool))
    out = []
    for r in range(q.shape[0]):
        if kind == "causal":
            out.append(_np_attend(q[r], k[r], v[r], causal))
        elif kind == "masked":  # positions reversed: each token sees the later columns
            out.append(_np_attend(q[r], k[r], v[r], causal.T))
        else:  # committed keys, then the chunk's own at positions start + column
            ck, cv = np.asarray(cache.k[0]).swapaxes(1, 2), np.asarray(cache.v[0]).swapaxes(1, 2)
            keys = np.concatenate([ck[r, : start[r]], k[r]])
            values = np.concatenate([cv[r, : start[r]], v[r]])
            visible = np.concatenate([np.ones((t, start[r]), bool), causal], axis=1)
            out.append(_np_attend(q[r], keys, values, visible))
    return np.stack(out)


def _metadata(kind, q, cache, start):
    b, t = q.shape[:2]
    valid = jnp.ones((b, t), bool)
    if kind == "causal":
        return CausalSelf(valid, "blocked", 2)
    if kind == "masked":
        return masked_self(jnp.broadcast_to(jnp.arange(t, 0, -1, dtype=jnp.int32), (b, t)), valid)
    positions = _positions(start, t)
    if kind == "cache":
        return cache_update(cache, positions, valid)
    pk = pack(jnp.zeros((b, t), jnp.int32), jnp.asarray(start), valid, b * t, cache.max_len)
    return PackedVerify(cache, VerifyView(pk, jnp.asarray(start), valid))


KINDS = ("causal", "masked", "cache", "packed")


def _run(kind, q, k, v, cache, start):
    attn = _metadata(kind, q, cache, start)
    kv = None if kind in ("causal", "masked") else (cache.k, cache.v)
    if kind == "packed":  # packed tokens [1, B * T] in the row-major order `pack` gives them
        b, t = q.shape[:2]
        pq, pk_, pv = (a.reshape(1, b * t, *a.shape[2:]) for a in (q, k, v))
        out, _, views = layer_attention(attn, pq, pk_, pv, kv, 0, jnp.float32)
        np.testing.assert_array_equal(np.asarray(views[0]), np.asarray(k))  # the block's keys, [B, T] view
        return np.asarray(out).reshape(q.shape)
    out, kv_after, _ = layer_attention(attn, q, k, v, kv, 0, jnp.float32)
    if kind == "cache":  # the chunk's keys were written at its positions
        for r in range(q.shape[0]):
            written = np.asarray(kv_after[0])[0, r, :, start[r]: start[r] + q.shape[1]]  # [Nkv, T, D]
            np.testing.assert_array_equal(written.swapaxes(0, 1),
                                          np.asarray(k)[r])
    return np.asarray(out)


@pytest.mark.parametrize("kind", KINDS)
def test_metadata_dispatches_to_its_variant(qkv, kind):
    """The output equals this variant's numpy answer and differs from every other variant's, so a
    metadata routed to another variant fails here."""
    q, k, v, cache, start = qkv
    got = _run(kind, q, k, v, cache, start)
    np.testing.assert_allclose(got, _expected(kind, q, k, v, cache, start), rtol=1e-5, atol=1e-5)
    for other in KINDS:
        if other not in (kind, *_SAME[kind]):
            assert np.abs(got - _expected(other, q, k, v, cache, start)).max() > 1e-2, other


_SAME = {"causal": (), "masked": (), "cache": ("packed",), "packed": ("cache",)}  # same function, other route


def test_causal_kernel_field_selects_the_kernel(qkv, monkeypatch):
    """`CausalSelf.kernel` picks splash or the blocked path (the splash entry point replaced by a
    marker here: only the "splash" metadata reaches it)."""
    q, k, v, _, _ = qkv
    marker = jnp.full(q.shape, 7.0)
    monkeypatch.setattr(attention_mod, "splash_causal_attention", lambda *a: marker)
    valid = jnp.ones(q.shape[:2], bool)
    assert np.all(np.asarray(layer_attention(CausalSelf(valid, "splash"), q, k, v, None, 0, jnp.float32)[0]) == 7.0)
    blocked = np.asarray(layer_attention(CausalSelf(valid, "blocked"), q, k, v, None, 0, jnp.float32)[0])
    np.testing.assert_allclose(blocked, _expected("causal", q, k, v, None, None), rtol=1e-5, atol=1e-5)
    assert causal_self(valid, "auto", q.shape[-1]).kernel == "blocked"  # compiled for this CPU
    assert causal_self(jnp.ones((1, 128), bool), "splash", 8).kernel == "splash"


def test_unknown_metadata_is_refused(qkv):
    q, k, v, _, _ = qkv
    with pytest.raises(TypeError, match="no attention variant"):
        layer_attention(object(), q, k, v, None, 0, jnp.float32)


def test_masked_self_mask_follows_positions():
    positions = jnp.asarray([[3, 1, 2]], jnp.int32)
    mask = np.asarray(masked_self(positions, jnp.asarray([[True, True, False]])).mask[0])
    np.testing.assert_array_equal(mask, [[True, True, False], [False, True, False], [False, True, False]])
    assert isinstance(masked_self(positions, jnp.ones((1, 3), bool)), MaskedSelf)
