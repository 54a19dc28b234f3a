"""The GPU cache-attention kernel (target/gpu_kernel.py): in Pallas interpret mode against the
reference attention (dense cache and paged pool; rows that see all, some or none of their keys;
several query blocks; chosen cache rows; unwritten positions holding NaN / inf; keys split among
programs); under the checked interpreter with a row claiming more keys than its table or cache
holds, stale page ids and an out-of-range layer and cache row (every index clamped); lowered for
CUDA on this CPU machine for an abstract H100 on every supported jax (Triton, one call reading the
cache in place, IEEE float32 products, one slot filling the GPU), chosen by the attention backend
where a program is compiled for GPU, and a whole target forward through it equal to the reference
path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.lib.mlir import ir
from jax._src.lib.triton import dialect as tt_dialect
from jax.experimental.pallas import tpu as pltpu

from dspark_jax.target import attention_backend as backend_mod
from dspark_jax.target import kernels, kv_cache, paged_kernel
from dspark_jax.target.attention import cache_update
from dspark_jax.target.attention_backend import AttentionBackend, attention_backend
from dspark_jax.target.forward import forward
from dspark_jax.target.gpu_kernel import (
    MIN_PROGRAMS,
    QUERY_BLOCK,
    _splits,
    gpu_cache_attention_lse,
    gpu_kernel_fits,
)
from dspark_jax.target.kv_cache import KVCache
from dspark_jax.target.paged_kernel import attention_lse, dense_attention_lse, paged_attention_lse
from dspark_jax.testing.gpu_lowering import custom_call_configs, lower_for_gpu
from dspark_jax.testing.tiny import tiny_config, tiny_target

TRITON = "__gpu$xla.gpu.triton"
H100, A100 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"


def _mask(kv_len, q_start, s, t):
    pos = np.arange(s)
    qpos = q_start[:, None] + np.arange(t)[None]
    return (pos[None, None] < kv_len[:, None, None]) & (pos[None, None] <= qpos[:, :, None])


def _check(out, lse, want, want_lse, mask):
    seen = mask.any(-1)
    np.testing.assert_allclose(np.asarray(out)[seen], np.asarray(want)[seen], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(lse)[seen], np.asarray(want_lse)[seen], rtol=2e-5, atol=2e-5)
    assert (np.asarray(out)[~seen] == 0).all()


@pytest.mark.parametrize("s,t,g", [(48, 3, 2), (128, 3, 2), (320, 40, 2), (1024, 3, 2)],
                         ids=["blocks-of-16", "blocks-of-64", "two-query-blocks", "four-key-splits"])
def test_dense_kernel_equals_reference(s, t, g):
    rng = np.random.default_rng(s)
    r, nkv, d, layers = 4, 2, 16, 2
    k = rng.normal(size=(layers, r, nkv, s, d)).astype(np.float32)
    v = rng.normal(size=(layers, r, nkv, s, d)).astype(np.float32)
    kv_len = np.array([s - 5, 6, 0, min(s - 6, 40)])  # row 2 sees no key at all
    q_start = np.array([s - 5 - t, 4, 0, 1])
    unwritten = np.arange(s)[None, None, None, :] >= kv_len.max()  # beyond every row's keys, in its last block
    k, v = np.where(unwritten[..., None], np.nan, k), np.where(unwritten[..., None], np.inf, v)
    q = jnp.asarray(rng.normal(size=(r, t, nkv * g, d)), jnp.float32)
    assert t * g <= QUERY_BLOCK or s == 320  # that case spans two query blocks (16 programs)
    # 8 programs (4 rows x 2 heads): split up to 256 programs, one key block a split at most
    blocks = s // 64 if s % 64 == 0 else s // 16
    assert _splits(r * nkv * (2 if s == 320 else 1), blocks) == blocks  # 3, 2, 5, 16 splits
    rows = np.array([3, 1, 0, 2])  # each query row reads another cache row
    kv_len, q_start = kv_len[rows], q_start[rows]  # each query row's own cache row's counts
    mask = _mask(kv_len, q_start, s, t)
    for layer in (0, 1):
        out, lse = dense_attention_lse(q, jnp.asarray(k), jnp.asarray(v), jnp.asarray(kv_len),
                                       jnp.asarray(q_start), layer=layer, rows=jnp.asarray(rows), gpu=True,
                                       interpret=True)
        kr = np.nan_to_num(k[layer][rows].swapaxes(1, 2), nan=0.0)
        vr = np.nan_to_num(v[layer][rows].swapaxes(1, 2), posinf=0.0)
        want, want_lse = attention_lse(q, jnp.asarray(kr), jnp.asarray(vr), jnp.asarray(mask))
        _check(out, lse, want, want_lse, mask)


def test_paged_kernel_equals_reference():
    rng = np.random.default_rng(7)
    r, t, nkv, g, d, ps, m, layers = 3, 4, 2, 3, 32, 16, 8, 2
    pages = r * m + 2
    k = rng.normal(size=(layers, pages, nkv, ps, d)).astype(np.float32)
    v = rng.normal(size=(layers, pages, nkv, ps, d)).astype(np.float32)
    table = rng.permutation(pages)[: r * m].reshape(r, m)
    assert _splits(r * nkv, m) == m  # 6 programs, 8 pages a row: 8 splits of one page
    kv_len, q_start = np.array([100, 17, 0]), np.array([96, 13, 0])
    table[1, 2:] = -1  # no page past the row's keys
    table[2, :] = -1
    q = jnp.asarray(rng.normal(size=(r, t, nkv * g, d)), jnp.float32)
    mask = _mask(kv_len, q_start, m * ps, t)
    for layer in (0, 1):
        out, lse = paged_attention_lse(q, jnp.asarray(k), jnp.asarray(v), jnp.asarray(table), jnp.asarray(kv_len),
                                       jnp.asarray(q_start), layer=layer, gpu=True, interpret=True)
        gathered = lambda x: x[layer][np.maximum(table, 0)].transpose(0, 1, 3, 2, 4).reshape(r, m * ps, nkv, d)
        want, want_lse = attention_lse(q, jnp.asarray(gathered(k)), jnp.asarray(gathered(v)), jnp.asarray(mask))
        _check(out, lse, want, want_lse, mask)


def _lowered_for(kind, f, *args):
    """f lowered for CUDA on this CPU host for an abstract GPU of that kind: the StableHLO text and,
    per Triton call, its Triton module as text and its grid's program count."""
    lowered = lower_for_gpu(kind, f, *args)
    calls = []
    for config in custom_call_configs(lowered, TRITON):
        programs = int(np.prod([ir.IntegerAttr(config[f"grid_{a}"]).value for a in "xyz"]))
        with ir.Context() as ctx:  # the call carries the Triton module as bytecode
            tt_dialect.register_dialect(ctx)
            calls.append((str(ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes)), programs))
    return lowered.as_text(), calls


