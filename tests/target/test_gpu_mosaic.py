"""The Mosaic GPU cache-attention kernel (target/gpu_mosaic.py): lowered for CUDA on this CPU
machine on every supported jax (one `mosaic_gpu_v2` call reading the cache in place, its module
holding TMA copies and tensor-core products, one slot split to 256 programs); chosen by
`gpu_cache_attention_lse` for a Hopper GPU and bf16; under jax 0.12's Mosaic GPU interpreter
equal to the reference (dense cache and paged pool; rows that see all, some or none of their
keys; two query blocks; key splits; unwritten positions holding NaN / inf) and reading nothing
outside its arrays when a row claims more keys than it holds, page ids and a cache row lie past
their arrays and the layer past the last; a target forward over a bf16 cache through it (lowered
for an H100, and interpreted against the reference); per shard on a mesh of H100s."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib.mlir import ir
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

from dspark_jax.target import attention_backend as backend_mod
from dspark_jax.target import kernels, kv_cache, paged_kernel
from dspark_jax.target.attention import cache_update
from dspark_jax.target.attention_backend import AttentionBackend
from dspark_jax.target.forward import forward
from dspark_jax.target.gpu_kernel import abstract_gpu, choose_gpu_kernel, gpu_cache_attention_lse
from dspark_jax.target.gpu_mosaic import mosaic_cache_attention_lse, mosaic_fits
from dspark_jax.target.gpu_splits import MIN_PROGRAMS, splits
from dspark_jax.target.kv_cache import KVCache
from dspark_jax.target.paged_kernel import attention_lse
from dspark_jax.testing.gpu_lowering import custom_call_configs, lower_for_gpu
from dspark_jax.testing.tiny import tiny_config, tiny_target

MOSAIC = "mosaic_gpu_v2"
TRITON = "__gpu$xla.gpu.triton"
needs_interpreter = pytest.mark.skipif(not hasattr(plgpu, "InterpretGPUParams"),
                                       reason="Mosaic GPU's interpreter exists from jax 0.12")


def _mask(kv_len, q_start, s, t):
    pos = np.arange(s)
    qpos = q_start[:, None] + np.arange(t)[None]
    return (pos[None, None] < kv_len[:, None, None]) & (pos[None, None] <= qpos[:, :, None])


def _f32(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32))


def _check(out, lse, q, k_rows, v_rows, mask):
    """out / lse against the reference over the row's keys k_rows, v_rows [R, S, Nkv, D] (as
    stored, bf16). The kernel rounds the softmax weights to bf16 for the product with V (as the
    Triton kernel does for bf16 caches): outputs agree to bf16's precision, log-sum-exps closely."""
    want, want_lse = attention_lse(jnp.asarray(_f32(q)), jnp.asarray(k_rows), jnp.asarray(v_rows), jnp.asarray(mask))
    seen = mask.any(-1)
    np.testing.assert_allclose(np.asarray(out)[seen], np.asarray(want)[seen], atol=1e-2)
    np.testing.assert_allclose(np.asarray(lse)[seen], np.asarray(want_lse)[seen], rtol=1e-5, atol=1e-5)
    assert (np.asarray(out)[~seen] == 0).all()


