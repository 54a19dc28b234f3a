"""A fresh decode state for an engine's slots, and its layout on a device mesh."""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import NamedSharding

from dspark_jax.engine.spec import Spec
from dspark_jax.engine.state import DecodeState
from dspark_jax.parallel.sharding import logical_to_pspec
from dspark_jax.target.config import ModelConfig
from dspark_jax.target.kv_cache import CACHE_AXES, KVCache
from dspark_jax.target.paged_kernel import PAGE_AXES
from dspark_jax.target.paged_kv import PagedKVCache

__all__ = ["fresh_state", "decode_shardings"]


@functools.cache
def _key_data_shape() -> tuple[int, ...]:
    """The default PRNG's key data per key (2 words for threefry)."""
    return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape


def fresh_state(spec: Spec, tcfg: ModelConfig, drafter, R: int, dtype, pages=None, paged_attention="reference",
                chunked: bool = False) -> DecodeState:
    """Every slot free. `pages`: the PageAllocator of a paged cache (the drafter's cache is paged
    too, with the same page table); `chunked`: room for prompts forwarded in chunks by the rounds."""
    S, kind = spec.max_len, spec.kind
    if kind is not None:
        if pages is None:  # the drafter's dense cache read as the target's is
            dcache, last = kind.init_decode(spec, drafter, R, S, dtype)
            dcache = dcache._replace(impl=paged_attention) if isinstance(dcache, KVCache) else dcache
        else:  # the drafter's cache paged like the target's (same positions, same page table)
            dense, _ = jax.eval_shape(lambda: kind.init_decode(spec, drafter, R, S, dtype))
            _, last = kind.init_decode(spec, drafter, R, 1, dtype)
            dcache = PagedKVCache.like(dense, pages.num_pages, pages.page_size, paged_attention)
    else:
        dcache, last = KVCache.create(tcfg, R, 1, dtype, num_layers=1), jax.device_put(np.zeros((R, 1), dtype))
    if pages is None:
        cache = KVCache.create(tcfg, R, S, dtype, impl=paged_attention)
    else:
        cache = PagedKVCache.create(tcfg, R, S, pages.num_pages, pages.page_size, dtype, impl=paged_attention)
    # the small leaves made on the host and put on the device (distinct buffers: the state is
    # donated); eager jnp constructors would compile a program per shape. A free slot's key is
    # never used: a request's own key replaces it when the slot is joined (round.py `_join`)
    put = jax.device_put
    zi = lambda: put(np.zeros((R,), np.int32))  # noqa: E731
    return DecodeState(
        cache=cache, dcache=dcache, last=last, anchor=zi(), pos=zi(), active=put(np.zeros((R,), bool)),
        keys=jax.random.wrap_key_data(put(np.zeros((R, *_key_data_shape()), np.uint32))),
        rounds=zi(), acc_sum=zi(), n_gen=zi(), max_new=zi(),
        out=put(np.zeros((R, S), np.int32)), a_hist=put(np.full((2, R, spec.Gs), -1.0, np.float32)),
        step=put(np.int32(0)), since_draft=put(np.int32(0)), probe_gap=put(np.int32(spec.probe_every)),
        probe_credit=put(np.float32(0.0)), calib_expected=put(np.float32(0.0)),
        calib_accepted=put(np.float32(0.0)), run_counts=put(np.zeros((2, spec.Gs), np.float32)),
        finish=zi(), plen=zi(), joined=zi(),
        prompt=put(np.zeros((R, S if chunked else 1), np.int32)))


def decode_shardings(state: DecodeState, mesh):
    """Layout of a DecodeState on `mesh`: per-slot arrays split over `data` (slots), KV caches
    [L, R, Nkv, S, D] also over `tensor` (KV heads), scalars replicated. A paged cache's pool
    [L, pages, Nkv, page_size, D] has no slot axis (`PAGE_AXES`): KV heads over `tensor`, whole on
    `data` (every data shard holds the pool; page tables split with their slots), as the paged
    kernel's shard_map reads it. An axis that does not divide its dimension is left whole
    (`logical_to_pspec`)."""
    r = state.anchor.shape[0]

    def one(x, names):
        return NamedSharding(mesh, logical_to_pspec(names, x.shape, mesh))

    def per_slot(x):
        if x.ndim == 0:
            return one(x, ())
        names = ["batch" if d == r and i == 0 else None for i, d in enumerate(x.shape)]
        return one(x, names)

    def cache(c):
        if isinstance(c, PagedKVCache):
            pool = lambda a: one(a, PAGE_AXES)
            return c._replace(k=pool(c.k), v=pool(c.v), page_table=per_slot(c.page_table), lengths=per_slot(c.lengths))
        kv = lambda a: one(a, CACHE_AXES)
        return c._replace(k=kv(c.k), v=kv(c.v), lengths=per_slot(c.lengths))

    out = jax.tree.map(per_slot, state._replace(cache=None, dcache=None))
    hist = one(state.a_hist, (None, "batch", None))
    return out._replace(cache=cache(state.cache), dcache=cache(state.dcache), a_hist=hist,
                        run_counts=one(state.run_counts, (None, None)))