def _qwen_call(dense, dtype, r):
    """Qwen3-8B's attention shapes (r rows x a verification block of 8 queries, 32 query / 8 KV
    heads of 128, 2048 positions, pages of 16): the kernel's function and abstract arguments."""
    t, nq, nkv, d, s, ps, layers = 8, 32, 8, 128, 2048, 16, 2
    q = jax.ShapeDtypeStruct((r, t, nq, d), dtype)
    kc = jax.ShapeDtypeStruct((layers, r, nkv, s, d) if dense else (layers, r * s // ps, nkv, ps, d), dtype)
    lens = jax.ShapeDtypeStruct((r,), jnp.int32)
    layer = jax.ShapeDtypeStruct((), jnp.int32)
    if dense:
        return (lambda layer, q, k, v, kv_len, q_start: dense_attention_lse(
            q, k, v, kv_len, q_start, layer=layer, gpu=True, interpret=False)), (layer, q, kc, kc, lens, lens)
    return (lambda layer, q, k, v, table, kv_len, q_start: paged_attention_lse(
        q, k, v, table, kv_len, q_start, layer=layer, gpu=True, interpret=False)), (
        layer, q, kc, kc, jax.ShapeDtypeStruct((r, s // ps), jnp.int32), lens, lens)


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "paged"])
def test_kernel_lowers_for_cuda_reading_the_cache_in_place(dense):
    """Qwen3-8B's shapes in bf16 at 8 rows, for an A100 (Hopper takes the Mosaic GPU kernel in
    bf16: tests/target/test_gpu_mosaic.py): one Triton call takes the whole cache as its operand
    (no slice or gather of a layer or a row ahead of it); its module loads the keys and multiplies
    them (tt.load, tt.dot); 8 rows x 8 KV heads are 64 programs, split 4 ways to MIN_PROGRAMS."""
    f, args = _qwen_call(dense, jnp.bfloat16, r=8)
    text, calls = _lowered_for(A100, f, *args)
    assert text.count(TRITON) == 1 and len(calls) == 1
    assert "dynamic_slice" not in text and "gather" not in text
    module, programs = calls[0]
    assert "tt.load" in module and module.count("tt.dot") == 2
    assert programs == MIN_PROGRAMS


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "paged"])
def test_one_slot_fills_the_gpu_at_full_float32_precision(dense):
    """One row (one slot) of Qwen3-8B over 2048 positions in float32 (the Triton kernel on an H100
    too: Mosaic GPU's tensor-core products of float32 are TF32): its 8 programs are split to
    256 (about two per multiprocessor of a 132-SM H100 / H200), a split reading one key block (64
    positions, or a page) or more; both products are IEEE float32 in the Triton module (jax's
    default precision lowers them as TF32, 10 mantissa bits)."""
    f, args = _qwen_call(dense, jnp.float32, r=1)
    with jax.default_matmul_precision("default"):  # a serving process's (tests/conftest.py asks for "highest")
        _, calls = _lowered_for(H100, f, *args)
    [(module, programs)] = calls
    assert programs == MIN_PROGRAMS == 256
    dots = [line for line in module.splitlines() if "tt.dot" in line]
    # IEEE is tt.dot's default input precision, printed as nothing; TF32 prints `inputPrecision = tf32`
    assert len(dots) == 2 and all("inputPrecision" not in line and "xf32> *" in line for line in dots), dots


def _checked_case(dense):
    """Inputs whose unclamped indices fall outside their arrays: a row claiming more keys than its
    table (paged) or its cache (dense) holds, page ids past the pool, a cache row past the cache,
    the layer past the last. -> (args, the reference's out / lse over what the clamped kernel
    reads: the row's whole capacity, the last page / row / layer)."""
    rng = np.random.default_rng(5)
    r, t, nkv, g, d, ps, m, layers = 2, 3, 1, 2, 16, 16, 3, 2
    q = rng.normal(size=(r, t, nkv * g, d)).astype(np.float32)
    if dense:
        s = m * ps
        k, v = (rng.normal(size=(layers, r, nkv, s, d)).astype(np.float32) for _ in range(2))
        table = np.array([1, r + 3])  # the second row's cache row lies past the cache: its last
        read = np.minimum(table, r - 1)
        kr, vr = (x[layers - 1][read].swapaxes(1, 2) for x in (k, v))
    else:
        pages = r * m
        k, v = (rng.normal(size=(layers, pages, nkv, ps, d)).astype(np.float32) for _ in range(2))
        table = rng.permutation(pages).reshape(r, m)
        table[0, 1] = pages + 7  # a stale page id: the pool's last page
        read = np.minimum(table, pages - 1)
        kr, vr = (x[layers - 1][read].transpose(0, 1, 3, 2, 4).reshape(r, m * ps, nkv, d) for x in (k, v))
    kv_len = np.array([m * ps + 40, 20])  # the first row claims 40 keys more than it holds
    q_start = np.array([m * ps + 30, 17])  # its queries see all it holds
    mask = _mask(np.minimum(kv_len, m * ps), q_start, m * ps, t)
    want = attention_lse(jnp.asarray(q), jnp.asarray(kr), jnp.asarray(vr), jnp.asarray(mask))
    layer = np.array([layers + 2], np.int32)  # past the last layer: the last
    args = tuple(jnp.asarray(x) for x in (layer, q, k, v, table, kv_len, q_start))
    return args, want, mask


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "paged"])
def test_every_index_is_clamped_to_its_array(dense):
    """Under the checked interpreter (`pltpu.InterpretParams`: an out-of-bounds read raises, where
    plain interpret mode clamps it silently, as a GPU does not) a row claiming more keys than it
    holds, page ids and a cache row past their arrays and a layer past the last read nothing
    outside the arrays, and the output is the reference's over what the row holds."""
    args, (want, want_lse), mask = _checked_case(dense)
    out, lse = gpu_cache_attention_lse(*args, dense=dense, interpret=pltpu.InterpretParams())
    _check(out, lse, want, want_lse, mask)


