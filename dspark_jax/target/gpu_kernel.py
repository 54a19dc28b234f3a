"""Cache attention as a Pallas kernel for GPUs (the Triton backend), and the choice between it and
the Mosaic GPU kernel: each row's keys read where they lie, once, up to the last one its queries
may see.

The GPU counterpart of target/paged_kernel.py, with the same contract (`cache_attention_lse`:
normalised output and log-sum-exp per query, so the verification's new keys join through
`merge_parts`). The reference path gathers a row's keys into its `[max_len]` view and attends over
all of them, masked: on an H200 at 64 slots x 2048 positions that read the whole cache several
times a step (docs/performance.md). Here one program per (row, KV head, block of query rows, key
split) loops over the row's key blocks only up to the last key its queries may see (a loop with a
bound known at run time), the softmax online in registers:

- dense cache `[L, R', Nkv, S, D]` (heads-major, target/kv_cache.py): block j of row `table[r]`
  is positions `[j * block, (j + 1) * block)`, one strided load of `(block, D)`;
- paged pool `[L, P, Nkv, page_size, D]`: block j is page `table[r, j]`, one page a block.

Which kernel (`choose_gpu_kernel`, called by `gpu_cache_attention_lse`): on Hopper and later
(H100, H200) with a bf16 / f16 cache, the Mosaic GPU kernel (target/gpu_mosaic.py: TMA copies,
tensor-core `wgmma`), on the backend jax keeps; elsewhere (older GPUs, float32 caches, shapes
Mosaic does not take, interpret mode) this module's Pallas Triton kernel. Pallas Triton exists in
both supported jax versions (0.10.2 and 0.12, where it warns that it is deprecated), so it stays
while they are supported. What jax ships for GPU decoding does not take this layout:
`jax.experimental.pallas.ops.gpu.paged_attention` (Triton; deprecated in jax 0.12) takes one query
per row and no causal offset (a verified block has T queries at `q_start + t`), a pool
`[Nkv, P, page_size, D]` without a layer axis (ours would be copied per layer) and returns no
log-sum-exp; `decode_attention` (Triton, deprecated) reads no pages; `attention_mgpu` (Mosaic GPU,
Hopper) is dense training attention (no pages, no per-row lengths) and asserts a CUDA runtime at
trace time, so it cannot even be lowered on a CPU host.

Few rows leave most of a GPU's multiprocessors idle (one row of Qwen3-8B: 8 KV heads, 8
programs), so each (row, head, query block) is split into `splits` programs, as many as bring the
grid to `MIN_PROGRAMS` (about two per multiprocessor of an H100 / H200, 132) but no more than the
row's key blocks (flash decoding; target/gpu_splits.py, shared with the Mosaic GPU kernel). A
program takes its share of the keys the row holds at run time (the blocks up to its last visible
key, divided evenly), not of the cache's capacity, so a short row is spread over all its programs
too; each split returns its part's output and log-sum-exp and the parts are merged after the
call (`merge_splits`). One Qwen3-8B row over 2048 positions: 8 programs x 32 splits = 256; at
64 slots the grid is large enough unsplit.

Every index the kernel computes is clamped to its array, as a GPU does not check it: the layer,
the cache row or page id read from the table (an unused page is -1; a stale id may exceed the
pool), and the key blocks a row reads (a `kv_len` larger than the row's table or cache reads no
further than their end). Positions past `kv_len` inside the last block read are masked, their
values too (never written: anything, NaN included). Pallas interpret mode clamps out-of-bounds
windows silently; tests/target/test_gpu_kernel.py runs the kernel under the checked interpreter
(`pltpu.InterpretParams`, which raises on an out-of-bounds read) with such inputs.

Precision: the matrix products ask for `Precision.HIGHEST`, which Triton lowers as IEEE float32
for float32 operands (the default would be TF32, 10 mantissa bits); bf16 operands multiply in
bf16 and accumulate in float32. The softmax is float32 throughout.

The layer index, the page table (or the rows' cache rows), the key counts and the first query
positions are whole small arrays every program reads; the cache is passed whole and indexed in
place, so no layer or row of it is copied around the call.

Queries are heads-first `[R, Nkv, T * G, D]`, the rows of one KV head's G query heads
contiguous (query t's at rows t * G ..), blocked in `QUERY_BLOCK` rows and padded to a power of
two of at least 16 (Triton's block shapes and its matrix products need both). Row rho's query
sits at `q_start + rho // G` and sees key s iff `s < kv_len` and `(s - q_start) * G <= rho`.

Shapes the kernel takes (`gpu_kernel_fits`): head dim a power of two >= 16; a dense cache whose
length is a multiple of 16 (its block is the largest power of two up to `KEY_BLOCK` dividing
it); pages of a power of two >= 16 positions. Others read the reference path (the backend asks).

Lowering without a GPU: `jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))` gives the
StableHLO with one `__gpu$xla.gpu.triton` custom call carrying the Triton module (bytecode); jax
0.10.2 lowers it as is, jax 0.12 asks the device for its compute capability and needs an
abstract GPU device (`abstract_gpu()`: an empty abstract mesh naming an H100; it also names the
GPU `choose_gpu_kernel` chooses for). The Triton IR is compiled to GPU code only on a GPU host.
The kernel runs in Pallas interpret mode on any host, which is how the tests compare it with the
reference; its speed is measured only where a GPU is lent.
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import triton as pltriton

from dspark_jax.parallel.platform import device_kind
from dspark_jax.target.gpu_mosaic import mosaic_cache_attention_lse, mosaic_fits
from dspark_jax.target.gpu_splits import MIN_PROGRAMS, NO_KEYS
from dspark_jax.target.gpu_splits import merge_splits as _merge_splits
from dspark_jax.target.gpu_splits import splits as _splits

__all__ = ["gpu_cache_attention_lse", "triton_cache_attention_lse", "choose_gpu_kernel", "gpu_kernel_fits",
           "abstract_gpu", "KEY_BLOCK", "QUERY_BLOCK", "MIN_PROGRAMS", "GPU_KERNELS"]

KEY_BLOCK = 64  # dense-cache positions a loop step reads
QUERY_BLOCK = 64  # query rows (T * G) a program holds
MIN_TILE = 16  # Triton's smallest matrix-product tile
H100 = "NVIDIA H100 80GB HBM3"  # the device kind an H100 reports
GPU_KERNELS = ("auto", "mosaic", "triton")
# device kinds of Hopper (sm_90) and later NVIDIA GPUs: the ones Mosaic GPU's wgmma / TMA kernel runs on
_HOPPER_OR_LATER = re.compile(r"\b(H100|H200|H800|H20|GH200|B100|B200|GB200|B300|GB300)\b")


def abstract_gpu(device_kind: str = H100):
    """A context in which a program lowers for that GPU on a host without one
    (`jax.sharding.use_abstract_mesh` of an empty abstract mesh naming the device: jax 0.12's
    Triton lowering reads the compute capability from it; the mesh has no axes, so nothing is
    sharded)."""
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="gpu")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device))


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _dense_block(seq: int) -> int:
    """The largest power of two up to KEY_BLOCK that divides the cache length (0: none >= 16)."""
    b = KEY_BLOCK
    while b >= MIN_TILE and seq % b:
        b //= 2
    return b if b >= MIN_TILE else 0


def gpu_kernel_fits(head_dim: int, seq_or_page: int, dense: bool) -> bool:
    """Whether the GPU kernel takes a cache of these shapes (else the reference path reads it)."""
    if not (_pow2(head_dim) and head_dim >= MIN_TILE):
        return False
    return _dense_block(seq_or_page) > 0 if dense else _pow2(seq_or_page) and seq_or_page >= MIN_TILE


def _kernel(layer_ref, table_ref, kv_len_ref, q_start_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, dense: bool,
            block: int, blocks: int, splits: int, group: int, block_rows: int, scale: float):
    r, h, qb, split = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
    # clamped to the cache: a GPU reads whatever lies past an array's end
    layer = jnp.clip(layer_ref[0], 0, k_ref.shape[0] - 1)
    kv_len, q_start = kv_len_ref[r], q_start_ref[r]
    first_row = qb * block_rows
    # the last key the block's last query may see; the blocks up to it, at most the row's; no key: none
    last_key = jnp.minimum(kv_len - 1, q_start + (first_row + block_rows - 1) // group)
    steps = jnp.where(last_key >= 0, jnp.minimum(last_key // block + 1, blocks), 0)
    per_split = (steps + splits - 1) // splits  # this split's share of the blocks the row holds now
    first = split * per_split
    q = q_ref[...]  # [block_rows, D]
    rho = first_row + jax.lax.broadcasted_iota(jnp.int32, (block_rows, block), 0)
    offset = jax.lax.broadcasted_iota(jnp.int32, (block_rows, block), 1)
    inside_v = jax.lax.broadcasted_iota(jnp.int32, (block, q.shape[1]), 0)
    row = jnp.clip(table_ref[r], 0, k_ref.shape[1] - 1) if dense else None

    def body(j, carry):  # j < steps <= blocks: the window and the table entry lie inside their arrays
        acc, m, l = carry
        if dense:
            k = k_ref[layer, row, h, pl.ds(j * block, block), :]
            v = v_ref[layer, row, h, pl.ds(j * block, block), :]
        else:
            page = jnp.clip(table_ref[r * blocks + j], 0, k_ref.shape[1] - 1)  # < 0: no page (masked)
            k = k_ref[layer, page, h, :, :]
            v = v_ref[layer, page, h, :, :]
        v = jnp.where(j * block + inside_v < kv_len, v, jnp.zeros_like(v))  # positions never written
        dt = jnp.promote_types(q.dtype, k.dtype)
        s = jax.lax.dot_general(q.astype(dt), k.astype(dt), (((1,), (1,)), ((), ())),
                                precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32) * scale
        key_pos = j * block + offset
        visible = (key_pos < kv_len) & ((key_pos - q_start) * group <= rho)
        s = jnp.where(visible, s, NO_KEYS)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l = alpha * l + jnp.sum(p, axis=1)
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=jax.lax.Precision.HIGHEST,
                                 preferred_element_type=jnp.float32)
        return alpha[:, None] * acc + pv, m_new, l

    init = (jnp.zeros(q.shape, jnp.float32), jnp.full((block_rows,), NO_KEYS, jnp.float32),
            jnp.zeros((block_rows,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(first, jnp.minimum(steps, first + per_split), body, init)
    seen = l > 0.0
    o_ref[...] = acc / jnp.where(seen, l, 1.0)[:, None]
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), NO_KEYS)


def _whole(x, interpret) -> pl.BlockSpec:
    """x passed whole. Compiled or plainly interpreted: left where it lies (`pl.ANY`, indexed in
    place). Under the checked interpreter (`pltpu.InterpretParams`, which refuses direct reads of
    `pl.ANY` buffers as TPU HBM) one block of the whole array, so its reads are bounds-checked."""
    if interpret is False or interpret is True:
        return pl.BlockSpec(memory_space=pl.ANY)
    return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


def _target_kind() -> str:
    """The device kind the program is compiled for: the abstract device of the abstract mesh set
    (`abstract_gpu()`, even an empty mesh), else that of the mesh or default device."""
    abstract = jax.sharding.get_abstract_mesh().abstract_device
    return abstract.device_kind if abstract is not None else device_kind()


def choose_gpu_kernel(dtype, head_dim: int, seq_or_page: int, dense: bool, interpret=False) -> str:
    """"mosaic" where the Mosaic GPU kernel takes the cache (bf16 / f16: its float32 products would
    be TF32) and the program is compiled for a Hopper or later GPU, or interpreted by Mosaic GPU's
    interpreter (`interpret` a `plgpu.InterpretGPUParams`, jax 0.12); else "triton" (plain Pallas
    interpret mode, `True`, and the checked interpreter run the Triton kernel)."""
    if not mosaic_fits(dtype, head_dim, seq_or_page, dense):
        return "triton"
    if interpret is False:
        return "mosaic" if _HOPPER_OR_LATER.search(_target_kind()) else "triton"
    return "mosaic" if isinstance(interpret, getattr(plgpu, "InterpretGPUParams", ())) else "triton"


def gpu_cache_attention_lse(layer, q, k_cache, v_cache, table, kv_len, q_start, *, dense: bool,
                            interpret=False, kernel: str = "auto"):
    """The GPU cache kernel `kernel` ("auto": `choose_gpu_kernel`; "mosaic": target/gpu_mosaic.py,
    `interpret` then None / False or a `plgpu.InterpretGPUParams`; "triton": this module's) on
    `triton_cache_attention_lse`'s arguments, with its returns."""
    if kernel == "auto":
        kernel = choose_gpu_kernel(k_cache.dtype, q.shape[-1], k_cache.shape[3], dense, interpret)
    if kernel == "mosaic":
        return mosaic_cache_attention_lse(layer, q, k_cache, v_cache, table, kv_len, q_start, dense=dense,
                                          interpret=None if interpret is False else interpret)
    if kernel != "triton":
        raise ValueError(f"GPU cache kernel {kernel!r}: one of {GPU_KERNELS}")
    return triton_cache_attention_lse(layer, q, k_cache, v_cache, table, kv_len, q_start, dense=dense,
                                      interpret=interpret)


def triton_cache_attention_lse(layer, q, k_cache, v_cache, table, kv_len, q_start, *, dense: bool,
                               interpret=False):
    """q [R, T, Nq, D] against layer `layer` ([1] int32) of a dense cache [L, R', Nkv, S, D] (table
    [R]: each query row's cache row) or a paged pool [L, P, Nkv, page_size, D] (table [R, M]: page
    ids, < 0 none). Key s of row r is visible to query t iff s < min(kv_len[r], the row's
    capacity: S, or M * page_size) and s <= q_start[r] + t.
    -> (out [R, T, Nq, D] float32, lse [R, T, Nq] float32; NO_KEYS and out 0 where a query sees
    none). `interpret`: False (compiled for GPU), True (Pallas interpret mode) or a
    `pltpu.InterpretParams` (the checked interpreter). One shard's arrays (target/paged_kernel.py
    runs it per shard on a mesh)."""
    r, t, nq, d = q.shape
    nkv, inner = k_cache.shape[2], k_cache.shape[3]
    if not gpu_kernel_fits(d, inner, dense):
        raise ValueError(f"the GPU cache kernel needs a power-of-two head dim >= {MIN_TILE} and "
                         f"{'a cache length that is a multiple of 16' if dense else 'pages of a power of two >= 16'}; "
                         f"got head dim {d}, {'length' if dense else 'page size'} {inner}: read it with the reference")
    g = nq // nkv
    rows = t * g
    block_rows = max(MIN_TILE, min(QUERY_BLOCK, 1 << (rows - 1).bit_length()))
    padded = -(-rows // block_rows) * block_rows
    block = _dense_block(inner) if dense else inner
    blocks = inner // block if dense else table.shape[1]  # key blocks a row holds
    splits = _splits(r * nkv * (padded // block_rows), blocks)
    qh = q.reshape(r, t, nkv, g, d).transpose(0, 2, 1, 3, 4).reshape(r, nkv, rows, d)
    if padded != rows:
        qh = jnp.pad(qh, ((0, 0), (0, 0), (0, padded - rows), (0, 0)))
    table = table.astype(jnp.int32).reshape(-1)
    kv_len, q_start = kv_len.astype(jnp.int32), q_start.astype(jnp.int32)
    kernel = functools.partial(_kernel, dense=dense, block=block, blocks=blocks, splits=splits, group=g,
                               block_rows=block_rows, scale=1.0 / math.sqrt(d))
    whole = [_whole(x, interpret) for x in (layer, table, kv_len, q_start)]
    qmap = lambda i, h, qb, sp: (i, h, qb, 0)  # noqa: E731
    out, lse = pl.pallas_call(
        kernel, grid=(r, nkv, padded // block_rows, splits), interpret=interpret,
        in_specs=whole + [pl.BlockSpec((None, None, block_rows, d), qmap)]
        + [_whole(x, interpret) for x in (k_cache, v_cache)],
        out_specs=[pl.BlockSpec((None, None, None, block_rows, d), lambda i, h, qb, sp: (i, h, sp, qb, 0)),
                   pl.BlockSpec((None, None, None, block_rows), lambda i, h, qb, sp: (i, h, sp, qb))],
        out_shape=[jax.ShapeDtypeStruct((r, nkv, splits, padded, d), jnp.float32),
                   jax.ShapeDtypeStruct((r, nkv, splits, padded), jnp.float32)],
        # interpreted, Triton's parameters mean nothing (and the checked interpreter takes no other backend's)
        compiler_params=None if interpret is not False else pltriton.CompilerParams(num_warps=4, num_stages=2),
    )(layer, table, kv_len, q_start, qh, k_cache, v_cache)
    out, lse = _merge_splits(out, lse)
    out = out[:, :, :rows].reshape(r, nkv, t, g, d).transpose(0, 2, 1, 3, 4).reshape(r, t, nq, d)
    lse = lse[:, :, :rows].reshape(r, nkv, t, g).transpose(0, 2, 1, 3).reshape(r, t, nq)
    return out, lse

