"""Cache attention as a Mosaic GPU kernel (Hopper and later: H100, H200), the same contract as
target/gpu_kernel.py's Triton kernel (`gpu_cache_attention_lse`: normalised output and
log-sum-exp per query), on the GPU backend jax keeps.

One program (one warpgroup, 128 threads) per (row, KV head and block of 64 query rows, key
split). It copies its 64 query rows into shared memory once (TMA), then for each of its key blocks
(64 positions of a dense cache row, or 64 / page_size pages) copies K and V in by TMA, the page id
or cache row read from the table in global memory and clamped to the pool, and multiplies on the
tensor cores (`wgmma`): scores [64, 64] from Q and K^T, then the block's part of the output from P
and V. The softmax runs online in registers (WGMMA layout); P goes to the product through shared
memory (Mosaic GPU's interpreter takes a product's operands from shared memory only, and so does
this kernel, so that the interpreter runs the code a GPU runs). The next block's K and V are
copied in while the current one computes (two slots). The part's output and log-sum-exp go out
through shared memory by TMA; the splits' parts are merged after the call (target/gpu_splits.py,
as for the Triton kernel: one Qwen3-8B row over 2048 positions is 8 x 32 = 256 programs).

Why 64 query rows: a warpgroup's matrix product has M = 64; a verified block of T queries x G
query heads per KV head (Qwen3-8B: 8 x 4 = 32) is padded to it. Shapes it takes (`mosaic_fits`):
bf16 / f16 caches (the tensor cores multiply float32 only as TF32, which this project does not
accept for float32: a float32 cache reads the Triton kernel, IEEE), head dims that are multiples
of 64 (shared-memory tiles of (8, 64) with a 128-byte swizzle), a dense cache whose length is a
multiple of 64, pages of 16, 32 or 64 positions (a block holds whole pages). Queries are cast to
the cache's dtype.

Every index is clamped to its array, as in gpu_kernel.py: the layer, the cache row or page id (an
unused page is -1, a stale id may exceed the pool), the table entries a block's pages read (a
block past the row's table repeats its last page), and the key blocks (at most the row's: a
`kv_len` past the row's capacity reads no further). Positions past `kv_len` in the last block read
are masked in the scores, and their values zeroed in shared memory before the product (never
written: anything, NaN included).

Checked without a GPU: it lowers for CUDA on jax 0.10.2 and 0.12 (`plgpu.kernel`: a
`mosaic_gpu_v2` custom call carrying the Mosaic GPU module; no abstract device needed, and the
module holds the kernel's `wgmma` and TMA operations), and on jax 0.12 it runs under Mosaic
GPU's interpreter (`plgpu.InterpretGPUParams`, which also raises on an out-of-bounds read), which
is how tests/target/test_gpu_mosaic.py compares it with the reference and checks the clamps. It
has not run on a GPU: its speed, and that ptxas takes the module, are to be measured where one
is lent (target/gpu_kernel.py's `gpu_cache_attention_lse(kernel=...)` runs either kernel).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dspark_jax.target.gpu_splits import NO_KEYS, merge_splits
from dspark_jax.target.gpu_splits import splits as key_splits

__all__ = ["mosaic_cache_attention_lse", "mosaic_fits", "ROWS", "BLOCK"]

ROWS = 64  # query rows a program holds: a warpgroup's matrix-product M
BLOCK = 64  # keys a loop step reads: 64 positions of a dense row, or 64 / page_size pages
SLOTS = 2  # K / V buffers: the next block copied in while one computes
_TILE = (8, 64)  # shared-memory tiling and 128-byte swizzle of 16-bit operands
_SWIZZLE = 128


def mosaic_fits(dtype, head_dim: int, seq_or_page: int, dense: bool) -> bool:
    """Whether the Mosaic GPU kernel takes a cache of these shapes and dtype."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) or head_dim % 64:
        return False
    return seq_or_page % BLOCK == 0 if dense else seq_or_page in (16, 32, 64)


