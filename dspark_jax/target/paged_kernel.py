"""Cache attention as a Pallas kernel: each row's keys read where they lie, once, up to the last
one its queries may see.

Two caches, one kernel. A paged pool `[L, P, Nkv, page_size, D]` is read page by page through
the page table; the dense cache `[L, R, Nkv, S, D]` (heads-major, target/kv_cache.py) is read in
blocks of `DENSE_BLOCK` positions of its own row, as if they were pages
(`dense_attention_lse`). The reference (`paged_kv.paged_attention`, `KVCache.layer_view`) gathers
a row's keys into its `[max_len]` view and attends over all of them, masked: XLA:TPU then reads
the whole cache twice a step (the score and the value products). Here the page table (or the
rows' slots), the rows' key counts and their first query positions are scalar-prefetched, and
each grid step fetches one head's `(page_size, D)` block, equal to the array's last two
dimensions (paged) or a multiple of 16 rows of them (dense), which TPU tiling accepts; a page of
all heads is one contiguous copy.

Grid (rows, head blocks, query blocks, page blocks). A step reads `pages_per_step` pages of
`heads` KV heads: the pool is passed once per page of the step, each copy with its own
BlockSpec, so the pipeline fetches them all while the previous step computes (fewer, larger
steps: per-step overhead would otherwise outweigh one small page). Page indices past the last
page a query block sees repeat that page, which the pipeline does not fetch again; their keys
are masked.
The softmax runs online over the pages (running max, normaliser and output in VMEM scratch);
steps that hold no visible key are skipped.

Queries: `[R, T, Nq, D]` becomes heads-first `[R, Nkv, T * G, D]` (a KV head's G query heads
contiguous, query t's at rows t * G ..). Row rho's query sits at `q_start + rho // G`; it sees
key s iff `(s - q_start) * G <= rho` (the same test with a multiply in place of a vector integer
division). Over `QUERY_BLOCK` rows the rows are blocked and padded with zero rows
to a whole number of blocks (the block's second-to-last dimension must then be a multiple of 8;
padded rows are computed and dropped), so VMEM use does not grow with a long prefill chunk.

Head dims under 128: XLA:TPU's default layout for such a pool puts the page axis in the lanes,
while the kernel reads row-major pages, so the compiled program relayouts the pool around the
kernel (a copy in and out of each program that reads it); it compiles and computes the same, at
that cost. Head dim 128 (the Qwen3 models) is read in place.

Keys that are not in the pool (the verification's block of new tokens, the drafter's block:
`OwnKeys`) come into the same online softmax after the pool's, as one more block: every row's
at once where they are few (`OWN_WHOLE_MAX_KEYS`; a row's own columns picked by a mask, as a
dynamic sublane offset must be a multiple of 8), else a row's a step. Raw queries with a
`QueryPrep` (Qwen3's q norm, RoPE) are prepared once per query block into VMEM at the block's
first step. Outside XLA these are one kernel call a layer, where the same work as XLA fusions
was about fifteen small ones, each priced 1-2 us on TPU (docs/performance.md, item 12). It
returns the normalised output (in `out_dtype`) and each query's log-sum-exp, so other key sets
can still join with `merge_parts` (the GPU kernel's path): one softmax over both, as
`layers.attention_parts` computes it.

Whether a cache is read by this kernel is decided by target/attention_backend.py, from the platform
the program is compiled for (the mesh it is traced under): on TPU the kernel compiles through
Mosaic (tests/target/test_paged_kernel_tpu.py compiles it for TPU slices on a CPU machine);
elsewhere it runs in Pallas interpret mode, which
is how tests/target/test_paged_kernel.py checks it against the reference. On a mesh it runs per
shard (`jax.shard_map`): rows over the batch axes, KV heads over `tensor` as the rules table
says, the pool whole over the batch axes, so no shard gathers the pool.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

from dspark_jax.parallel.platform import platform
from dspark_jax.parallel.sharding import logical_to_pspec
from dspark_jax.target.gpu_kernel import gpu_cache_attention_lse
from dspark_jax.target.kernels import PAGED_KERNELS as PAGED_ATTENTION_IMPLS
from dspark_jax.target.kernels import choose_paged_kernel as resolve_impl
from dspark_jax.target.kernels import pallas_interpret
from dspark_jax.target.layers import MASK_VALUE
from dspark_jax.target.own_keys import OwnKeys
from dspark_jax.target.query_prep import QueryPrep

__all__ = ["PAGED_ATTENTION_IMPLS", "PAGE_AXES", "DENSE_CACHE_AXES", "attention_lse", "merge_parts",
           "merge_own", "slots_split", "paged_attention_lse", "dense_attention_lse", "resolve_impl"]

# the page pool [L, P, Nkv, page_size, D] has no slot axis: KV heads over tensor (on the mesh set by
# `jax.set_mesh`, if any), whole on the batch axes
PAGE_AXES = (None, None, "kv_heads", None, None)
# the dense cache [L, R, Nkv, S, D]: slots over the batch axes, KV heads over tensor
DENSE_CACHE_AXES = (None, "batch", "kv_heads", None, None)
NO_KEYS = MASK_VALUE  # the log-sum-exp of a query that sees no key: weight exp(NO_KEYS - lse) = 0
QUERY_BLOCK = 256  # query rows (T * G) per block: more are split into blocks of this many
TOKENS_PER_STEP = 128  # keys a grid step reads (pages_per_step = this // page_size, at most MAX_PAGES_PER_STEP)
MAX_PAGES_PER_STEP = 8
MAX_ROWS_PER_STEP = 2048  # heads per step * query rows per block: bounds the step's VMEM
DENSE_BLOCK = 128  # positions of a dense cache read as one "page"
DENSE_BLOCKS_PER_STEP = 4  # a grid step over a dense cache reads 512 positions
# own keys of all rows (R x W) up to which they are one block, fetched once per head block, each
# row's queries scored against all of them and masked to their own
OWN_WHOLE_MAX_KEYS = 512


def slots_split(cache_shape) -> bool:
    """Whether the mesh set by `jax.set_mesh` splits a dense cache [L, R, Nkv, S, D]'s slots (a
    shard then holds only its own rows)."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and logical_to_pspec(DENSE_CACHE_AXES, cache_shape, mesh)[1] is not None


