"""What a target forward's attention reads and writes, and the one function that runs it per layer.

The decoder layers are the same for every use of the target; only the attention differs. Each
use describes its attention with one of these pytrees, built once per forward outside the layer
scan, and `layer_attention` runs the matching variant inside it:

- `CausalSelf`: no cache; a chunk at positions 0..T-1 attends causally to itself (training, full
  forwards), through jax's splash kernel or the block-skipping `layers.causal_attention`.
- `MaskedSelf`: no cache; tokens at explicit positions attend to the chunk under a position mask.
- `CacheUpdate`: new tokens write their K / V into a dense or paged cache (in place: the cache
  rides in the scan carry) and attend to it (prefill, regeneration, target-only decoding).
- `PackedVerify`: packed tokens (target/packing.py) read a dense or paged cache without writing
  it; each padded view (the verification block, optionally a prefill chunk) attends to its
  slots' committed keys in the cache and to its own keys, which come back per layer so the
  caller writes them once outside any branch.

Which kernel runs is decided in target/kernels.py: `CausalSelf.kernel`, and the paged cache's
`impl` for the cache variants.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from dspark_jax.target.attention_backend import attention_backend
from dspark_jax.target.kernels import choose_causal_kernel
from dspark_jax.target.kv_cache import KVCache
from dspark_jax.target.layers import attention, causal_attention
from dspark_jax.target.own_keys import OwnKeys
from dspark_jax.target.packing import Packing
from dspark_jax.target.paged_kernel import slots_split
from dspark_jax.target.paged_kv import PagedKVCache
from dspark_jax.target.query_prep import QueryPrep
from dspark_jax.target.splash import splash_causal_attention

__all__ = ["CausalSelf", "MaskedSelf", "CacheUpdate", "VerifyView", "PackedVerify", "AttentionMetadata",
           "causal_self", "masked_self", "cache_update", "layer_attention", "takes_raw_queries", "view_rows",
           "cache_read", "cache_written"]

CAUSAL_BLOCK = 128  # query block of `layers.causal_attention`
ACTIVATION_AXES = ("batch", "seq", "act_embed")  # logical axes of a [B, T, H] activation


def _pytree(cls, meta=()):
    data = [f.name for f in dataclasses.fields(cls) if f.name not in meta]
    return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=list(meta))


@dataclasses.dataclass(frozen=True)
class CausalSelf:
    valid: jax.Array  # [B, T] real tokens (padding keys are masked)
    kernel: str  # static: "splash" or "blocked"
    block: int = CAUSAL_BLOCK  # static: query block of the blocked path
    activation_axes: ClassVar = ACTIVATION_AXES


@dataclasses.dataclass(frozen=True)
class MaskedSelf:
    mask: jax.Array  # [B, T, T] True = query t may attend to key s of the same chunk
    activation_axes: ClassVar = ACTIVATION_AXES


@dataclasses.dataclass(frozen=True)
class CacheUpdate:
    cache: KVCache | PagedKVCache
    rows: jax.Array  # [B, 1] cache slot of each row
    write_pos: jax.Array  # [B, T] where each token's K / V go (max_len for padding: dropped)
    mask: jax.Array  # [B, T, max_len] keys at or before the query's position
    positions: jax.Array  # [B, T] the queries' positions (the paged kernel reads these, not the mask)
    slots: jax.Array | None = None  # [B] the cache slots of the rows when not 0..B-1 (a group of slots)
    activation_axes: ClassVar = ACTIVATION_AXES


@dataclasses.dataclass(frozen=True)
class VerifyView:
    """One padded view of packed tokens: row k holds the tokens packed with slot k (`rows` None)
    or slot rows[k] (a prefill chunk's rows), at positions start[k] + column. An in-place view
    may have more rows than the cache has slots (`view_rows`): those hold no token."""

    packing: Packing
    start: jax.Array  # [K] position of column 0 (the slot's committed length)
    valid: jax.Array  # [K, W], a prefix of each row
    rows: jax.Array | None = None  # [K] cache slot of each row (R = unused row)
    # static: packed by `packing.pack_in_place` (token (k, w) at packed index k * W + w)
    in_place: bool = False


@dataclasses.dataclass(frozen=True)
class PackedVerify:
    cache: KVCache | PagedKVCache  # read, never written
    block: VerifyView
    chunk: VerifyView | None = None  # packed after the block's tokens; skipped when empty
    activation_axes: ClassVar = None  # packed tokens [1, bucket, H] carry no batch layout


for _cls, _meta in ((CausalSelf, ("kernel", "block")), (MaskedSelf, ()), (CacheUpdate, ()), (VerifyView, ("in_place",)),
                    (PackedVerify, ())):
    _pytree(_cls, _meta)

AttentionMetadata = CausalSelf | MaskedSelf | CacheUpdate | PackedVerify


def causal_self(valid, requested: str, head_dim: int) -> CausalSelf:
    """Cache-free causal attention over [B, T] with the kernel `requested` resolves to."""
    return CausalSelf(valid, choose_causal_kernel(requested, valid.shape[1], head_dim), CAUSAL_BLOCK)


def masked_self(positions, valid) -> MaskedSelf:
    """Cache-free attention at explicit positions [B, T]: keys at or before the query's position."""
    return MaskedSelf((positions[:, None, :] <= positions[:, :, None]) & valid[:, None, :])


def cache_update(cache: KVCache | PagedKVCache, positions, valid, slots=None) -> CacheUpdate:
    """Tokens at `positions` [B, T] (a row's valid tokens consecutive from its cache length)
    written into `cache` where `valid`, each attending to the cache's keys up to its position.
    Row b is cache slot `slots[b]` (default b; slots >= R: nothing written, output unused)."""
    key_idx = jnp.arange(cache.max_len, dtype=jnp.int32)
    mask = key_idx[None, None, :] <= positions[:, :, None]
    write_pos = jnp.where(valid, positions, cache.max_len)
    rows = (jnp.arange(positions.shape[0]) if slots is None else jnp.asarray(slots, jnp.int32))[:, None]
    return CacheUpdate(cache, rows, write_pos, mask, positions, slots)


def cache_read(attn: AttentionMetadata) -> KVCache | PagedKVCache | None:
    """The cache the layers read (and carry through the layer scan), if any."""
    return attn.cache if isinstance(attn, (CacheUpdate, PackedVerify)) else None


def cache_written(attn: AttentionMetadata, kv) -> KVCache | PagedKVCache | None:
    """The cache with the layer scan's final K / V pools, for the variant that writes it."""
    return attn.cache._replace(k=kv[0], v=kv[1]) if isinstance(attn, CacheUpdate) else None


def _view_attention(cache, view: VerifyView, q, k, v, kv, layer, dtype, q_prep=None):
    """One view's attention: the packed q / k / v [1, bucket, ..] of its tokens scattered into
    [K, W], each row against its slot's committed keys (read from the cache in place) and its own
    earlier tokens -> (out [bucket, Nq, D] at the packed tokens, the view's K / V [K, W, Nkv, D]
    as the cache would hold them). `q_prep` (a view in place only): q is raw, cos / sin packed
    as q."""
    lp = view.packing
    n_rows, width = view.valid.shape
    kv_dtype = cache.k.dtype
    if view.in_place:  # the view is the packed batch's first rows: no scatter (padding keys masked, never written)
        qv, kb, vb = (a[0, :n_rows * width].reshape(n_rows, width, *a.shape[2:]) for a in (q, k, v))
        kb, vb = kb.astype(kv_dtype), vb.astype(kv_dtype)
        if q_prep is not None:
            q_prep = q_prep.replace(**{n: getattr(q_prep, n)[0, :n_rows * width].reshape(n_rows, width, -1)
                                       for n in ("cos", "sin")})
    else:
        blank = jnp.zeros((n_rows, width, *k.shape[2:]), kv_dtype)
        kb = blank.at[lp.slot, lp.col].set(k[0].astype(kv_dtype), mode="drop")
        vb = blank.at[lp.slot, lp.col].set(v[0].astype(kv_dtype), mode="drop")
        qv = jnp.zeros((n_rows, width, *q.shape[2:]), q.dtype).at[lp.slot, lp.col].set(q[0], mode="drop")
    o = cache.attend_committed(qv, kv[0], kv[1], layer, view.start, OwnKeys.of_prefix(kb, vb, view.valid), dtype,
                               rows=view.rows, q_prep=q_prep)
    if view.in_place:
        o = o.reshape(n_rows * width, *o.shape[2:])
        return jnp.pad(o, ((0, q.shape[1] - n_rows * width),) + ((0, 0),) * (o.ndim - 1)), kb, vb
    return o[jnp.minimum(lp.slot, n_rows - 1), lp.col], kb, vb


def _packed_attention(attn: PackedVerify, q, k, v, kv, layer, dtype, q_prep=None):
    o, kb, vb = _view_attention(attn.cache, attn.block, q, k, v, kv, layer, dtype, q_prep)
    if attn.chunk is None:
        return o[None], (kb, vb)

    def chunk_attention(ck, cv):
        return _view_attention(attn.cache, attn.chunk, q, k, v, (ck, cv), layer, dtype)

    def no_chunk(ck, cv):
        shapes = jax.eval_shape(chunk_attention, ck, cv)
        return tuple(jnp.zeros(a.shape, a.dtype) for a in shapes)

    oc, kcb, vcb = jax.lax.cond(attn.chunk.packing.n > 0, chunk_attention, no_chunk, *kv)
    in_block = attn.block.packing.slot < attn.block.valid.shape[0]
    return jnp.where(in_block[:, None, None], o, oc)[None], (kb, vb, kcb, vcb)


def takes_raw_queries(attn: AttentionMetadata) -> bool:
    """Whether `layer_attention` takes the projection's raw queries with their `QueryPrep`: a
    verification whose one view is packed in place, read by the TPU kernel, which prepares
    them itself (target/query_prep.py)."""
    if not isinstance(attn, PackedVerify) or attn.chunk is not None or not attn.block.in_place:
        return False
    return attention_backend(attn.cache.impl).takes_raw_queries(attn.cache, attn.cache.k)


def view_rows(cache: KVCache | PagedKVCache, rows: int, width: int, bucket: int) -> int:
    """Rows of the in-place view of `rows` x `width` tokens packed in a `bucket`. A one-column view
    read by the TPU kernel from a dense cache whose slots are whole on the mesh takes every row of
    the bucket (rows past the slots have no token and read no key): the packed activations are
    then reshaped into the view, not sliced to the slots' rows and padded back, two small fusions
    a layer that priced the one-slot step dearer than the eight-slot one (docs/performance.md)."""
    if width != 1 or bucket <= rows or not isinstance(cache, KVCache):
        return rows
    if not attention_backend(cache.impl).takes_raw_queries(cache, cache.k):
        return rows
    return rows if slots_split(cache.k.shape) else bucket


def layer_attention(attn: AttentionMetadata, q, k, v, kv, layer, dtype, q_prep: QueryPrep | None = None):
    """One decoder layer's attention: q [B, T, Nq, D], k / v [B, T, Nkv, D] of the chunk, `kv` the
    cache's K / V pools carried through the layer scan (None without a cache), `layer` its index
    -> (out [B, T, Nq, D], kv after this layer's writes, this layer's outputs for the scan's ys:
    the views' K / V of a `PackedVerify`, else None). `q_prep`: q is raw (only where
    `takes_raw_queries`)."""
    if q_prep is not None and not takes_raw_queries(attn):
        raise ValueError(f"raw queries for an attention that does not take them ({type(attn).__name__})")
    if isinstance(attn, CausalSelf):
        if attn.kernel == "splash":
            return splash_causal_attention(q, k, v, attn.valid), kv, None
        return causal_attention(q, k, v, attn.valid, attn.block), kv, None
    if isinstance(attn, MaskedSelf):
        return attention(q, k, v, attn.mask), kv, None
    if isinstance(attn, CacheUpdate):
        kv = attn.cache.write_layer_at(kv[0], kv[1], layer, attn.rows, attn.write_pos, k, v)  # dense or paged
        out = attn.cache.attend_layer(q, kv[0], kv[1], layer, attn.mask, dtype, positions=attn.positions,
                                      rows=attn.slots)
        return out, kv, None
    if isinstance(attn, PackedVerify):
        out, views_kv = _packed_attention(attn, q, k, v, kv, layer, dtype, q_prep)
        return out, kv, views_kv
    raise TypeError(f"no attention variant for {type(attn).__name__}")