def _kernel(layer_ref, table_ref, kv_len_ref, q_start_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, dense: bool,
            page_size: int, pages: int, blocks: int, splits: int, q_blocks: int, group: int, scale: float):
    r, hq, split = lax.axis_index("row"), lax.axis_index("head_block"), lax.axis_index("split")
    h, qb = lax.div(hq, q_blocks), lax.rem(hq, q_blocks)
    d = q_ref.shape[-1]
    layer = jnp.clip(layer_ref[0], 0, k_ref.shape[0] - 1)
    block, per_block = BLOCK, BLOCK // page_size  # pages a block (dense: one "page" of BLOCK positions)
    # keys past the row's capacity do not exist (a longer kv_len reads no further)
    kv_len, q_start = jnp.minimum(kv_len_ref[r], k_ref.shape[3] if dense else pages * page_size), q_start_ref[r]
    first_row = qb * ROWS
    last_key = jnp.minimum(kv_len - 1, q_start + lax.div(first_row + ROWS - 1, group))
    steps = jnp.where(last_key >= 0, jnp.minimum(lax.div(jnp.maximum(last_key, 0), block) + 1, blocks), 0)
    per_split = lax.div(steps + splits - 1, splits)
    first = split * per_split
    end = jnp.minimum(steps, first + per_split)
    row = jnp.clip(table_ref[r], 0, k_ref.shape[1] - 1) if dense else None

    def kv_at(ref, j, c):
        """Page c of key block j (dense: the block's positions of the row)."""
        if dense:
            return ref.at[layer, row, h, pl.ds(j * block, block)]
        # a block's pages past the row's table repeat its last entry (their keys are past kv_len)
        entry = jnp.minimum(j * per_block + c, pages - 1)
        page = jnp.clip(table_ref[r * pages + entry], 0, k_ref.shape[1] - 1)  # < 0: no page (masked)
        return ref.at[layer, page, h]

    def scoped(q_smem, k_smem, v_smem, p_smem, o_smem, lse_smem, q_bar, k_bars, v_bars):
        plgpu.copy_gmem_to_smem(q_ref.at[r, h, pl.ds(first_row, ROWS)], q_smem, q_bar.at[0])

        def fetch(j, slot):
            for c in range(per_block):
                rows = pl.ds(c * page_size, page_size)
                plgpu.copy_gmem_to_smem(kv_at(k_ref, j, c), k_smem.at[slot, rows], k_bars.at[slot * per_block + c])
                plgpu.copy_gmem_to_smem(kv_at(v_ref, j, c), v_smem.at[slot, rows], v_bars.at[slot * per_block + c])

        def wait(bars, slot):
            for c in range(per_block):
                plgpu.barrier_wait(bars.at[slot * per_block + c])

        @pl.when(first < end)
        def _():
            fetch(first, 0)

        plgpu.barrier_wait(q_bar.at[0])
        rho = first_row + plgpu.broadcasted_iota(jnp.int32, (ROWS, block), 0, layout=plgpu.Layout.WGMMA)
        offset = plgpu.broadcasted_iota(jnp.int32, (ROWS, block), 1, layout=plgpu.Layout.WGMMA)

        def body(j, carry):
            acc, m, l = carry
            slot = lax.rem(j - first, SLOTS)

            @pl.when(j + 1 < end)
            def _():
                fetch(j + 1, lax.rem(j + 1 - first, SLOTS))

            wait(k_bars, slot)

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].T)
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((ROWS, block), jnp.float32)) * scale
            key_pos = j * block + offset
            visible = (key_pos < kv_len) & ((key_pos - q_start) * group <= rho)
            s = jnp.where(visible, s, NO_KEYS)
            m_new = jnp.maximum(m, s.max(axis=1))
            p = jnp.where(visible, jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0])), 0.0)
            alpha = jnp.exp(m - m_new)
            l = alpha * l + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            wait(v_bars, slot)

            @pl.when(j * block + block > kv_len)
            def _():  # the row's last block: positions past kv_len were never written
                inside = plgpu.broadcasted_iota(jnp.int32, (block, d), 0, layout=plgpu.Layout.WGMMA)
                vs = v_smem.at[slot]
                vs[...] = jnp.where(j * block + inside < kv_len, vs[...], jnp.zeros((), vs.dtype))
                plgpu.commit_smem()

            p_smem[...] = p.astype(p_smem.dtype)
            plgpu.commit_smem()

            def pv(acc_ref):  # a fresh (zeroed) accumulator, added to the rescaled output in registers
                plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
                return acc_ref[...]

            return acc + pl.run_scoped(pv, plgpu.ACC((ROWS, d), jnp.float32)), m_new, l

        acc = plgpu.layout_cast(jnp.zeros((ROWS, d), jnp.float32), plgpu.Layout.WGMMA)
        m = plgpu.layout_cast(jnp.full((ROWS,), NO_KEYS, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc, m, l = lax.fori_loop(first, end, body, (acc, m, l))
        seen = l > 0.0
        safe_l = jnp.where(seen, l, 1.0)
        o_smem[...] = acc / lax.broadcast_in_dim(safe_l, acc.shape, [0])
        lse_smem[...] = jnp.where(seen, m + jnp.log(safe_l), NO_KEYS)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[r, h, split, pl.ds(first_row, ROWS)])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[r, h, split, pl.ds(first_row, ROWS)])
        plgpu.wait_smem_to_gmem(0)

    dtype = q_ref.dtype
    t = (plgpu.TilingTransform(_TILE), plgpu.SwizzleTransform(_SWIZZLE))
    kv = plgpu.SMEM((SLOTS, block, d), dtype, transforms=t)
    pl.run_scoped(scoped, plgpu.SMEM((ROWS, d), dtype, transforms=t), kv, kv,
                  plgpu.SMEM((ROWS, block), dtype, transforms=t), plgpu.SMEM((ROWS, d), jnp.float32),
                  plgpu.SMEM((ROWS,), jnp.float32),
                  plgpu.Barrier(num_barriers=1), plgpu.Barrier(num_barriers=SLOTS * per_block),
                  plgpu.Barrier(num_barriers=SLOTS * per_block))