def _gpu(monkeypatch):
    """Programs traced from here on are 'compiled for GPU' as far as the kernel choice goes."""
    for mod in (backend_mod, kernels, paged_kernel):
        monkeypatch.setattr(mod, "platform", lambda mesh=None: "gpu")


def test_backend_picks_the_gpu_kernel_where_compiled_for_gpu(monkeypatch):
    assert attention_backend("auto").kernel is False  # this CPU: the reference
    _gpu(monkeypatch)
    b = attention_backend("auto")
    assert (b.kernel, b.gpu, b.interpret) == (True, True, False)
    assert attention_backend("reference").kernel is False
    assert paged_kernel._interpret(gpu=True) is False  # called without the backend: compiled on GPU too
    assert gpu_kernel_fits(128, 2048, dense=True) and gpu_kernel_fits(64, 16, dense=False)
    assert not gpu_kernel_fits(80, 2048, dense=True)  # head dim not a power of two
    assert not gpu_kernel_fits(128, 2050, dense=True) and not gpu_kernel_fits(128, 8, dense=False)
    cfg = tiny_config(vocab_size=48, hidden_size=48, num_layers=1).replace(num_heads=2, num_kv_heads=1, head_dim=24)
    cache = KVCache.create(cfg, 2, 64, impl="pallas")
    forced = attention_backend("pallas")
    assert forced._kernel_for(cache, cache.k) is False  # a shape the GPU kernel does not take: the reference


