"""The paged-attention kernel (target/paged_kernel.py) lowered and compiled by the real TPU compiler
(XLA:TPU and Mosaic) for TPU slices, no TPU present (parallel/topology.py): a tiny shape, Qwen3-8B
in bf16 and SmolLM2 in f32 on v5e and v6e (Qwen3-8B on v7x too), and Qwen3-8B on a tensor-parallel
v6e-4 mesh through the kernel's shard_map, without gathering the pool. A compiler error fails
the test with the compiler's message; a block that breaks TPU tiling is refused, so these
compiles do check what a TPU would."""

from __future__ import annotations

import functools
import os
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding

from dspark_jax.parallel.sharding import logical_to_pspec
from dspark_jax.parallel.topology import slice_mesh
from dspark_jax.target.own_keys import OwnKeys
from dspark_jax.target.paged_kernel import (
    DENSE_CACHE_AXES,
    PAGE_AXES,
    dense_attention_lse,
    paged_attention_lse,
    resolve_impl,
)
from dspark_jax.target.paged_kv import pages_per_slot
from dspark_jax.target.query_prep import QueryPrep

pytest.importorskip("libtpu", reason="the TPU compiler ships in libtpu, not installed: pip install -e '.[aot]'")

# (rows, queries per row, query heads, KV heads, head_dim, page size, context, dtype)
TINY = (4, 3, 4, 2, 8, 5, 13, jnp.float32)
QWEN3_8B = (8, 8, 32, 8, 128, 16, 2048, jnp.bfloat16)  # a verification block of 8 queries per row
SMOLLM2 = (8, 8, 9, 3, 64, 16, 1024, jnp.float32)


@functools.cache
def _mesh(name: str, tensor: int = 1):
    # other processes on the machine may compile for TPU too: deviceless, they share no chip
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    return slice_mesh(name, -1, 1, tensor)


def _arg(mesh, shape, dt, names):
    """An abstract argument laid out on `mesh` as the rules table places its logical axes."""
    return jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, logical_to_pspec(names, shape, mesh)))


def _compiled_or_fail(mesh, f, args, what: str):
    """`f` lowered and compiled for `mesh`'s devices; a compiler error fails the test with the
    compiler's words first, not a traceback."""
    with jax.set_mesh(mesh):
        try:
            return jax.jit(f).lower(*args).compile()
        except (ValueError, jax.errors.JaxRuntimeError) as e:
            pytest.fail(f"the TPU compiler refused {what} on {mesh.devices.flat[0].device_kind}:\n{e}")


def _compile(mesh, r, t, nq, nkv, d, ps, ctx, dtype, layers=2):
    """Lower and compile one layer's kernel call (the layer index traced, as in the scan over
    layers) for `mesh`'s devices; a compiler error is re-raised as the test's failure message."""
    m = pages_per_slot(ctx, ps)
    pool = (layers, r * m, nkv, ps, d)

    arg = functools.partial(_arg, mesh)
    args = (arg((), jnp.int32, ()), arg((r, t, nq, d), dtype, ("batch", None, "act_heads", None)),
            arg(pool, dtype, PAGE_AXES), arg(pool, dtype, PAGE_AXES), arg((r, m), jnp.int32, ("batch", None)),
            arg((r,), jnp.int32, ("batch",)), arg((r,), jnp.int32, ("batch",)))
    def f(layer, q, k, v, table, kv_len, q_start):
        return paged_attention_lse(q, k, v, table, kv_len, q_start, layer=layer)

    with jax.set_mesh(mesh):
        try:
            return jax.jit(f).lower(*args).compile()
        except (ValueError, jax.errors.JaxRuntimeError) as e:  # the compiler's words first, not a traceback
            pytest.fail(f"the TPU compiler refused the paged kernel at {(r, t, nq, nkv, d, ps, ctx)} "
                        f"{jnp.dtype(dtype).name} on {mesh.devices.flat[0].device_kind}:\n{e}")


def _kernels(compiled) -> list[str]:
    """The Mosaic kernels' lines in the compiled TPU program."""
    return [line for line in compiled.as_text().splitlines() if 'custom_call_target="tpu_custom_call"' in line]


@pytest.mark.parametrize("shape", [TINY, QWEN3_8B, SMOLLM2], ids=["tiny", "qwen3_8b_bf16", "smollm2_f32"])
@pytest.mark.parametrize("slice_name", ["v5e-1", "v6e-1"])
def test_kernel_compiles_for_tpu(slice_name, shape):
    mesh = _mesh(slice_name)
    assert resolve_impl("auto", mesh) == "pallas"  # chosen for the slice, not for this CPU host
    compiled = _compile(mesh, *shape)
    assert len(_kernels(compiled)) == 1  # Mosaic, not interpret mode
    cost = compiled.cost_analysis()
    r, t, nq, nkv, d, _, ctx, dtype = shape
    # the kernel's declared CostEstimate against attention's analytic count: QK^T and PV are 4 flops per
    # (query, key, dim), one exp per (query, key); padding rows to the tile and the context to whole
    # pages may at most double it
    flops, exps = 4 * r * t * nq * ctx * d, r * t * nq * ctx
    assert flops <= cost["flops"] <= 2 * flops and exps <= cost["transcendentals"] <= 2 * exps
    kv_bytes = 2 * r * ctx * nkv * d * jnp.dtype(dtype).itemsize  # the rows' K and V of one layer, read once
    assert cost["bytes accessed"] >= kv_bytes
    if d % 128 == 0:  # the pool read once, in place (with head_dim < 128 XLA relayouts it first: module docstring)
        assert cost["bytes accessed"] < 1.25 * kv_bytes