def _precision(dtype):
    """bf16 operands: one MXU pass (a float32-precision request, e.g. jax_default_matmul_precision
    "highest", is not lowered by Mosaic for them); float32: as jax's matmul precision setting says."""
    return jax.lax.Precision.DEFAULT if jnp.dtype(dtype).itemsize < 4 else None


def _online_update(q, k, v, visible, m, l, acc, scale):
    """One block of keys k, v [n, D] (visible [rows, n]) into the running max m, normaliser l and
    output acc of queries q [rows, D]."""
    one_key = k.shape[0] == 1  # a one-column product does not lower (Mosaic): a multiply and a lane sum
    dt = jnp.promote_types(q.dtype, k.dtype)
    if one_key:
        s = jnp.sum(q.astype(jnp.float32) * k.astype(jnp.float32), axis=1, keepdims=True) * scale
    else:
        s = jax.lax.dot_general(q.astype(dt), k.astype(dt), (((1,), (1,)), ((), ())), precision=_precision(dt),
                                preferred_element_type=jnp.float32) * scale
    s = jnp.where(visible, s, NO_KEYS)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    p = jnp.where(visible, jnp.exp(s - m_new), 0.0)
    alpha = jnp.exp(m - m_new)
    l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
    if one_key:
        pv = p * v.astype(jnp.float32)
    else:
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=_precision(v.dtype),
                                 preferred_element_type=jnp.float32)
    return m_new, l, alpha * acc + pv


def _prepared(x, cos, sin, norm, eps: float, dtype):
    """`QueryPrep.apply` on one block of raw queries x [rows, D] (cos, sin [rows, D] float32; norm
    [1, D] or None), rounding to `dtype` where `layers.rms_norm` and `layers.apply_rope` do."""
    x = x.astype(jnp.float32)
    if norm is not None:
        x = (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)).astype(dtype).astype(jnp.float32)
        x = (norm.astype(dtype).astype(jnp.float32) * x).astype(dtype).astype(jnp.float32)
    half = x.shape[-1] // 2  # rotate-half: (-x[half:], x[:half]), a roll by half the lanes and a sign
    sign = jnp.where(jax.lax.broadcasted_iota(jnp.int32, x.shape, 1) < half, -1.0, 1.0)
    return (x * cos + pltpu.roll(x, half, 1) * sign * sin).astype(dtype)


