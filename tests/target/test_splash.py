"""The splash-attention path of the target's cache-free forward (the TPU kernel, run here in Pallas
interpret mode) equals the dense path on every real token, alone and sharded on a mesh."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.target.kernels import choose_causal_kernel
from dspark_jax.target.layers import causal_attention
from dspark_jax.target.splash import splash_causal_attention
from dspark_jax.testing.tiny import tiny_config, tiny_target
from tests.conftest import run_multidevice


def _inputs(b=2, t=256, nq=4, nkv=2, d=32, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, n, d)), jnp.float32) for n in (nq, nkv, nkv))
    valid = np.ones((b, t), bool)
    valid[1, 200:] = False  # right padding
    valid[0, :3] = False  # and left padding
    return q, k, v, jnp.asarray(valid)


def test_splash_equals_dense_attention_on_real_tokens():
    q, k, v, valid = _inputs()
    dense = np.asarray(causal_attention(q, k, v, valid))
    splash = np.asarray(jax.jit(splash_causal_attention)(q, k, v, valid))
    real = np.asarray(valid)
    np.testing.assert_allclose(splash[real], dense[real], atol=2e-5)
    # the group mapping matters: query heads 0-1 read kv head 0, 2-3 kv head 1
    swapped = np.asarray(splash_causal_attention(q, k[:, :, ::-1], v[:, :, ::-1], valid))
    assert np.abs(swapped[real] - dense[real]).max() > 1e-2


def test_target_forward_with_splash_matches_dense():
    cfg = dataclasses.replace(tiny_config(vocab_size=64, hidden_size=64, num_layers=2), num_heads=4, num_kv_heads=2)
    target = tiny_target(cfg)
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, 64, (2, 128)), jnp.int32)
    valid = jnp.asarray(np.arange(128)[None, :] < np.array([[128], [90]]))
    outs = {}
    for impl in ("dense", "splash"):
        target.attention = impl
        outs[impl] = target(tokens, valid=valid, feature_layers=(0, 1))
    target.attention = "auto"
    real = np.asarray(valid)
    np.testing.assert_allclose(np.asarray(outs["splash"].features)[real],
                               np.asarray(outs["dense"].features)[real], atol=1e-4)
    np.testing.assert_allclose(np.asarray(outs["splash"].logits)[real],
                               np.asarray(outs["dense"].logits)[real], atol=1e-3)


def test_attention_choice():
    assert choose_causal_kernel("auto", 256, 128) == "blocked"  # CPU: dense unless forced
    assert choose_causal_kernel("dense", 256, 128) == "blocked"
    assert choose_causal_kernel("splash", 256, 64) == "splash"
    with pytest.raises(ValueError, match="multiple of 128"):
        choose_causal_kernel("splash", 100, 128)
    with pytest.raises(ValueError, match="not one of"):
        choose_causal_kernel("flash", 256, 128)


def test_splash_on_a_mesh_equals_one_device():
    """Rows over data, kv heads over tensor: the kernel runs per shard under shard_map."""
    out = run_multidevice(r"""
import json, numpy as np, jax
from dspark_jax.parallel.sharding import make_mesh
from dspark_jax.target.splash import splash_causal_attention
from dspark_jax.target.layers import causal_attention
from tests.target.test_splash import _inputs
q, k, v, valid = _inputs(b=4)
dense = np.asarray(causal_attention(q, k, v, valid))
mesh = make_mesh(2, 1, 2)
with jax.set_mesh(mesh):
    f = jax.jit(splash_causal_attention)
    out = f(q, k, v, valid)
    hlo = f.lower(q, k, v, valid).as_text()
real = np.asarray(valid)
print(json.dumps({"err": float(np.abs(np.asarray(out)[real] - dense[real]).max()),
                  "shard_map": "shard_map" in hlo or "sdy.manual_computation" in hlo}))
""", n=4)
    res = json.loads(out.strip().splitlines()[-1])
    assert res["err"] < 2e-5, res
    assert res["shard_map"], res


def test_splash_is_chosen_and_compiled_for_a_tpu_mesh():
    """Traced under a mesh of a TPU slice's compile-only devices (this host is a CPU), `auto`
    picks the kernel and it compiles ahead of time as Mosaic, not in interpret mode: its mask
    tables are built as host constants, never placed on the slice's devices."""
    pytest.importorskip("libtpu", reason="the TPU compiler ships in libtpu: pip install -e '.[aot]'")
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from dspark_jax.parallel.topology import slice_mesh

    mesh = slice_mesh("v6e-4", 2, 1, 2)
    spec = NamedSharding(mesh, P("data", None, "tensor", None))
    q = jax.ShapeDtypeStruct((4, 256, 8, 128), jnp.bfloat16, sharding=spec)
    kv = jax.ShapeDtypeStruct((4, 256, 2, 128), jnp.bfloat16, sharding=spec)
    valid = jax.ShapeDtypeStruct((4, 256), jnp.bool_, sharding=NamedSharding(mesh, P("data", None)))
    assert jax.default_backend() == "cpu" and choose_causal_kernel("auto", 256, 128) == "blocked"
    with jax.set_mesh(mesh):
        assert choose_causal_kernel("auto", 256, 128) == "splash"
        assert choose_causal_kernel("auto", 200, 128) == "blocked"  # does not tile: dense
        compiled = jax.jit(splash_causal_attention).lower(q, kv, kv, valid).compile()
    text = compiled.as_text()
    assert "tpu_custom_call" in text and "splash" in text
    assert compiled.memory_analysis().argument_size_in_bytes > 0
