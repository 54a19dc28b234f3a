"""Static-shape KV cache as a plain pytree.

R request slots, a preallocated length S, and per-slot `lengths` (the number of committed
tokens). A forward writes K/V for its valid tokens at their positions; committing or
rolling back after rejected drafts only moves `lengths`, the arrays stay as they are.

Heads-major, `[L, R, Nkv, S, D]`, as the paged pool's pages are `[Nkv, page_size, D]`: one KV
head's positions are a `(S, D)` matrix, the tile a TPU kernel block reads, so the Pallas kernel
(target/paged_kernel.py) reads a row's filled positions in place (`kernel_lse`). How attention
reads it is the backend's choice (target/attention_backend.py, from `impl`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from dspark_jax.parallel.sharding import constrain, logical_to_pspec
from dspark_jax.target.attention_backend import attention_backend
from dspark_jax.target.paged_kernel import DENSE_CACHE_AXES, attention_lse, dense_attention_lse, merge_own, slots_split

# slots over the batch axes, KV heads over tensor (on the mesh set by `jax.set_mesh`, if any)
CACHE_AXES = DENSE_CACHE_AXES

__all__ = ["KVCache", "CACHE_AXES", "KERNEL_MIN_BYTES", "write_tokens"]

KERNEL_MIN_BYTES = 4 << 20  # K and V of one layer on one chip from which the kernel reads the dense cache


def write_tokens(pool, layer, outer, position, values):
    """`values` [..., Nkv, D] written into `pool` [L, A, Nkv, B, D] at (layer, outer, head, position)
    for the broadcast of `outer` and `position` [...] (a dense cache: slot and position; a paged
    pool: page and offset) and every head; indices outside the pool are dropped. Each write is one
    head's `[D]` row, contiguous in the pool's layout: XLA:TPU relays the whole cache around a
    write whose window is `[Nkv, D]` (heads and D apart, the position axis between them) wherever a
    chip holds two KV heads or more (docs/performance.md, "Cache writes per head")."""
    layer, outer, position = jnp.broadcast_arrays(*(jnp.asarray(a, jnp.int32) for a in (layer, outer, position)))
    heads = jnp.arange(pool.shape[2], dtype=jnp.int32)
    index = (layer[..., None], outer[..., None], heads, position[..., None])
    return pool.at[index].set(values.astype(pool.dtype), mode="drop")


@dataclasses.dataclass(frozen=True, eq=False)  # eq on arrays is ambiguous: compare leaves
class KVCache:
    DENSE: ClassVar[bool] = True  # the kernels read a row's own positions (target/attention_backend.py)
    k: jax.Array  # [num_layers, R, num_kv_heads, S, head_dim]
    v: jax.Array  # same
    lengths: jax.Array  # [R] int32, committed tokens per slot
    # static: how attention reads it, "auto" / "pallas" / "reference" (target/attention_backend.py)
    impl: str = "auto"

    @classmethod
    def create(cls, cfg, num_slots: int, max_len: int, dtype=jnp.float32, num_layers: int | None = None,
               impl: str = "auto") -> KVCache:
        shape = (num_layers or cfg.num_layers, num_slots, cfg.num_kv_heads, max_len, cfg.head_dim)
        zeros = lambda: constrain(jnp.zeros(shape, dtype), CACHE_AXES)
        return cls(zeros(), zeros(), jnp.zeros((num_slots,), jnp.int32), impl)

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def _replace(self, **kw) -> KVCache:
        return dataclasses.replace(self, **kw)

    def with_lengths(self, lengths) -> KVCache:
        """Commit (or roll back to) `lengths` tokens per slot: a pointer move, no copy."""
        return self._replace(lengths=jnp.asarray(lengths, jnp.int32))

    @staticmethod
    def write_layer_at(k_all, v_all, layer, rows, positions, k, v):
        """`k`, `v` [..., Nkv, D] written into layer `layer` of the stacked cache [L, R, Nkv, S, D]
        at (`rows`, `positions`) (broadcast together; the indices are split by the heads' slice,
        so their broadcast shape leads, as in k); positions >= S (padding) are dropped. In place
        when the cache is a loop carry. Every dense cache write in the project (target,
        verification, drafter context, Eagle3 / MTP-1) is this."""
        return write_tokens(k_all, layer, rows, positions, k), write_tokens(v_all, layer, rows, positions, v)

    @staticmethod
    def layer_view(k_all, v_all, layer, dtype, rows=None):
        """Layer `layer`'s keys and values as [R, S, Nkv, D] in `dtype` (read only); with `rows` [K]
        only those slots' ([K, S, Nkv, D]; rows >= R read the last slot: the caller masks them)."""
        k, v = k_all[layer], v_all[layer]
        if rows is not None:
            rows = jnp.minimum(rows, k.shape[0] - 1)
            k, v = k[rows], v[rows]
        return k.swapaxes(1, 2).astype(dtype), v.swapaxes(1, 2).astype(dtype)

    def dense(self):
        """(k, v) as [L, R, S, Nkv, D], positions before heads, as the paged cache's `dense()`
        (for tests and inspection)."""
        return self.k.swapaxes(2, 3), self.v.swapaxes(2, 3)

    def kernel_pays(self, k_all) -> bool:
        """Whether the GPU kernel is worth its call for one layer of this cache (the TPU kernel,
        with no merge around it, is used at every size: attention_backend.py). The reference reads
        the layer's whole [R, S] twice (scores, values) in XLA's own fusions; the kernel reads only
        the filled positions once but adds a call and the log-sum-exp merge around it. Below
        `KERNEL_MIN_BYTES` of K and V a layer on one chip the reference was cheaper where this was
        priced, on TPU before the kernel took the own keys (docs/performance.md, "Attention that
        reads only the cache it needs"); on a GPU the threshold is unmeasured."""
        mesh = jax.sharding.get_abstract_mesh()
        shards = 1
        if not mesh.empty:
            for axes in logical_to_pspec(CACHE_AXES, k_all.shape, mesh):
                for a in (axes,) if isinstance(axes, str) else axes or ():
                    shards *= mesh.shape[a]
        return 2 * k_all[0].size * k_all.dtype.itemsize // shards >= KERNEL_MIN_BYTES

    def kernel_lse(self, q, k_all, v_all, layer, kv_len, q_start, rows=None, own=None, q_prep=None, interpret=None,
                   gpu=False, out_dtype=jnp.float32):
        """The Pallas kernel over layer `layer`, read in place up to each row's last visible key,
        with the `own` keys (`OwnKeys`) beside it, raw queries prepared by `q_prep` (`QueryPrep`)
        -> (out, lse) as `paged_kernel.paged_attention_lse`.
        Queries of chosen slots (`rows`) on a mesh that splits the slots read their rows through the
        reference instead (a shard holds only its own slots)."""
        if rows is not None and slots_split(k_all.shape):
            q = q if q_prep is None else q_prep.apply(q)
            k, v = self.layer_view(k_all, v_all, layer, q.dtype, rows)
            pos = jnp.arange(k.shape[1], dtype=jnp.int32)
            qpos = q_start[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)[None]
            mask = (pos[None, None] < kv_len[:, None, None]) & (pos[None, None] <= qpos[:, :, None])
            return merge_own(attention_lse(q, k, v, mask), q, own, out_dtype)
        return dense_attention_lse(q, k_all, v_all, kv_len, q_start, layer=layer, rows=rows, own=own, q_prep=q_prep,
                                   interpret=interpret, gpu=gpu, out_dtype=out_dtype)

    def attend_committed(self, q, k_all, v_all, layer, start, own, dtype, rows=None, q_prep=None):
        """Attention of q [R, T, Nq, D] over layer `layer`'s keys at positions < start [R] and the
        block's own keys `own` (`OwnKeys`), with one softmax (`AttentionBackend.committed`)."""
        return attention_backend(self.impl).committed(self, q, k_all, v_all, layer, start, own, dtype, rows, q_prep)

    def attend_layer(self, q, k_all, v_all, layer, mask, dtype, positions=None, rows=None):
        """Attention of q [R, T, Nq, D] against layer `layer`, mask [R, T, max_len]; `rows` [K]: q
        are queries of those slots (`AttentionBackend.new_tokens`)."""
        return attention_backend(self.impl).new_tokens(self, q, k_all, v_all, layer, mask, dtype, positions, rows)


jax.tree_util.register_dataclass(KVCache, data_fields=["k", "v", "lengths"], meta_fields=["impl"])
