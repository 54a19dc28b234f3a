"""Target model: KV-cache decoding equals the full forward; features; masking; rope scaling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.target import KVCache
from dspark_jax.target.config import RopeConfig
from dspark_jax.target.layers import attention, rope_inv_freq


@pytest.fixture(scope="module")
def fwd(micro_target):
    from flax import nnx

    graphdef, state = nnx.split(micro_target)

    @jax.jit
    def full(state, tokens):
        return nnx.merge(graphdef, state)(tokens, feature_layers=(0, 1))

    @jax.jit
    def step(state, tokens, positions, valid, cache):
        return nnx.merge(graphdef, state)(tokens, positions, valid, cache, feature_layers=(0, 1))

    return state, full, step


def test_cache_decoding_equals_full_forward(fwd):
    """Prefill, token by token, then a padded chunk, with two slots at different lengths."""
    state, full, step = fwd
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 512, 20), rng.integers(0, 512, 14)]
    ref = [full(state, jnp.asarray(s)[None]) for s in seqs]
    cache = KVCache.create(state_cfg(fwd), 2, 32)
    prefill = [5, 3]
    width = 8  # static chunk width; rows padded with invalid tokens

    def run(cache, starts, counts):
        toks = np.zeros((2, width), np.int32)
        pos = np.zeros((2, width), np.int32)
        valid = np.zeros((2, width), bool)
        for r in range(2):
            n = counts[r]
            toks[r, :n] = seqs[r][starts[r]: starts[r] + n]
            pos[r, :] = starts[r] + np.arange(width)
            valid[r, :n] = True
        out = step(state, jnp.asarray(toks), jnp.asarray(pos), jnp.asarray(valid), cache)
        for r in range(2):
            n = counts[r]
            np.testing.assert_allclose(out.logits[r, :n], ref[r].logits[0, starts[r]: starts[r] + n], atol=1e-4)
            np.testing.assert_allclose(out.features[r, :n], ref[r].features[0, starts[r]: starts[r] + n], atol=1e-4)
            assert np.isfinite(np.asarray(out.logits[r])).all()
        return out.cache.with_lengths(np.asarray(starts) + np.asarray(counts))

    cache = run(cache, [0, 0], prefill)
    lengths = list(prefill)
    for _ in range(4):  # token by token
        cache = run(cache, lengths, [1, 1])
        lengths = [x + 1 for x in lengths]
    # a padded chunk of different valid counts; then a rejected tail is rolled back
    cache = run(cache, lengths, [6, 3])
    lengths = [lengths[0] + 6, lengths[1] + 3]
    rolled = cache.with_lengths(np.asarray(lengths) - 2)  # reject the last two tokens of each
    run(rolled, [lengths[0] - 2, lengths[1] - 2], [2, 2])  # re-decoding them matches again


def state_cfg(fwd):
    from dspark_jax.config import from_cli

    return from_cli(["micro"]).target.model


def test_features_are_layer_outputs(micro_target):
    tokens = jnp.arange(9)[None] % 512
    out = micro_target(tokens, feature_layers=(1,))
    out0 = micro_target(tokens, feature_layers=(0, 1))
    np.testing.assert_allclose(out.features[:, :, 0], out0.features[:, :, 1], atol=1e-6)
    assert not np.allclose(out0.features[:, :, 0], out0.features[:, :, 1])
    # the final layer's raw output, normed, is the returned hidden state
    from dspark_jax.target.layers import rms_norm

    normed = rms_norm(out.features[:, :, 0], micro_target.final_norm[...], micro_target.cfg.rms_norm_eps)
    np.testing.assert_allclose(normed, out.hidden, atol=1e-5)


def test_padding_does_not_change_valid_rows(micro_target):
    tokens = jnp.asarray([[5, 6, 7, 8, 0, 0]])
    valid = jnp.asarray([[True] * 4 + [False] * 2])
    a = micro_target(tokens, valid=valid)
    b = micro_target(tokens[:, :4])
    np.testing.assert_allclose(a.logits[:, :4], b.logits, atol=1e-5)


def test_fully_masked_attention_is_finite():
    q = jnp.ones((1, 2, 4, 8))
    k = jnp.ones((1, 3, 2, 8))
    v = jnp.ones((1, 3, 2, 8))
    out = attention(q, k, v, jnp.zeros((1, 2, 3), bool))
    assert np.isfinite(np.asarray(out)).all()


def test_llama3_rope_scaling_matches_reference_formula():
    rope = RopeConfig(theta=500000.0, type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192)
    inv = rope_inv_freq(128, rope)
    base = rope_inv_freq(128, RopeConfig(theta=500000.0))
    wavelen = 2 * np.pi / base
    # high frequencies untouched, low frequencies divided by the factor, the rest in between
    hi = wavelen < 8192 / 4
    lo = wavelen > 8192 / 1
    np.testing.assert_allclose(inv[hi], base[hi], rtol=1e-6)
    np.testing.assert_allclose(inv[lo], base[lo] / 8.0, rtol=1e-6)
    mid = ~hi & ~lo
    assert mid.any() and np.all(inv[mid] < base[mid]) and np.all(inv[mid] > base[mid] / 8.0)


def _np_attention(q, k, v, mask):
    """Plain numpy grouped-query attention: q [B,T,Nq,D], k/v [B,S,Nkv,D], mask [B,T,S]."""
    b, t, nq, d = q.shape
    g = nq // k.shape[2]
    kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("bthd,bshd->bhts", q, kr) / np.sqrt(d)
    s = np.where(mask[:, None], s, -1e30)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhts,bshd->bthd", p, vr)


def test_attention_layouts_match_numpy_and_block_skipping_is_exact():
    """The heads-first attention equals a numpy reference; the block-skipping causal variant equals
    the dense causal mask for a length that is not a multiple of the block, with padded keys."""
    from dspark_jax.target.layers import causal_attention

    rng = np.random.default_rng(0)
    b, t, nq, nkv, d = 2, 37, 6, 2, 8
    q, k, v = (rng.normal(size=(b, t, n, d)).astype(np.float32) for n in (nq, nkv, nkv))
    key_valid = np.ones((b, t), bool)
    key_valid[1, 30:] = False
    mask = np.tril(np.ones((t, t), bool))[None] & key_valid[:, None, :]
    want = _np_attention(q, k, v, mask)
    np.testing.assert_allclose(attention(*map(jnp.asarray, (q, k, v, mask))), want, atol=2e-5)
    for block in (8, 16, 37, 64):
        got = causal_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(key_valid), block)
        np.testing.assert_allclose(got, want, atol=2e-5, err_msg=f"block {block}")
    # a variant that lets every block see all keys (no causal mask inside the block) is caught
    leaky = np.tril(np.ones((t, t), bool), k=3)[None] & key_valid[:, None, :]
    assert np.abs(_np_attention(q, k, v, leaky) - want).max() > 1e-2


def test_block_skipping_forward_equals_dense_forward(micro_target, monkeypatch):
    """The model's no-cache forward takes the block-skipping path; with a block smaller than the
    sequence it matches the same forward through the dense mask (cache-free, explicit positions)."""
    import dspark_jax.target.attention as attention_mod

    tokens = jnp.asarray(np.random.default_rng(1).integers(0, micro_target.cfg.vocab_size, (2, 21)), jnp.int32)
    valid = jnp.ones(tokens.shape, bool).at[1, 15:].set(False)
    positions = jnp.broadcast_to(jnp.arange(21, dtype=jnp.int32), tokens.shape)
    dense = micro_target(tokens, positions=positions, valid=valid, feature_layers=(0,))  # positions given: dense mask
    monkeypatch.setattr(attention_mod, "CAUSAL_BLOCK", 8)
    blocked = micro_target(tokens, valid=valid, feature_layers=(0,))
    np.testing.assert_allclose(blocked.logits, dense.logits, atol=1e-4)
    np.testing.assert_allclose(blocked.features, dense.features, atol=1e-4)
