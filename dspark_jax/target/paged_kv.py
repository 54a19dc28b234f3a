"""Paged KV cache: a pool of fixed-size pages shared by the slots, one page table per slot.

K/V of every slot live in one pool `[num_layers, num_pages, Nkv, page_size, D]`; slot r's
position t is page `page_table[r, t // page_size]`, offset `t % page_size`. Heads before
positions: one head's page is then a `(page_size, D)` tile, the whole of the array's last two
dimensions, which is what a TPU kernel block may be at any page size (target/paged_kernel.py).
`page_table` `[R, ceil(max_len / page_size)]` int32 is static-shape; NO_PAGE (-1) marks
entries with no page (writes there are dropped). Which page a slot owns is decided on the host
(`engine/page_alloc.py`), so memory is proportional to the tokens the slots hold, not to
`R * max_len`.

Same interface as the dense `KVCache`: `write_layer_at` (the scan-carried in-place write),
`attend_layer` (attention of one layer against the cache), `with_lengths`, `_replace`,
`max_len`. The target forward (prefill) and verification call only these, so they run on
either cache. `paged_attention` is the reference: it gathers each row's pages into its
`[max_len]` view and calls `target.layers.attention`, so the numbers equal the dense path's;
the "pallas" impl reads the pages in place instead (target/paged_kernel.py); "auto" leaves the
choice to target/attention_backend.py, from the platform the program is traced for.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from dspark_jax.parallel.sharding import constrain
from dspark_jax.target.attention_backend import attention_backend
from dspark_jax.target.kv_cache import write_tokens
from dspark_jax.target.layers import attention
from dspark_jax.target.paged_kernel import PAGE_AXES, paged_attention_lse

__all__ = ["NO_PAGE", "PagedKVCache", "gather_pages", "paged_attention", "pages_per_slot"]

NO_PAGE = -1


def pages_per_slot(max_len: int, page_size: int) -> int:
    return -(-int(max_len) // int(page_size))


def gather_pages(pages, page_table, length: int):
    """One layer's pages [P, Nkv, page_size, D] -> each row's view [R, length, Nkv, D] through
    `page_table` [R, M] (positions >= length cut off). Entries without a page read page 0: those
    positions hold no token of the row and must be masked by the caller (finite values, so a
    masked softmax weight of exactly 0 keeps them out of the result)."""
    r, m = page_table.shape
    _, nkv, ps, d = pages.shape
    view = jnp.take(pages, jnp.maximum(page_table, 0), axis=0)  # [R, M, Nkv, ps, D]
    return view.transpose(0, 1, 3, 2, 4).reshape(r, m * ps, nkv, d)[:, :length]


def paged_attention(q, k_pages, v_pages, page_table, mask, dtype=None):
    """Reference paged attention: q [R, T, Nq, D], one layer's pages [P, Nkv, ps, D],
    page_table [R, M], mask [R, T, S] (True = may attend; S <= M * ps) -> [R, T, Nq, D].
    Gathers each row's pages into its [S] view (cast to `dtype`, default the pages') and calls
    `layers.attention`, so the result is the dense cache's, bit for bit, as long as every
    position a query may attend has a page."""
    s = mask.shape[-1]
    k, v = gather_pages(k_pages, page_table, s), gather_pages(v_pages, page_table, s)
    if dtype is not None:
        k, v = k.astype(dtype), v.astype(dtype)
    return attention(q, k, v, mask)


@dataclasses.dataclass(frozen=True, eq=False)  # eq on arrays is ambiguous: compare leaves
class PagedKVCache:
    DENSE: ClassVar[bool] = False  # the kernels read a row's pages (target/attention_backend.py)
    k: jax.Array  # [num_layers, num_pages, Nkv, page_size, D]
    v: jax.Array  # same
    page_table: jax.Array  # [R, max_pages_per_slot] int32, NO_PAGE where a slot has no page
    lengths: jax.Array  # [R] int32, committed tokens per slot
    max_len: int  # static: positions per slot (the dense cache's S); writes at >= max_len are dropped
    # static: how pages are read, "reference" gather, "pallas" kernel or "auto" (target/attention_backend.py)
    impl: str = "reference"

    @classmethod
    def create(cls, cfg, num_slots: int, max_len: int, num_pages: int, page_size: int, dtype=jnp.float32,
               num_layers: int | None = None, impl: str = "reference") -> PagedKVCache:
        shape = (num_layers or cfg.num_layers, int(num_pages), cfg.num_kv_heads, int(page_size), cfg.head_dim)
        zeros = lambda: constrain(jnp.zeros(shape, dtype), PAGE_AXES)
        table = jnp.full((num_slots, pages_per_slot(max_len, page_size)), NO_PAGE, jnp.int32)
        return cls(zeros(), zeros(), table, jnp.zeros((num_slots,), jnp.int32), int(max_len), impl)

    @classmethod
    def like(cls, dense, num_pages: int, page_size: int, impl: str = "reference") -> PagedKVCache:
        """The paged twin of a dense cache (or its `jax.eval_shape`) [L, R, Nkv, S, D]: same layers,
        heads, dtype, slots and max_len, `num_pages` pages of `page_size`. The engine pages the
        drafter's cache this way, with the target's page table (both hold the same positions)."""
        layers, r, nkv, s, d = dense.k.shape
        cfg = type("CacheShape", (), {"num_layers": layers, "num_kv_heads": nkv, "head_dim": d})
        return cls.create(cfg, r, s, num_pages, page_size, dense.k.dtype, impl=impl)

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    def _replace(self, **kw) -> PagedKVCache:
        return dataclasses.replace(self, **kw)

    def with_lengths(self, lengths) -> PagedKVCache:
        """Commit (or roll back to) `lengths` tokens per slot: a pointer move, no copy."""
        return self._replace(lengths=jnp.asarray(lengths, jnp.int32))

    def with_page_table(self, page_table) -> PagedKVCache:
        table = jnp.asarray(page_table, jnp.int32)
        if table.shape != self.page_table.shape:
            raise ValueError(f"page table of shape {table.shape}, this cache's is {self.page_table.shape}")
        return self._replace(page_table=table)

    def write_layer_at(self, k_all, v_all, layer, rows, positions, k, v):
        """Write `k`, `v` [..., Nkv, D] of tokens at (`rows`, `positions`) (broadcast together) into
        layer `layer` of the page pools `k_all`, `v_all` [L, P, Nkv, ps, D] (the scan carry, updated
        in place): page `page_table[row, pos // ps]`, offset `pos % ps`. Dropped: padding rows
        (>= R), positions outside [0, max_len), and positions whose page the slot does not have."""
        r, m = self.page_table.shape
        p, ps = k_all.shape[1], k_all.shape[3]
        rows, positions = jnp.broadcast_arrays(jnp.asarray(rows, jnp.int32), jnp.asarray(positions, jnp.int32))
        ok = (rows >= 0) & (rows < r) & (positions >= 0) & (positions < self.max_len)
        page = self.page_table[jnp.clip(rows, 0, r - 1), jnp.clip(positions // ps, 0, m - 1)]
        page = jnp.where(ok & (page >= 0), page, p)  # p: out of range, dropped
        off = positions % ps
        return write_tokens(k_all, layer, page, off, k), write_tokens(v_all, layer, page, off, v)

    def _table(self, rows):
        """The page table of `rows` [K] (all slots when None; rows >= R read the last slot's)."""
        return self.page_table if rows is None else self.page_table[jnp.minimum(rows, self.page_table.shape[0] - 1)]

    def layer_view(self, k_all, v_all, layer, dtype, rows=None):
        """Layer `layer`'s keys and values as each row's [R, max_len, Nkv, D] view, in `dtype`
        (positions without a page read page 0: the caller masks them); `rows` [K]: those slots'."""
        table = self._table(rows)
        return (gather_pages(k_all[layer], table, self.max_len).astype(dtype),
                gather_pages(v_all[layer], table, self.max_len).astype(dtype))

    def dense(self):
        """(k, v) as [L, R, max_len, Nkv, D], as `KVCache.dense()` gives them (each row's pages in
        order; positions without a page read page 0): for tests and inspection, it copies the whole
        cache."""
        view = jax.vmap(lambda pages: gather_pages(pages, self.page_table, self.max_len))
        return view(self.k), view(self.v)

    def kernel_pays(self, k_all) -> bool:
        """Always: the reference gathers every row's pages into a copy before reading them."""
        return True

    def kernel_lse(self, q, k_all, v_all, layer, kv_len, q_start, rows=None, own=None, q_prep=None, interpret=None,
                   gpu=False, out_dtype=jnp.float32):
        """The Pallas kernel over layer `layer`'s pages, read in place (target/paged_kernel.py), with
        the `own` keys (`OwnKeys`) beside them, raw queries prepared by `q_prep` (`QueryPrep`)."""
        return paged_attention_lse(q, k_all, v_all, self._table(rows), kv_len, q_start, layer=layer, own=own,
                                   q_prep=q_prep, interpret=interpret, gpu=gpu, out_dtype=out_dtype)

    def attend_committed(self, q, k_all, v_all, layer, start, own, dtype, rows=None, q_prep=None):
        """Attention of q [R, T, Nq, D] over layer `layer`'s keys at positions < start [R] and the
        block's own keys `own` (`OwnKeys`), one softmax (`AttentionBackend.committed`)."""
        return attention_backend(self.impl).committed(self, q, k_all, v_all, layer, start, own, dtype, rows, q_prep)

    def attend_layer(self, q, k_all, v_all, layer, mask, dtype, positions=None, rows=None):
        """Attention of q [R, T, Nq, D] against layer `layer`, mask [R, T, max_len]; `rows` [K]: q
        are queries of those slots (`AttentionBackend.new_tokens`)."""
        return attention_backend(self.impl).new_tokens(self, q, k_all, v_all, layer, mask, dtype, positions, rows)


jax.tree_util.register_dataclass(PagedKVCache, data_fields=["k", "v", "page_table", "lengths"],
                                 meta_fields=["max_len", "impl"])
