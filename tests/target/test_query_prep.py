"""`QueryPrep`: the q norm and RoPE as the layers apply them, and the same preparation inside the
cache kernel (interpret mode) equal to the kernel over queries prepared before it."""

import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.target.layers import apply_rope, rms_norm, rope_cos_sin
from dspark_jax.target.paged_kernel import dense_attention_lse
from dspark_jax.target.query_prep import QueryPrep


def _prep(rng, r, t, d, norm: bool):
    pos = jnp.asarray(rng.integers(0, 30, (r, t)), jnp.int32)
    cos, sin = rope_cos_sin(pos, 1.0 / (10000.0 ** (np.arange(0, d, 2) / d)))
    weight = jnp.asarray(rng.uniform(0.5, 1.5, (d,)), jnp.float32) if norm else None
    return QueryPrep(weight, cos, sin, 1e-6)


def test_apply_is_the_layers_norm_then_rope():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 3, 4, 8)), jnp.bfloat16)
    prep = _prep(rng, 2, 3, 8, norm=True)
    want = apply_rope(rms_norm(q, prep.norm, 1e-6), prep.cos, prep.sin)
    np.testing.assert_array_equal(np.asarray(prep.apply(q), np.float32), np.asarray(want, np.float32))
    bare = prep.replace(norm=None)
    np.testing.assert_array_equal(np.asarray(bare.apply(q), np.float32),
                                  np.asarray(apply_rope(q, prep.cos, prep.sin), np.float32))


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("query_block", [256, 4])  # one query block; blocks of 4 rows
def test_kernel_prepares_raw_queries(norm, query_block, monkeypatch):
    """The kernel over raw queries with their preparation equals the kernel over queries prepared
    by `QueryPrep.apply` (float32, so both read the same numbers); a preparation that rotates the
    wrong way (the sign of the rotated half) differs."""
    import dspark_jax.target.paged_kernel as pk

    monkeypatch.setattr(pk, "QUERY_BLOCK", query_block)
    rng = np.random.default_rng(3)
    r, t, nkv, g, d, s = 3, 3, 2, 2, 8, 20
    q = jnp.asarray(rng.normal(size=(r, t, nkv * g, d)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(1, r, nkv, s, d)), jnp.float32) for _ in range(2))
    kv_len, q_start = jnp.asarray([20, 7, 0], jnp.int32), jnp.asarray([17, 4, 0], jnp.int32)
    prep = _prep(rng, r, t, d, norm)
    got, got_lse = dense_attention_lse(q, k, v, kv_len, q_start, layer=0, q_prep=prep)
    want, want_lse = dense_attention_lse(prep.apply(q), k, v, kv_len, q_start, layer=0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(got_lse), np.asarray(want_lse), rtol=2e-5, atol=2e-5)
    backwards = prep.replace(sin=-prep.sin)  # rotate-half with the other sign
    wrong, _ = dense_attention_lse(backwards.apply(q), k, v, kv_len, q_start, layer=0)
    assert not np.allclose(np.asarray(wrong)[:2], np.asarray(got)[:2], atol=1e-3)