def test_kernel_compiles_for_v7x():
    compiled = _compile(_mesh("v7x-8"), *QWEN3_8B)
    assert len(_kernels(compiled)) == 1


def test_kernel_compiles_tensor_parallel_without_gathering_the_pool():
    """v6e-4, tensor 4: each chip's kernel reads its 2 of the 8 KV heads (the output block of a
    shard is [rows, 2, ..]) and the program moves nothing between chips."""
    mesh = _mesh("v6e-4", 4)
    compiled = _compile(mesh, *QWEN3_8B)
    (kernel,) = _kernels(compiled)
    r, t, nq, nkv, d = QWEN3_8B[:5]
    assert f"f32[{r},{nkv // 4},{t * nq // nkv},{d}]" in kernel
    assert not re.search(r"all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter", compiled.as_text())
    m = compiled.memory_analysis()
    pool = 2 * 2 * r * pages_per_slot(QWEN3_8B[6], QWEN3_8B[5]) * QWEN3_8B[5] * nkv * d * 2  # K, V of 2 layers, bf16
    assert m.argument_size_in_bytes < pool / 4 + 2**20  # a quarter of the pool per chip


def test_a_block_that_breaks_tpu_tiling_is_refused():
    """A block whose second-to-last dimension is a squeezed head (a page [ps, Nkv, D] read one head
    at a time) cannot be tiled on TPU: the deviceless compile refuses it as a TPU would."""
    from jax.experimental import pallas as pl

    mesh = _mesh("v6e-1")

    def copy(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    spec = pl.BlockSpec((16, None, 128), lambda h: (0, h, 0))
    f = pl.pallas_call(copy, grid=(8,), in_specs=[spec], out_specs=spec,
                       out_shape=jax.ShapeDtypeStruct((16, 8, 128), jnp.float32))
    x = jax.ShapeDtypeStruct((16, 8, 128), jnp.float32, sharding=NamedSharding(mesh, jax.sharding.PartitionSpec()))
    with jax.set_mesh(mesh), pytest.raises(Exception, match="divisible by 8 and 128"):
        jax.jit(f).lower(x).compile()


def _compile_dense(mesh, r, t, nq, nkv, d, ctx, dtype, layers=8):
    """One layer's dense-cache kernel call [L, R, Nkv, S, D], compiled for `mesh`'s devices (8
    layers: a cache small enough for VMEM is prefetched there whole by XLA:TPU, as v7x does with 2)."""
    cache = (layers, r, nkv, ctx, d)

    arg = functools.partial(_arg, mesh)
    args = (arg((), jnp.int32, ()), arg((r, t, nq, d), dtype, ("batch", None, "act_heads", None)),
            arg(cache, dtype, DENSE_CACHE_AXES), arg(cache, dtype, DENSE_CACHE_AXES),
            arg((r,), jnp.int32, ("batch",)), arg((r,), jnp.int32, ("batch",)))

    def f(layer, q, k, v, kv_len, q_start):
        return dense_attention_lse(q, k, v, kv_len, q_start, layer=layer)

    return _compiled_or_fail(mesh, f, args, f"the dense-cache kernel at {(r, t, nq, nkv, d, ctx)} "
                                            f"{jnp.dtype(dtype).name}")


# (rows, queries per row, query heads, KV heads, head_dim, context, dtype)
DENSE_SHAPES = {"qwen3_8b_bf16": (8, 8, 32, 8, 128, 2048, jnp.bfloat16),
                "decode_1_row": (1, 1, 32, 8, 128, 2048, jnp.bfloat16),
                "smollm2_f32_ragged_end": (8, 8, 9, 3, 64, 1000, jnp.float32)}


# every shape on v5e and v6e, the Qwen3-8B one on v5p and v7x (fewer compiles)
DENSE_CASES = [(g, s) for g in ("v5e-1", "v6e-1") for s in DENSE_SHAPES]
DENSE_CASES += [(g, "qwen3_8b_bf16") for g in ("v5p-8", "v7x-8")]


@pytest.mark.parametrize(("slice_name", "shape"), DENSE_CASES, ids=[f"{g}-{s}" for g, s in DENSE_CASES])
def test_dense_kernel_compiles_for_every_generation(slice_name, shape):
    """The dense-cache kernel lowers through Mosaic for v5e, v6e, v5p and v7x, and reads each K / V
    position of a layer at most once (the compiler's bytes against the cache layer's size)."""
    r, t, nq, nkv, d, ctx, dtype = DENSE_SHAPES[shape]
    mesh = _mesh(slice_name)
    compiled = _compile_dense(mesh, r, t, nq, nkv, d, ctx, dtype)
    assert len(_kernels(compiled)) == 1
    chips = mesh.devices.size if r % mesh.devices.size == 0 else 1  # rows split over the data axis
    kv_bytes = 2 * r * ctx * nkv * d * jnp.dtype(dtype).itemsize / chips  # one chip's rows, read once
    cost = compiled.cost_analysis()
    assert kv_bytes <= cost["bytes accessed"]
    if d % 128 == 0:  # read in place: no relayout of the cache around the kernel
        assert cost["bytes accessed"] < 1.25 * kv_bytes


def test_dense_kernel_compiles_tensor_parallel_without_gathering_the_cache():
    """v6e-4, tensor 4: each chip reads its 2 of the 8 KV heads; nothing moves between chips."""
    mesh = _mesh("v6e-4", 4)
    r, t, nq, nkv, d, ctx, dtype = DENSE_SHAPES["qwen3_8b_bf16"]
    compiled = _compile_dense(mesh, r, t, nq, nkv, d, ctx, dtype)
    (kernel,) = _kernels(compiled)
    assert f"f32[{r},{nkv // 4},{t * nq // nkv},{d}]" in kernel
    assert not re.search(r"all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter", compiled.as_text())


def _compile_dense_with_own(mesh, r, t, nq, nkv, d, ctx, dtype, norm: bool, layers=8):
    """One layer's dense-cache kernel call with the verification's own keys and raw queries
    prepared in the kernel (`OwnKeys`, `QueryPrep`), compiled for `mesh`'s devices."""
    cache = (layers, r, nkv, ctx, d)

    arg = functools.partial(_arg, mesh)
    rows = ("batch",)
    args = (arg((), jnp.int32, ()), arg((r, t, nq, d), dtype, ("batch", None, "act_heads", None)),
            arg(cache, dtype, DENSE_CACHE_AXES), arg(cache, dtype, DENSE_CACHE_AXES),
            arg((r,), jnp.int32, rows), arg((r, t, nkv, d), dtype, ("batch", None, "act_heads", None)),
            arg((r, t, nkv, d), dtype, ("batch", None, "act_heads", None)), arg((r,), jnp.int32, rows),
            arg((r, t, d), jnp.float32, ("batch", None, None)), arg((r, t, d), jnp.float32, ("batch", None, None)),
            arg((d,), dtype, (None,)))

    def f(layer, q, k, v, start, ok, ov, own_len, cos, sin, weight):
        prep = QueryPrep(weight if norm else None, cos, sin, 1e-6)
        return dense_attention_lse(q, k, v, start, start, layer=layer, own=OwnKeys(ok, ov, own_len), q_prep=prep,
                                   out_dtype=dtype)

    return _compiled_or_fail(mesh, f, args, f"the dense-cache kernel with own keys at {(r, t, nq, nkv, d, ctx)} "
                                            f"{jnp.dtype(dtype).name}")


# (rows, queries per row, query heads, KV heads, head_dim, context, dtype, q norm): the target-only
# step (one column, every row's own keys one block), a drafting round's view (8 columns, one
# block), a view of more own keys than `OWN_WHOLE_MAX_KEYS` (a row's own keys a step), SmolLM2
# (head dim 64, float32, RoPE without a q norm)
OWN_SHAPES = {"step_8_rows": (8, 1, 32, 8, 128, 2048, jnp.bfloat16, True),
              "round_8x8": (8, 8, 32, 8, 128, 2048, jnp.bfloat16, True),
              "round_64x16": (64, 16, 32, 8, 128, 512, jnp.bfloat16, True),
              "smollm2_f32": (8, 8, 9, 3, 64, 1000, jnp.float32, False)}
OWN_CASES = [(g, s) for g in ("v5e-1", "v6e-1") for s in OWN_SHAPES]
OWN_CASES += [(g, s) for g in ("v5p-8", "v7x-8") for s in ("step_8_rows", "round_8x8")]


@pytest.mark.parametrize(("slice_name", "shape"), OWN_CASES, ids=[f"{g}-{s}" for g, s in OWN_CASES])
def test_kernel_with_own_keys_and_query_prep_compiles(slice_name, shape):
    """The kernel taking the own keys into its softmax and preparing raw queries lowers through
    Mosaic for v5e, v6e, v5p and v7x: one kernel call, nothing else around it but layouts."""
    mesh = _mesh(slice_name)
    compiled = _compile_dense_with_own(mesh, *OWN_SHAPES[shape])
    assert len(_kernels(compiled)) == 1


def test_kernel_with_own_keys_compiles_tensor_parallel_without_collectives():
    """v6e-4, tensor 4: own keys and the queries' preparation split with the KV heads; nothing
    moves between chips."""
    compiled = _compile_dense_with_own(_mesh("v6e-4", 4), *OWN_SHAPES["round_8x8"])
    assert len(_kernels(compiled)) == 1
    assert not re.search(r"all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter", compiled.as_text())