@needs_interpreter
@pytest.mark.parametrize("dense", [True, False], ids=["dense", "paged"])
def test_mosaic_kernel_equals_reference(dense):
    rng = np.random.default_rng(3)
    r, nkv, g, d, s, ps, layers = 3, 2, 2, 64, 192, 32, 2
    t = 40 if dense else 3  # dense: 80 query rows, two blocks of 64
    kv_len, q_start = np.array([150, 20, 0]), np.array([150 - t, 10, 0])  # row 2 sees no key
    bf = jnp.bfloat16
    q = jnp.asarray(rng.normal(size=(r, t, nkv * g, d)), bf)
    if dense:
        shape = (layers, r, nkv, s, d)
        k, v = rng.normal(size=shape), rng.normal(size=shape)
        unwritten = np.arange(s)[None, None, None, :, None] >= kv_len.max()  # in the last block row 0 reads
        k, v = np.where(unwritten, np.nan, k), np.where(unwritten, np.inf, v)
        table = np.array([2, 0, 1])  # each query row reads another cache row (kv_len: the query row's)
    else:
        m = s // ps
        pages = r * m + 1
        k, v = rng.normal(size=(layers, pages, nkv, ps, d)), rng.normal(size=(layers, pages, nkv, ps, d))
        table = rng.permutation(pages)[: r * m].reshape(r, m)
        table[1, 1:] = -1  # no page past the row's keys
        table[2, :] = -1
    kb, vb = jnp.asarray(k, bf), jnp.asarray(v, bf)
    blocks = s // 64
    assert splits(r * nkv * (2 if dense else 1), blocks) == blocks  # every key block its own program
    out, lse = mosaic_cache_attention_lse(jnp.asarray(1), q, kb, vb, jnp.asarray(table), jnp.asarray(kv_len),
                                          jnp.asarray(q_start), dense=dense, interpret=plgpu.InterpretGPUParams())
    if dense:
        k_rows, v_rows = (np.nan_to_num(_f32(x)[1][table].swapaxes(1, 2), nan=0.0, posinf=0.0) for x in (kb, vb))
    else:
        k_rows, v_rows = (_f32(x)[1][np.maximum(table, 0)].transpose(0, 1, 3, 2, 4).reshape(r, s, nkv, d)
                          for x in (kb, vb))
    mask = _mask(kv_len, q_start, s, t)
    assert not mask[2].any() and mask[0, -1, :150].all()  # row 2 sees nothing, row 0's last query all it holds
    _check(out, lse, q, k_rows, v_rows, mask)


@needs_interpreter
@pytest.mark.parametrize("dense", [True, False], ids=["dense", "paged"])
def test_mosaic_kernel_clamps_every_index(dense):
    """Under Mosaic GPU's interpreter: a row claiming 40 keys more than it holds, a page id past the
    pool, a cache row past the cache and a layer past the last read nothing outside their arrays;
    the output is the reference's over what the row holds (the last page / row / layer). Without
    the clamps the output differs (the interpreter, like TMA, reads zeros where a copy's window
    lies outside its array; a table entry past the table reads what lies there)."""
    rng = np.random.default_rng(5)
    r, t, nkv, g, d, ps, m, layers = 2, 3, 1, 2, 64, 16, 6, 2  # 96 positions: one and a half key blocks
    s, bf = m * ps, jnp.bfloat16
    q = jnp.asarray(rng.normal(size=(r, t, nkv * g, d)), bf)
    if dense:
        s = 128
        k, v = (jnp.asarray(rng.normal(size=(layers, r, nkv, s, d)), bf) for _ in range(2))
        table = np.array([1, r + 3])  # the second row's cache row lies past the cache: its last
        rows = np.minimum(table, r - 1)
        k_rows, v_rows = (_f32(x)[layers - 1][rows].swapaxes(1, 2) for x in (k, v))
    else:
        pages = r * m
        k, v = (jnp.asarray(rng.normal(size=(layers, pages, nkv, ps, d)), bf) for _ in range(2))
        table = rng.permutation(pages).reshape(r, m)
        table[0, 1] = pages + 7  # a stale page id: the pool's last page
        read = np.minimum(table, pages - 1)
        k_rows, v_rows = (_f32(x)[layers - 1][read].transpose(0, 1, 3, 2, 4).reshape(r, s, nkv, d) for x in (k, v))
    kv_len, q_start = np.array([s + 40, 20]), np.array([s + 30, 17])
    out, lse = mosaic_cache_attention_lse(jnp.asarray(layers + 2), q, k, v, jnp.asarray(table), jnp.asarray(kv_len),
                                          jnp.asarray(q_start), dense=dense, interpret=plgpu.InterpretGPUParams())
    _check(out, lse, q, k_rows, v_rows, _mask(np.minimum(kv_len, s), q_start, s, t))