def mosaic_cache_attention_lse(layer, q, k_cache, v_cache, table, kv_len, q_start, *, dense: bool,
                               interpret=None):
    """`gpu_kernel.gpu_cache_attention_lse`'s contract (q [R, T, Nq, D]; a dense cache [L, R', Nkv,
    S, D] with table [R] or a paged pool [L, P, Nkv, page_size, D] with table [R, M]) on Mosaic GPU.
    `interpret`: None (compiled for GPU) or a `plgpu.InterpretGPUParams` (jax 0.12's Mosaic GPU
    interpreter)."""
    r, t, nq, d = q.shape
    nkv, inner = k_cache.shape[2], k_cache.shape[3]
    if not mosaic_fits(k_cache.dtype, d, inner, dense):
        raise ValueError(f"the Mosaic GPU cache kernel takes bf16 / f16, head dims that are multiples of 64 and "
                         f"{'cache lengths that are multiples of 64' if dense else 'pages of 16, 32 or 64'}; "
                         f"got {k_cache.dtype}, head dim {d}, {'length' if dense else 'page size'} {inner}")
    g = nq // nkv
    rows = t * g
    padded = -(-rows // ROWS) * ROWS
    q_blocks = padded // ROWS
    pages = 1 if dense else table.shape[1]
    blocks = inner // BLOCK if dense else -(-pages * inner // BLOCK)  # key blocks a row holds
    splits = key_splits(r * nkv * q_blocks, blocks)
    qh = q.astype(k_cache.dtype).reshape(r, t, nkv, g, d).transpose(0, 2, 1, 3, 4).reshape(r, nkv, rows, d)
    if padded != rows:
        qh = jnp.pad(qh, ((0, 0), (0, 0), (0, padded - rows), (0, 0)))
    kernel = functools.partial(_kernel, dense=dense, page_size=BLOCK if dense else inner, pages=pages, blocks=blocks,
                               splits=splits, q_blocks=q_blocks, group=g, scale=1.0 / math.sqrt(d))
    extra = {} if interpret is None else {"interpret": interpret}
    out, lse = plgpu.kernel(
        kernel, out_type=(jax.ShapeDtypeStruct((r, nkv, splits, padded, d), jnp.float32),
                          jax.ShapeDtypeStruct((r, nkv, splits, padded), jnp.float32)),
        grid=(r, nkv * q_blocks, splits), grid_names=("row", "head_block", "split"), **extra,
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), table.astype(jnp.int32).reshape(-1), kv_len.astype(jnp.int32),
      q_start.astype(jnp.int32), qh, k_cache, v_cache)
    out, lse = merge_splits(out, lse)
    out = out[:, :, :rows].reshape(r, nkv, t, g, d).transpose(0, 2, 1, 3, 4).reshape(r, t, nq, d)
    lse = lse[:, :, :rows].reshape(r, nkv, t, g).transpose(0, 2, 1, 3).reshape(r, t, nq)
    return out, lse
