"""Merged projections (target/merged.py): the merged products give the parts' outputs, each chip's
share of a merged weight holds whole KV-head groups, the merge is refused where it would mix chips'
heads, and a target forward over merged per-layer weights on a tensor mesh equals the stacked one."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh

from dspark_jax.target.config import ModelConfig
from dspark_jax.target.merged import MergeChoice, gate_up, merge_choice, merge_gate_up, merge_qkv, qkv, split_qkv
from tests.conftest import run_multidevice

CFG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=6, num_kv_heads=2,
                  head_dim=4, max_position_embeddings=64)


def _weights(rng, cfg=CFG):
    h, d = cfg.hidden_size, cfg.head_dim
    w = lambda *s: rng.normal(size=s).astype(np.float32)
    return (w(h, cfg.num_heads * d), w(h, cfg.num_kv_heads * d), w(h, cfg.num_kv_heads * d),
            w(h, cfg.intermediate_size), w(h, cfg.intermediate_size))


def test_merged_products_give_the_parts_outputs():
    rng = np.random.default_rng(0)
    q, k, v, gate, up = _weights(rng)
    x = rng.normal(size=(3, 5, CFG.hidden_size)).astype(np.float32)
    mq, mk, mv = split_qkv(qkv(jnp.asarray(x), merge_qkv(q, k, v, CFG)), CFG)
    ref = lambda w, n: (x @ w).reshape(3, 5, n, CFG.head_dim)
    np.testing.assert_allclose(mq, ref(q, CFG.num_heads), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(mk, ref(k, CFG.num_kv_heads), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(mv, ref(v, CFG.num_kv_heads), rtol=1e-5, atol=1e-5)
    g, u = gate_up(jnp.asarray(x), merge_gate_up(gate, up))
    np.testing.assert_allclose(g, x @ gate, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(u, x @ up, rtol=1e-5, atol=1e-5)


def test_each_half_of_the_merged_qkv_weight_holds_whole_kv_groups():
    """Split in two on its output axis (its first, as a 2-chip tensor split does), the first half
    is exactly KV head 0's query heads (0 .. G-1), key and value: what that chip's parts would
    hold. A merge that concatenated q | k | v whole would give the first chip all of q and nothing
    of k or v."""
    rng = np.random.default_rng(1)
    q, k, v, _, _ = _weights(rng)
    merged = np.asarray(merge_qkv(q, k, v, CFG))
    d, g = CFG.head_dim, CFG.num_heads // CFG.num_kv_heads
    assert merged.shape == ((CFG.num_heads + 2 * CFG.num_kv_heads) * d, CFG.hidden_size)  # output axis first
    first = merged[: merged.shape[0] // 2]
    np.testing.assert_array_equal(first, np.concatenate([q[:, : g * d], k[:, :d], v[:, :d]], axis=1).T)


def test_merge_choice_follows_the_rules_table():
    tensor = lambda n: AbstractMesh((1, 1, n), ("data", "fsdp", "tensor"))
    assert merge_choice(CFG) == MergeChoice(True, True)
    assert merge_choice(CFG, tensor(2)) == MergeChoice(True, True)  # one KV head (and its 3 queries) a chip
    assert merge_choice(CFG, tensor(1)) == MergeChoice(True, True)
    # 3 KV heads over 2 chips: the parts split the KV columns (12 over 2) but not whole heads
    three = dataclasses.replace(CFG, num_heads=6, num_kv_heads=3)
    assert merge_choice(three, tensor(2)) == MergeChoice(False, False)


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_forward_over_merged_weights_on_a_tensor_mesh_equals_the_stacked(kv_heads):
    """Two chips: KV heads split (merged) or one KV head that cannot split (not merged); the
    per-layer forward's logits and cache equal the stacked scan's, and the merged weight is laid
    out on the mesh as the rules table says."""
    out = run_multidevice(rf"""
import json, numpy as np, jax, jax.numpy as jnp
from dspark_jax.parallel.sharding import make_mesh
from dspark_jax.target.config import ModelConfig
from dspark_jax.target.decode_weights import decode_arrays
from dspark_jax.target.attention import cache_update
from dspark_jax.target.forward import forward
from dspark_jax.target.kv_cache import KVCache
from dspark_jax.drafter.random_models import random_target
cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4,
                  num_kv_heads={kv_heads}, head_dim=4, max_position_embeddings=64)
mesh = make_mesh(1, 1, 2)
model = random_target(cfg, mesh=mesh, logit_scale=1.0)
split = decode_arrays(model)
with jax.set_mesh(mesh):
    tokens = jnp.asarray([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]], jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 5))
    valid = pos < jnp.asarray([[5], [3]])
    outs = [forward(p, cfg, tokens, pos, cache_update(KVCache.create(cfg, 2, 8), pos, valid))
            for p in (model.arrays(), split)]
layer = split["layers"][0]
print(json.dumps({{"keys": sorted(layer),
                  "spec": str(layer["qkv_proj"].sharding.spec) if "qkv_proj" in layer else None,
                  "logits": float(np.abs(np.asarray(outs[0].logits) - np.asarray(outs[1].logits)).max()),
                  "cache": float(np.abs(np.asarray(outs[0].cache.k) - np.asarray(outs[1].cache.k)).max())}}))
""", n=2)
    res = json.loads(out.strip().splitlines()[-1])
    assert res["logits"] < 1e-4 and res["cache"] < 1e-5, res
    if kv_heads == 2:
        assert "qkv_proj" in res["keys"] and "gate_up_proj" in res["keys"] and "q_proj" not in res["keys"], res
        assert res["spec"] in ("P('tensor',)", "P('tensor', None)", "PartitionSpec('tensor', None)",
                               "PartitionSpec('tensor',)"), res
    else:
        assert "q_proj" in res["keys"] and "gate_proj" in res["keys"] and "qkv_proj" not in res["keys"], res


def test_abstract_decode_arrays_match_the_real_ones():
    """What an ahead-of-time compile takes as the weights has the real decode arrays' structure,
    shapes and dtypes (the compiled programs are shared by both)."""
    from dspark_jax.drafter.random_models import random_target
    from dspark_jax.target.decode_weights import abstract_decode_arrays, decode_arrays

    model = random_target(CFG)
    real = decode_arrays(model)
    mesh = AbstractMesh((1, 1, 1), ("data", "fsdp", "tensor"))
    abstract = abstract_decode_arrays(CFG, jax.eval_shape(model.arrays), jax.sharding.Mesh(
        np.array(jax.devices()[:1]).reshape(1, 1, 1), mesh.axis_names))
    shape = lambda t: jax.tree.map(lambda a: (a.shape, str(a.dtype)), t)
    assert shape(abstract) == shape(real)