def _qwen_call(dense, dtype, r):
    """Qwen3-8B's attention shapes (r rows x a verification block of 8 queries, 32 query / 8 KV
    heads of 128, 2048 positions, pages of 16) through `gpu_cache_attention_lse` ("auto")."""
    t, nq, nkv, d, s, ps, layers = 8, 32, 8, 128, 2048, 16, 2
    q = jax.ShapeDtypeStruct((r, t, nq, d), dtype)
    kc = jax.ShapeDtypeStruct((layers, r, nkv, s, d) if dense else (layers, r * s // ps, nkv, ps, d), dtype)
    table = jax.ShapeDtypeStruct((r,) if dense else (r, s // ps), jnp.int32)
    lens = jax.ShapeDtypeStruct((r,), jnp.int32)

    def f(layer, q, k, v, table, kv_len, q_start):
        return gpu_cache_attention_lse(layer, q, k, v, table, kv_len, q_start, dense=dense)

    return f, (jax.ShapeDtypeStruct((1,), jnp.int32), q, kc, kc, table, lens, lens)


def _lowered(kind, f, *args):
    """f lowered for CUDA for an abstract GPU of that kind: the StableHLO text and the Mosaic GPU
    modules of its calls as text (their dialect registered, the GPU dialects they carry read as
    unregistered operations)."""
    lowered = lower_for_gpu(kind, f, *args)
    modules = []
    for config in custom_call_configs(lowered, MOSAIC):
        with jax_mlir.make_ir_context() as ctx:
            mgpu.dialect.register_dialect(ctx)
            ctx.allow_unregistered_dialects = True
            modules.append(str(ir.Module.parse(ir.StringAttr(config["module"]).value_bytes)))
    return lowered.as_text(), modules


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "paged"])
def test_mosaic_kernel_lowers_for_an_h100(dense):
    """Qwen3-8B's shapes in bf16 at 8 rows, for an H100: one Mosaic GPU call (no Triton one) takes
    the whole cache as its operand (no slice or gather of a layer or row ahead of it); its module
    copies by TMA (cp.async.bulk.tensor, waited on through mbarriers) and multiplies on the tensor
    cores (wgmma.mma_async)."""
    text, modules = _lowered("NVIDIA H100 80GB HBM3", *_flat(_qwen_call(dense, jnp.bfloat16, r=8)))
    assert text.count(MOSAIC) == 1 and TRITON not in text and len(modules) == 1
    assert "dynamic_slice" not in text and "gather" not in text
    assert "cp.async.bulk.tensor" in modules[0] and "mbarrier" in modules[0] and "wgmma.mma_async" in modules[0]


def _flat(call):
    f, args = call
    return (f, *args)


def test_the_kernel_chosen_for_each_gpu_and_dtype():
    """Hopper and bf16: Mosaic GPU; an A100, float32 (TF32 on the tensor cores) or a head dim
    Mosaic does not tile: Triton; interpreted: Triton."""
    assert choose_gpu_kernel(jnp.bfloat16, 128, 2048, dense=True) == "triton"  # this CPU host
    with abstract_gpu("NVIDIA H200"):
        assert choose_gpu_kernel(jnp.bfloat16, 128, 16, dense=False) == "mosaic"
        assert choose_gpu_kernel(jnp.float16, 128, 2048, dense=True) == "mosaic"
        assert choose_gpu_kernel(jnp.float32, 128, 2048, dense=True) == "triton"
        assert choose_gpu_kernel(jnp.bfloat16, 80, 2048, dense=True) == "triton"
        assert choose_gpu_kernel(jnp.bfloat16, 128, 128, dense=False) == "triton"  # pages of 128: not whole in a block
        assert choose_gpu_kernel(jnp.bfloat16, 128, 2048, dense=True, interpret=True) == "triton"
    with abstract_gpu("NVIDIA A100-SXM4-80GB"):
        assert choose_gpu_kernel(jnp.bfloat16, 128, 2048, dense=True) == "triton"
    assert mosaic_fits(jnp.bfloat16, 64, 32, dense=False) and not mosaic_fits(jnp.bfloat16, 64, 96, dense=True)
    # lowered: the A100 gets the Triton call, the H100 the Mosaic GPU one
    text, _ = _lowered("NVIDIA A100-SXM4-80GB", *_flat(_qwen_call(True, jnp.bfloat16, r=1)))
    assert text.count(TRITON) == 1 and MOSAIC not in text


@pytest.mark.skipif(not hasattr(plgpu, "InterpretGPUParams"), reason="the grid is read from jax 0.12's mpmd_map")
def test_one_slot_is_split_to_fill_the_gpu():
    """One row of Qwen3-8B over 2048 positions: 8 (KV head, query block) programs, each split into
    32 (one key block of 64 a split), 256 programs: the kernel launched has that grid."""
    assert splits(8, 2048 // 64) == 32 and 8 * 32 == MIN_PROGRAMS
    f, args = _qwen_call(True, jnp.bfloat16, r=1)
    with abstract_gpu():
        jaxpr = jax.make_jaxpr(f)(*args)

    def grids(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "mpmd_map":
                yield from (m.grid for m in e.params["meshes"])
            for p in e.params.values():
                inner = getattr(p, "jaxpr", p)
                if hasattr(inner, "eqns"):
                    yield from grids(inner)

    assert list(grids(jaxpr.jaxpr)) == [(1, 8, 32)]


_R, _T, _S = 2, 8, 128  # the forward tests' rows, chunk length and cache length


def _forward_program():
    """A target forward (head dim 64) of two chunks over a dense cache: a prefill chunk, then a
    second chunk reading it. A new function each time: jit's trace cache does not see a backend
    patched in."""
    cfg = tiny_config(vocab_size=48, hidden_size=64, num_layers=2).replace(num_heads=4, num_kv_heads=2, head_dim=64)
    valid = jnp.ones((_R, _T), bool)

    def two_chunks(p, toks, cache):
        pos0 = jnp.broadcast_to(jnp.arange(_T, dtype=jnp.int32), (_R, _T))
        out = forward(p, cfg, toks[0], pos0, cache_update(cache, pos0, valid))
        cache = out.cache.with_lengths(jnp.full((_R,), _T, jnp.int32))
        return forward(p, cfg, toks[1], pos0 + _T, cache_update(cache, pos0 + _T, valid)).logits

    return cfg, two_chunks


def test_a_target_forward_on_an_h100_reads_its_bf16_cache_through_mosaic(monkeypatch):
    """The forward over a bf16 cache, compiled for GPU and lowered for an H100: the Mosaic GPU call
    in each forward's layer loop, no Triton call."""
    for mod in (backend_mod, kernels, paged_kernel):
        monkeypatch.setattr(mod, "platform", lambda mesh=None: "gpu")
    cfg, two_chunks = _forward_program()
    params = tiny_target(cfg, seed=3).arrays()
    cache = KVCache.create(cfg, _R, _S, dtype=jnp.bfloat16, impl="pallas")
    text, modules = _lowered("NVIDIA H100 80GB HBM3", two_chunks, params, jnp.zeros((2, _R, _T), jnp.int32), cache)
    assert text.count(MOSAIC) == 2 and len(modules) == 2 and TRITON not in text


@needs_interpreter
def test_a_target_forward_through_the_interpreted_mosaic_kernel_equals_the_reference(monkeypatch):
    """The forward over a bf16 cache with the Mosaic GPU kernel under its interpreter (the second
    chunk's queries read the first chunk's keys from the cache, their own block joined through
    the log-sum-exp) gives the reference path's logits to bf16's precision."""
    cfg, two_chunks = _forward_program()
    params = tiny_target(cfg, seed=3).arrays()
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, _R, _T)), jnp.int32)
    ref = jax.jit(two_chunks)(params, tokens, KVCache.create(cfg, _R, _S, dtype=jnp.bfloat16, impl="reference"))
    mosaic = AttentionBackend(kernel=True, interpret=plgpu.InterpretGPUParams(), forced=True, gpu=True)
    monkeypatch.setattr(kv_cache, "attention_backend", lambda impl: mosaic)
    cfg, two_chunks = _forward_program()
    got = jax.jit(two_chunks)(params, tokens, KVCache.create(cfg, _R, _S, dtype=jnp.bfloat16, impl="pallas"))
    assert np.abs(np.asarray(got) - np.asarray(ref)).max() < 2e-2 * np.abs(np.asarray(ref)).max()


def test_the_mosaic_kernel_runs_per_shard_on_a_mesh_of_h100s():
    """On a 2 x 2 mesh of H100s (data x tensor) the paged read runs per shard: one Mosaic GPU call
    inside the shard_map (rows over data, KV heads over tensor), the pool not gathered."""
    _, args = _qwen_call(False, jnp.bfloat16, r=8)

    def paged(layer, q, k, v, table, kv_len, q_start):
        return paged_kernel.paged_attention_lse(q, k, v, table, kv_len, q_start, layer=layer[0], gpu=True,
                                                interpret=False)

    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="gpu")
    mesh = jax.sharding.AbstractMesh((2, 2), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                                     abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(paged).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(MOSAIC) == 1 and TRITON not in text and "all-gather" not in text and "all_gather" not in text
    assert text.count("sdy.manual_computation") == 1