def _forward_cfg():
    return tiny_config(vocab_size=48, hidden_size=64, num_layers=2).replace(num_heads=4, num_kv_heads=2, head_dim=16)


def test_forward_through_the_gpu_kernel_equals_the_reference(monkeypatch):
    """A prefill chunk into a dense cache, then a second chunk reading it: logits through the GPU
    kernel (interpreted) equal the reference path's; then the same program lowers for CUDA with
    the Triton call in each forward's layer loop."""
    cfg = _forward_cfg()
    params = tiny_target(cfg, seed=3).arrays()
    rng = np.random.default_rng(0)
    r, t, s = 2, 8, 64
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, r, t)), jnp.int32)
    valid = jnp.ones((r, t), bool)

    def program():  # a new function each time: jit's trace cache does not see the backend patched in
        def two_chunks(p, toks, cache):
            pos0 = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (r, t))
            out = forward(p, cfg, toks[0], pos0, cache_update(cache, pos0, valid))
            cache = out.cache.with_lengths(jnp.full((r,), t, jnp.int32))
            out = forward(p, cfg, toks[1], pos0 + t, cache_update(cache, pos0 + t, valid))
            return out.logits
        return jax.jit(two_chunks)

    ref = program()(params, tokens, KVCache.create(cfg, r, s, impl="reference"))
    interpreted_gpu = AttentionBackend(kernel=True, interpret=True, forced=True, gpu=True)
    with monkeypatch.context() as mp:
        mp.setattr(kv_cache, "attention_backend", lambda impl: interpreted_gpu)
        got = program()(params, tokens, KVCache.create(cfg, r, s, impl="pallas"))
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-4, atol=2e-4)

    _gpu(monkeypatch)
    text, _ = _lowered_for(H100, program(), params, tokens, KVCache.create(cfg, r, s, impl="auto"))
    assert text.count(TRITON) == 0  # "auto": a 16 KiB layer of cache does not pay for a call (kernel_pays)
    text, calls = _lowered_for(H100, program(), params, tokens, KVCache.create(cfg, r, s, impl="pallas"))
    assert text.count(TRITON) == 2 and len(calls) == 2  # one in each forward's layer loop