def _kernel(layer_ref, table_ref, kv_len_ref, q_start_ref, *refs, page_size: int, pages: int, group: int,
            block_rows: int, heads: int, scale: float, mask_values: bool, own_width: int, own_causal: bool,
            own_whole: bool, prep: int, eps: float):
    own = own_width > 0
    own_len_ref, refs = (refs[0], refs[1:]) if own else (None, refs)
    q_ref, prep_refs, refs = refs[0], refs[1: 1 + prep], refs[1 + prep:]  # prep: cos, sin[, norm]
    k_refs, v_refs = refs[:pages], refs[pages: 2 * pages]
    # own keys: [heads, R * W, D] (every row's, `own_whole`) or [heads, W, D] (this row's)
    own_refs = refs[2 * pages: 2 + 2 * pages] if own else None
    o_ref, lse_ref, m_sc, l_sc, acc_sc, *q_sc = refs[2 * pages + (2 if own else 0):]
    q_block = q_sc[0] if prep else q_ref  # the queries scored: prepared once per block, or as given
    r, qb, b = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    kv_len, q_start = kv_len_ref[r], q_start_ref[r]
    first_row = qb * block_rows
    step_start = b * (pages * page_size)

    @pl.when(b == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, NO_KEYS, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)
        if prep:
            cos, sin = prep_refs[0][...], prep_refs[1][...]
            norm = prep_refs[2][...] if prep == 3 else None

            def prep_head(h, carry):
                q_block[h] = _prepared(q_ref[h], cos, sin, norm, eps, q_block.dtype)
                return carry

            jax.lax.fori_loop(0, heads, prep_head, 0)

    # the step's first key exists and the block's last query may see it
    @pl.when((step_start < kv_len) & ((step_start - q_start) * group <= first_row + block_rows - 1))
    def _step():
        shape = (block_rows, page_size)
        rho = first_row + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
        offset = jax.lax.broadcasted_iota(jnp.int32, shape, 1)

        def head(h, carry):
            q = q_block[h]  # [block_rows, D]
            m, l, acc = m_sc[h], l_sc[h], acc_sc[h]
            for c in range(pages):  # keys past kv_len (a repeated last page, or none) are masked
                k, v = k_refs[c][h], v_refs[c][h]  # [page_size, D]
                if mask_values:  # a dense cache's last block runs past its end: unspecified values there
                    inside = step_start + c * page_size + jax.lax.broadcasted_iota(jnp.int32, v.shape, 0) < kv_len
                    v = jnp.where(inside, v, jnp.zeros_like(v))
                key_pos = step_start + c * page_size + offset
                visible = (key_pos < kv_len) & ((key_pos - q_start) * group <= rho)
                m, l, acc = _online_update(q, k, v, visible, m, l, acc, scale)
            m_sc[h], l_sc[h], acc_sc[h] = m, l, acc
            return carry

        jax.lax.fori_loop(0, heads, head, 0)

    @pl.when(b == pl.num_programs(3) - 1)
    def _finish():
        if own:  # the own keys after the cache's: one more block of the same online softmax
            ko_ref, vo_ref = own_refs
            shape = (block_rows, ko_ref.shape[1])
            # column of the row's own block: every row's keys are in the block when `own_whole` (a
            # dynamic sublane offset would have to be a multiple of 8), the others' masked
            col = jax.lax.broadcasted_iota(jnp.int32, shape, 1) - (r * own_width if own_whole else 0)
            visible = (col >= 0) & (col < own_len_ref[r])
            if own_causal:  # row rho is query rho // G, which sees own key w iff w <= rho // G
                visible = visible & (col * group <= first_row + jax.lax.broadcasted_iota(jnp.int32, shape, 0))

            def own_head(h, carry):
                m_sc[h], l_sc[h], acc_sc[h] = _online_update(q_block[h], ko_ref[h], vo_ref[h], visible, m_sc[h],
                                                             l_sc[h], acc_sc[h], scale)
                return carry

            jax.lax.fori_loop(0, heads, own_head, 0)
        l = l_sc[...]
        seen = l > 0.0
        o_ref[...] = (acc_sc[...] / jnp.where(seen, l, 1.0)).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(seen, m_sc[...] + jnp.log(jnp.where(seen, l, 1.0)), NO_KEYS)


