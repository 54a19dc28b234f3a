"""Paged attention as a Pallas kernel: each row's pages are read where they lie in the pool.

The reference (`paged_kv.paged_attention`) gathers a row's pages into its `[max_len]` view
before attending, so a round holds one layer's `[R, S]` copy at a time. Here the grid is
(rows, KV heads, pages per slot); the page table, the rows' key counts and their first query
positions are scalar-prefetched, and each grid step's BlockSpec fetches page
`page_table[r, j]` of head h straight from the pool. The softmax runs online over a row's pages
(running max, normaliser and output in VMEM scratch); pages past a row's keys are skipped.

It returns the normalised output and each query's log-sum-exp, so keys that are not in the
pool (the verification's block of new tokens) join with `merge_parts`: one softmax over both,
as `layers.attention_parts` computes it.

On TPU it compiles (not run here: no TPU on these machines); elsewhere it runs in Pallas
interpret mode, which is how tests/target/test_paged_kernel.py checks it against the reference.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from dspark_jax.target.layers import MASK_VALUE

__all__ = ["paged_attention_lse", "attention_lse", "merge_parts", "PAGED_ATTENTION_IMPLS", "resolve_impl"]

PAGED_ATTENTION_IMPLS = ("auto", "reference", "pallas")
NO_KEYS = MASK_VALUE  # the log-sum-exp of a query that sees no key: weight exp(NO_KEYS - lse) = 0


def resolve_impl(impl: str) -> str:
    """"auto": the kernel on TPU, the reference (a gather) elsewhere; "pallas" forces the kernel
    (interpret mode off TPU, for tests)."""
    if impl not in PAGED_ATTENTION_IMPLS:
        raise ValueError(f"paged attention {impl!r} is not one of {PAGED_ATTENTION_IMPLS}")
    if impl == "auto":
        return "pallas" if jax.default_backend() == "tpu" else "reference"
    return impl


def _kernel(layer_ref, table_ref, kv_len_ref, q_start_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc, *,
            page_size: int, group: int, scale: float):
    from jax.experimental import pallas as pl

    r, j = pl.program_id(0), pl.program_id(2)
    kv_len = kv_len_ref[r]

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, NO_KEYS, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(j * page_size < kv_len)
    def _page():
        q = q_ref[...].astype(jnp.float32)  # [T * group, D], query t's heads at rows t * group ..
        k = k_ref[...].astype(jnp.float32)  # [page_size, D]
        v = v_ref[...].astype(jnp.float32)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        key_pos = j * page_size + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        q_pos = q_start_ref[r] + jax.lax.broadcasted_iota(jnp.int32, s.shape, 0) // group
        visible = (key_pos < kv_len) & (key_pos <= q_pos)
        s = jnp.where(visible, s, NO_KEYS)
        m_prev = m_sc[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        p = jnp.where(visible, jnp.exp(s - m_new), 0.0)
        alpha = jnp.exp(m_prev - m_new)
        l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
        acc_sc[...] = alpha * acc_sc[...] + jax.lax.dot_general(p, v, (((1,), (0,)), ((), ())),
                                                                preferred_element_type=jnp.float32)
        m_sc[...] = m_new

    @pl.when(j == pl.num_programs(2) - 1)
    def _finish():
        l = l_sc[...]
        seen = l > 0.0
        o_ref[...] = (acc_sc[...] / jnp.where(seen, l, 1.0)).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(seen, m_sc[...] + jnp.log(jnp.where(seen, l, 1.0)), NO_KEYS)


def paged_attention_lse(q, k_pages, v_pages, page_table, kv_len, q_start, *, layer=None,
                        interpret: bool | None = None):
    """q [R, T, Nq, D] against one layer's pages [P, page_size, Nkv, D] (or layer `layer` of the
    whole pool [L, P, page_size, Nkv, D], read in place) through page_table [R, M] (entries < 0:
    no page). Key s of row r is visible to query t iff s < kv_len[r] and
    s <= q_start[r] + t. -> (out [R, T, Nq, D] float32, normalised over the visible keys;
    lse [R, T, Nq] float32, NO_KEYS where a query sees none, its out then 0)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    if layer is None:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    r, t, nq, d = q.shape
    _, _, ps, nkv, _ = k_pages.shape
    g = nq // nkv
    m = page_table.shape[1]
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    # heads-first, a query's group of heads contiguous: [R, Nkv, T * g, D]
    qh = q.reshape(r, t, nkv, g, d).transpose(0, 2, 1, 3, 4).reshape(r, nkv, t * g, d)
    table = jnp.maximum(page_table, 0).astype(jnp.int32)  # no page: page 0, skipped (beyond kv_len)
    qmap = lambda i, h, j, *_: (i, h, 0, 0)
    page = lambda i, h, j, li, tab, *_: (li[0], tab[i, j], 0, h, 0)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4, grid=(r, nkv, m),
        in_specs=[pl.BlockSpec((None, None, t * g, d), qmap),
                  pl.BlockSpec((None, None, ps, None, d), page),
                  pl.BlockSpec((None, None, ps, None, d), page)],
        out_specs=[pl.BlockSpec((None, None, t * g, d), qmap), pl.BlockSpec((None, None, t * g, 1), qmap)],
        scratch_shapes=[pltpu.VMEM((t * g, 1), jnp.float32), pltpu.VMEM((t * g, 1), jnp.float32),
                        pltpu.VMEM((t * g, d), jnp.float32)])
    kernel = functools.partial(_kernel, page_size=ps, group=g, scale=1.0 / math.sqrt(d))
    out, lse = pl.pallas_call(
        kernel, grid_spec=grid_spec, interpret=interpret,
        out_shape=[jax.ShapeDtypeStruct((r, nkv, t * g, d), jnp.float32),
                   jax.ShapeDtypeStruct((r, nkv, t * g, 1), jnp.float32)],
    )(jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), table, kv_len.astype(jnp.int32), q_start.astype(jnp.int32),
      qh, k_pages, v_pages)
    out = out.reshape(r, nkv, t, g, d).transpose(0, 2, 1, 3, 4).reshape(r, t, nq, d)
    lse = lse.reshape(r, nkv, t, g).transpose(0, 2, 1, 3).reshape(r, t, nq)
    return out, lse


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
