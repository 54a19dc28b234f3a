"""Static-shape KV cache as a plain pytree.

R request slots, a preallocated length S, and per-slot `lengths` (the number of committed
tokens). A forward writes K/V for its valid tokens at their positions; committing or
rolling back after rejected drafts only moves `lengths`, the arrays stay as they are.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from dspark_jax.parallel.sharding import constrain
from dspark_jax.target.layers import attention, attention_parts

# slots over the batch axes, KV heads over tensor (on the mesh set by `jax.set_mesh`, if any)
CACHE_AXES = (None, "batch", None, "kv_heads", None)


def attend_before(q, k, v, start, extra):
    """q [R, T, Nq, D] over the keys k, v [R, S, Nkv, D] at positions < start [R] and the key sets
    in `extra`, one softmax (`attention_parts`): what both caches' `attend_committed` compute."""
    r, t, s = q.shape[0], q.shape[1], k.shape[1]
    before = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None, None, :] < start[:, None, None], (r, t, s))
    return attention_parts(q, [(k, v, before), *extra])


class KVCache(NamedTuple):
    k: jnp.ndarray  # [num_layers, R, S, num_kv_heads, head_dim]
    v: jnp.ndarray  # same
    lengths: jnp.ndarray  # [R] int32, committed tokens per slot

    @classmethod
    def create(cls, cfg, num_slots: int, max_len: int, dtype=jnp.float32, num_layers: int | None = None) -> "KVCache":
        shape = (num_layers or cfg.num_layers, num_slots, max_len, cfg.num_kv_heads, cfg.head_dim)
        zeros = lambda: constrain(jnp.zeros(shape, dtype), CACHE_AXES)
        return cls(zeros(), zeros(), jnp.zeros((num_slots,), jnp.int32))

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def with_lengths(self, lengths) -> "KVCache":
        """Commit (or roll back to) `lengths` tokens per slot: a pointer move, no copy."""
        return self._replace(lengths=jnp.asarray(lengths, jnp.int32))

    @staticmethod
    def write_layer(k_cache, v_cache, rows, positions, k, v):
        """One layer's slices [R, S, Nkv, D] with `k`, `v` [..., Nkv, D] written at (`rows`,
        `positions`) (broadcast together); positions >= S (padding) are dropped. Every cache
        write in the project (target, verification, drafter context, Eagle3 / MTP-1) is this."""
        return (k_cache.at[rows, positions].set(k.astype(k_cache.dtype), mode="drop"),
                v_cache.at[rows, positions].set(v.astype(v_cache.dtype), mode="drop"))

    @staticmethod
    def write_layer_at(k_all, v_all, layer, rows, positions, k, v):
        """`write_layer` into layer `layer` of the whole stacked cache [L, R, S, Nkv, D]: the
        update stays in place when the cache is a loop carry (no copy of the whole cache)."""
        return (k_all.at[layer, rows, positions].set(k.astype(k_all.dtype), mode="drop"),
                v_all.at[layer, rows, positions].set(v.astype(v_all.dtype), mode="drop"))

    @staticmethod
    def layer_view(k_all, v_all, layer, dtype, rows=None):
        """Layer `layer`'s keys and values [R, S, Nkv, D] in `dtype` (read only); with `rows` [K]
        only those slots' ([K, S, Nkv, D]; rows >= R read the last slot: the caller masks them)."""
        k, v = k_all[layer], v_all[layer]
        if rows is not None:
            rows = jnp.minimum(rows, k.shape[0] - 1)
            k, v = k[rows], v[rows]
        return k.astype(dtype), v.astype(dtype)

    def attend_committed(self, q, k_all, v_all, layer, start, extra, dtype, rows=None):
        """Attention of q [R, T, Nq, D] over layer `layer`'s keys at positions < start [R] (read in
        place) and the key sets in `extra` [(k, v, mask [R, T, S_i])], with one softmax. With
        `rows` [K], q [K, T, ..] are queries of those slots (a prefill chunk's rows)."""
        return attend_before(q, *self.layer_view(k_all, v_all, layer, dtype, rows), start, extra)

    @staticmethod
    def attend_layer(q, k_all, v_all, layer, mask, dtype, positions=None):
        """Attention of q [R, T, Nq, D] against layer `layer` of the stacked cache, mask [R, T, S]
        (the paged cache, target/paged_kv.py, has the same method: forwards call only these)."""
        return attention(q, k_all[layer].astype(dtype), v_all[layer].astype(dtype), mask)