def _tiling(rows: int, nkv: int, m: int, page_size: int, max_pages: int) -> tuple[int, int, int, int]:
    """(query rows per block, rows padded to whole blocks, KV heads per step, pages per step)."""
    block_rows = min(rows, QUERY_BLOCK)
    padded = -(-rows // block_rows) * block_rows
    heads = max(h for h in range(1, nkv + 1) if nkv % h == 0 and (h == 1 or h * block_rows <= MAX_ROWS_PER_STEP))
    pages = max(1, min(max_pages, m))
    return block_rows, padded, heads, pages


def _local(layer, q, k_pool, v_pool, table, kv_len, q_start, own=None, q_prep=None, *, interpret: bool, dense: bool,
           out_dtype=jnp.float32, token_rows: int | None = None):
    """The kernel on one shard: q [R, T, Nq, D], layer [1]. Paged: pool [L, P, Nkv, ps, D], table
    [R, M] page ids. Dense: cache [L, R', Nkv, S, D] read in blocks of `DENSE_BLOCK` positions as
    if they were pages, table [R] the cache row of each query row. `own`: an `OwnKeys` block
    [R, W] taken into the softmax after the cache's keys. `q_prep` (`QueryPrep`): q is raw, the
    kernel prepares each query block once. `out_dtype`: the output's (the log-sum-exp is float32).
    `token_rows`: the first rows that hold tokens (the rest read no key, one block each), for the
    cost the kernel declares."""
    r, t, nq, d = q.shape
    nkv = k_pool.shape[2]
    if dense:
        seq = k_pool.shape[3]
        ps = seq if seq <= DENSE_BLOCK else DENSE_BLOCK  # a whole dimension or a multiple of 16
        m, mask_values, max_pages = -(-seq // ps), seq % ps != 0, DENSE_BLOCKS_PER_STEP
    else:
        ps, m, mask_values = k_pool.shape[3], table.shape[1], False
        max_pages = min(MAX_PAGES_PER_STEP, max(1, TOKENS_PER_STEP // ps))
    g = nq // nkv
    rows = t * g
    block_rows, padded, heads, pages = _tiling(rows, nkv, m, ps, max_pages)
    steps = -(-m // pages)
    qh = q.reshape(r, t, nkv, g, d).transpose(0, 2, 1, 3, 4).reshape(r, nkv, rows, d)
    if padded != rows:
        qh = jnp.pad(qh, ((0, 0), (0, 0), (0, padded - rows), (0, 0)))
    # 1-D in SMEM (a 2-D table pads its last dimension to 128 there); no page: page 0, masked
    table = jnp.maximum(table, 0).astype(jnp.int32).reshape(-1)
    kv_len, q_start = kv_len.astype(jnp.int32), q_start.astype(jnp.int32)

    def page_map(c):
        def index(i, h, qb, b, li, tab, lens, starts, *_):
            # the last page the query block sees (page 0 when it sees none): later indices repeat it
            last_key = jnp.minimum(lens[i] - 1, starts[i] + (qb * block_rows + block_rows - 1) // g)
            j = jnp.minimum(b * pages + c, jnp.maximum(last_key // ps, 0))
            return (li[0], tab[i], h, j, 0) if dense else (li[0], tab[i * m + j], h, 0, 0)
        return pl.BlockSpec((None, None, heads, ps, d), index)

    qmap = lambda i, h, qb, b, *_: (i, h, qb, 0)
    own_specs, own_args, own_prefetch, width, whole = [], [], [], 0, False
    if own is not None:  # the own lengths in SMEM; own K / V heads-first
        width = own.k.shape[1]
        own_prefetch = [own.lengths.astype(jnp.int32)]
        whole = r * width <= OWN_WHOLE_MAX_KEYS
        if whole:  # [Nkv, R * W, D], every row's at once: a bitcast of the projection's output where W is 1
            own_args = [x.transpose(2, 0, 1, 3).reshape(nkv, r * width, d) for x in (own.k, own.v)]
            own_specs = [pl.BlockSpec((heads, r * width, d), lambda i, h, *_: (h, 0, 0))] * 2
        else:  # [R, Nkv, W, D], one row's a step
            own_args = [x.transpose(0, 2, 1, 3) for x in (own.k, own.v)]
            own_specs = [pl.BlockSpec((None, heads, width, d), lambda i, h, *_: (i, h, 0, 0))] * 2
    prep_specs, prep_args, q_scratch = [], [], []
    if q_prep is not None:  # cos / sin of query row rho = t * G + g (token t), padded as the rows; the norm weight
        prep_args = [jnp.repeat(x.astype(jnp.float32), g, axis=1) for x in (q_prep.cos, q_prep.sin)]
        prep_args = [jnp.pad(x, ((0, 0), (0, padded - rows), (0, 0))) for x in prep_args]
        prep_specs = [pl.BlockSpec((None, block_rows, d), lambda i, h, qb, *_: (i, qb, 0))] * 2
        if q_prep.norm is not None:
            prep_args.append(q_prep.norm.reshape(1, d))
            prep_specs.append(pl.BlockSpec((1, d), lambda *_: (0, 0)))
        q_scratch = [pltpu.VMEM((heads, block_rows, d), q.dtype)]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4 + len(own_prefetch), grid=(r, nkv // heads, padded // block_rows, steps),
        in_specs=[pl.BlockSpec((None, heads, block_rows, d), qmap)] + prep_specs
        + [page_map(c) for c in range(pages)] * 2 + own_specs,
        out_specs=[pl.BlockSpec((None, heads, block_rows, d), qmap), pl.BlockSpec((None, heads, block_rows, 1), qmap)],
        scratch_shapes=[pltpu.VMEM((heads, block_rows, 1), jnp.float32),
                        pltpu.VMEM((heads, block_rows, 1), jnp.float32),
                        pltpu.VMEM((heads, block_rows, d), jnp.float32)] + q_scratch)
    kernel = functools.partial(_kernel, page_size=ps, pages=pages, group=g, block_rows=block_rows, heads=heads,
                               scale=1.0 / math.sqrt(d), mask_values=mask_values, own_width=width,
                               own_causal=own is not None and own.causal, own_whole=whole, prep=len(prep_args),
                               eps=q_prep.eps if q_prep is not None else 0.0)
    # the declared cost: every row holding tokens reads its cache's whole length (an upper bound:
    # kv_len is known at run time only), once for each of its query blocks; a row holding none reads
    # one step's blocks (the grid's later steps repeat them, not fetched again)
    tok = r if token_rows is None else min(r, token_rows)
    q_blocks = padded // block_rows
    keys = tok * nkv * padded * steps * pages * ps
    keys += r * nkv * padded * (r * width if whole else width)  # the own keys each query block scores
    block = 2 * pages * nkv * ps * d * k_pool.dtype.itemsize
    read = q_blocks * block * (tok * steps + (r - tok))
    read += sum(x.size * x.dtype.itemsize for x in own_args + prep_args)
    prep_flops = 12 * r * nkv * padded * d if q_prep is not None else 0  # norm and rotation, once per block
    cost = pl.CostEstimate(flops=4 * keys * d + prep_flops, transcendentals=keys,
                           bytes_accessed=read + qh.size * qh.dtype.itemsize + r * nkv * padded * (d + 1) * 4)
    out, lse = pl.pallas_call(
        kernel, grid_spec=grid_spec, interpret=interpret, cost_estimate=cost,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        out_shape=[jax.ShapeDtypeStruct((r, nkv, padded, d), out_dtype),
                   jax.ShapeDtypeStruct((r, nkv, padded, 1), jnp.float32)],
    )(layer, table, kv_len, q_start, *own_prefetch, qh, *prep_args, *([k_pool] * pages), *([v_pool] * pages), *own_args)
    out = out[:, :, :rows].reshape(r, nkv, t, g, d).transpose(0, 2, 1, 3, 4).reshape(r, t, nq, d)
    lse = lse[:, :, :rows].reshape(r, nkv, t, g).transpose(0, 2, 1, 3).reshape(r, t, nq)
    return out, lse


def _interpret(gpu: bool) -> bool:
    """Whether the chosen kernel runs interpreted: the GPU one off GPU, the TPU one off TPU."""
    return platform() != "gpu" if gpu else pallas_interpret()


def _layer_index(layer):
    return jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))


def paged_attention_lse(q, k_pages, v_pages, page_table, kv_len, q_start, *, layer=None, own: OwnKeys | None = None,
                        q_prep: QueryPrep | None = None, interpret: bool | None = None, gpu: bool = False,
                        out_dtype=jnp.float32):
    """q [R, T, Nq, D] against one layer's pages [P, Nkv, page_size, D] (or layer `layer` of the
    whole pool [L, P, Nkv, page_size, D], read in place) through page_table [R, M] (entries < 0:
    no page). Key s of row r is visible to query t iff s < kv_len[r] and
    s <= q_start[r] + t. -> (out [R, T, Nq, D] in `out_dtype`, normalised over the visible keys;
    lse [R, T, Nq] float32, NO_KEYS where a query sees none, its out then 0).
    `own` (`OwnKeys` [R, W]): keys beside the cache in the same softmax (out and lse over both).
    `q_prep` (`QueryPrep`): q is the projection's raw queries, prepared in the kernel.
    `interpret` defaults to "not compiled for TPU"; on a mesh (`jax.set_mesh`) the kernel runs
    per shard. `gpu`: the GPU kernel (target/gpu_kernel.py) in place of the TPU one."""
    if layer is None:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    if interpret is None:
        interpret = _interpret(gpu)
    if gpu:
        q = q if q_prep is None else q_prep.apply(q)
        local = functools.partial(gpu_cache_attention_lse, interpret=interpret, dense=False)
        out_lse = _per_shard(local, PAGE_AXES, _layer_index(layer), q, k_pages, v_pages, page_table, kv_len, q_start)
        return merge_own(out_lse, q, own, out_dtype)
    local = functools.partial(_local, interpret=interpret, dense=False, out_dtype=out_dtype)
    return _per_shard(local, PAGE_AXES, _layer_index(layer), q, k_pages, v_pages, page_table, kv_len, q_start, own,
                      q_prep)


def dense_attention_lse(q, k_all, v_all, kv_len, q_start, *, layer, rows=None, own: OwnKeys | None = None,
                        q_prep: QueryPrep | None = None, interpret: bool | None = None, gpu: bool = False,
                        out_dtype=jnp.float32):
    """q [R, T, Nq, D] against layer `layer` of a dense heads-major cache [L, R', Nkv, S, D], read
    in place and only up to each row's last visible key (the grid's later steps repeat that
    block, which the pipeline does not fetch again). Row r reads cache row `rows[r]` (default r).
    Visibility, `own`, `q_prep`, returns, `gpu` and `out_dtype` as `paged_attention_lse`."""
    if interpret is None:
        interpret = _interpret(gpu)
    layer = _layer_index(layer)
    if rows is not None and slots_split(k_all.shape):
        raise ValueError("dense_attention_lse: queries of chosen cache rows (`rows`) need the cache's slots whole on "
                         "the mesh; read them with the reference path")

    def local(layer, q, k, v, table, kv_len, q_start, own=None, q_prep=None):  # one shard: its rows, or the chosen ones
        # query rows past the cache's (a view padded to its bucket, reading no key) read its last row
        table = jnp.arange(q.shape[0], dtype=jnp.int32) if rows is None else table
        table = jnp.minimum(table, k.shape[1] - 1)
        if gpu:
            return gpu_cache_attention_lse(layer, q, k, v, table, kv_len, q_start, interpret=interpret, dense=True)
        return _local(layer, q, k, v, table, kv_len, q_start, own, q_prep, interpret=interpret, dense=True,
                      out_dtype=out_dtype, token_rows=k.shape[1] if rows is None else None)

    table = jnp.zeros(q.shape[:1], jnp.int32) if rows is None else jnp.asarray(rows, jnp.int32)
    if gpu:
        q = q if q_prep is None else q_prep.apply(q)
        out_lse = _per_shard(local, DENSE_CACHE_AXES, layer, q, k_all, v_all, table, kv_len, q_start)
        return merge_own(out_lse, q, own, out_dtype)
    return _per_shard(local, DENSE_CACHE_AXES, layer, q, k_all, v_all, table, kv_len, q_start, own, q_prep)


def merge_own(out_lse, q, own: OwnKeys | None, out_dtype):
    """An (out, lse) over the cache joined with the own keys through their log-sum-exp (the GPU
    kernel and the reference take no own block), out in `out_dtype`."""
    if own is None:
        return out_lse[0].astype(out_dtype), out_lse[1]
    own_part = attention_lse(q, own.k.astype(q.dtype), own.v.astype(q.dtype), own.mask(q.shape[1]))
    return merge_parts([out_lse, own_part]).astype(out_dtype), jnp.logaddexp(out_lse[1], own_part[1])


def _per_shard(local, pool_axes, layer, q, k, v, table, kv_len, q_start, own: OwnKeys | None = None,
               q_prep: QueryPrep | None = None):
    """`local` over the whole arrays, or on the mesh set by `jax.set_mesh` per shard
    (`jax.shard_map`): rows over the batch axes, KV heads (and their query heads) as `pool_axes`
    place them, so no shard gathers the cache; the own keys split as the queries, the query
    preparation's cos / sin by rows (its norm weight whole)."""
    mesh = jax.sharding.get_abstract_mesh()
    named = {n: x for n, x in (("own", own), ("q_prep", q_prep)) if x is not None}  # `local`'s optional inputs
    if mesh.empty:
        return local(layer, q, k, v, table, kv_len, q_start, **named)
    pool = logical_to_pspec(pool_axes, k.shape, mesh)
    rows = logical_to_pspec(("batch",), q.shape[:1], mesh)[0]
    heads = pool[2]  # query heads split with their KV heads (whole when the KV heads are)
    q_spec, row_spec = P(rows, None, heads, None), P(rows)
    table_spec = P(rows, *([None] * (table.ndim - 1)))
    # own K / V [R, W, Nkv, D] split as the queries' rows and KV heads, their lengths by rows; the
    # preparation's cos / sin [R, T, D] by rows, its norm weight whole (specs as pytrees like the inputs)
    spec_of = {"own": lambda o: dataclasses.replace(o, k=q_spec, v=q_spec, lengths=row_spec),
               "q_prep": lambda p: p.replace(cos=P(rows, None, None), sin=P(rows, None, None),
                                             norm=None if p.norm is None else P())}
    specs = (P(), q_spec, pool, pool, table_spec, row_spec, row_spec, *(spec_of[n](x) for n, x in named.items()))

    def shard(*a):
        return local(*a[:7], **dict(zip(named, a[7:])))

    return jax.shard_map(shard, in_specs=specs, out_specs=(q_spec, P(rows, None, heads)), check_vma=False)(
        layer, q, k, v, table, kv_len, q_start, *named.values())


def attention_lse(q, k, v, mask):
    """Dense `attention` that also returns each query's log-sum-exp: q [B, T, Nq, D], k, v
    [B, S, Nkv, D], mask [B, T, S] -> (out [B, T, Nq, D] float32, lse [B, T, Nq])."""
    b, t, nq, d = q.shape
    nkv = k.shape[2]
    g = nq // nkv
    qh = q.reshape(b, t, nkv, g, d)
    s = jnp.einsum("btkgd,bskd->btkgs", qh, k, preferred_element_type=jnp.float32) * (1.0 / math.sqrt(d))
    visible = mask[:, :, None, None, :]
    s = jnp.where(visible, s, NO_KEYS)
    top = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.where(visible, jnp.exp(s - top), 0.0)
    den = jnp.sum(e, axis=-1, keepdims=True)
    seen = den > 0.0
    out = jnp.einsum("btkgs,bskd->btkgd", e / jnp.where(seen, den, 1.0), v.astype(jnp.float32))
    lse = jnp.where(seen, top + jnp.log(jnp.where(seen, den, 1.0)), NO_KEYS)[..., 0]
    return out.reshape(b, t, nq, d), lse.reshape(b, t, nq)


def merge_parts(parts):
    """One softmax over several key sets from their (out, lse) pairs -> out [B, T, Nq, D] float32."""
    lse = functools.reduce(jnp.logaddexp, [x[1] for x in parts])
    return functools.reduce(jnp.add, [o * jnp.exp(l - lse)[..., None] for o, l in parts])
