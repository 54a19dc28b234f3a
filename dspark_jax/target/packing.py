"""Packing the valid tokens of padded `[R, T]` blocks into one flat batch of a compiled size.

The target's verification runs its dense work (projections, MLP, LM head) on the packed tokens,
so it scales with the number of tokens verified, not with `R * T`, while every shape stays
static. `pack` and `unpack` are the two index maps between the padded view and the packed batch.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["Packing", "pack", "pack_in_place", "unpack"]


class Packing(NamedTuple):
    dest: jax.Array  # [R*T] packed index of each padded token (bucket = not packed)
    slot: jax.Array  # [bucket] row of each packed token (R = padding)
    col: jax.Array  # [bucket] column in the padded view
    pos: jax.Array  # [bucket] sequence position (S = padding: cache writes dropped)
    tok: jax.Array  # [bucket] token id
    n: jax.Array  # scalar: number of valid packed tokens


def pack(tokens, start, valid, bucket: int, max_len: int, offset=0) -> Packing:
    """tokens/valid [R, T], start [R] (position of column 0) -> a packing of the valid tokens
    into `bucket` slots, row-major, from packed index `offset` on (a second lane packs after
    the first). Valid tokens beyond the bucket are dropped (callers size the bucket so that
    never happens). Entries of the bucket this lane does not fill have slot R."""
    r, t = tokens.shape
    fv = valid.reshape(-1)
    idx = jnp.cumsum(fv.astype(jnp.int32)) - 1 + offset
    dest = jnp.where(fv, idx, bucket)
    slot = jnp.full((bucket,), r, jnp.int32).at[dest].set(jnp.repeat(jnp.arange(r, dtype=jnp.int32), t), mode="drop")
    col = jnp.zeros((bucket,), jnp.int32).at[dest].set(jnp.tile(jnp.arange(t, dtype=jnp.int32), r), mode="drop")
    tok = jnp.zeros((bucket,), jnp.int32).at[dest].set(tokens.reshape(-1).astype(jnp.int32), mode="drop")
    live = slot < r
    pos = jnp.where(live, start[jnp.minimum(slot, r - 1)] + col, max_len)
    return Packing(dest, slot, col, pos.astype(jnp.int32), tok, jnp.sum(fv.astype(jnp.int32)))


def pack_in_place(tokens, start, valid, bucket: int, max_len: int) -> Packing:
    """The packing of a bucket that holds the whole view (`bucket` >= R * T): token (r, t) at packed
    index r * T + t, valid or not (an invalid one, and every entry past R * T, is padding: slot R,
    position S). The view is then the packed batch's first R * T rows, so attention reshapes
    instead of scattering into the view."""
    r, t = tokens.shape
    flat = jnp.arange(bucket, dtype=jnp.int32)
    fv = jnp.pad(valid.reshape(-1), (0, bucket - r * t))
    slot = jnp.where(fv, flat // t, r)
    col = jnp.where(fv, flat % t, 0)
    pos = jnp.where(fv, start[jnp.minimum(slot, r - 1)] + col, max_len)
    tok = jnp.where(fv, jnp.pad(tokens.reshape(-1).astype(jnp.int32), (0, bucket - r * t)), 0)
    dest = jnp.where(valid.reshape(-1), flat[:r * t], bucket)
    return Packing(dest, slot, col, pos.astype(jnp.int32), tok, jnp.sum(valid.astype(jnp.int32)))


def unpack(packed, pk: Packing, r: int, t: int):
    """[bucket, ...] -> [R, T, ...] (tokens that were not packed get an arbitrary finite row)."""
    b = packed.shape[0]
    return packed[jnp.clip(pk.dest, 0, b - 1)].reshape(r, t, *packed.shape[1:])
