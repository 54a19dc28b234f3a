"""The keys of the tokens a forward reads beside a cache it does not write (yet).

Verification (target/attention.py), the drafter's block (drafter/backbone.py) and Eagle3's step
attend to a cache's committed keys and to the keys of the tokens they forward themselves, in one
softmax. Those own keys are one small block per row, described here once: its K / V, which of
its columns hold tokens (a prefix of each row), and whether query t sees only own keys w <= t (the queries are the
block's own tokens) or all of them (the drafter's block sees itself whole). The attention
backend (target/attention_backend.py) gives the block to the cache kernel, which takes it into
its online softmax after the cache's keys, or to the reference path as one more masked key set.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

__all__ = ["OwnKeys"]


@dataclasses.dataclass(frozen=True)
class OwnKeys:
    k: jax.Array  # [R, W, Nkv, D]
    v: jax.Array  # [R, W, Nkv, D]
    lengths: jax.Array  # [R] int32: columns < lengths[r] hold row r's tokens (the others are never seen)
    causal: bool = True  # static: query t sees own key w iff w <= t (then T == W)

    @classmethod
    def of_prefix(cls, k, v, valid, causal: bool = True) -> OwnKeys:
        """From a `valid` [R, W] mask that is a prefix of each row (the engine's blocks and views)."""
        return cls(k, v, jnp.sum(valid, axis=1, dtype=jnp.int32), causal)

    def mask(self, num_queries: int) -> jax.Array:
        """[R, T, W]: own key w visible to query t."""
        w = jnp.arange(self.k.shape[1], dtype=jnp.int32)
        seen = jnp.broadcast_to((w[None, :] < self.lengths[:, None])[:, None, :],
                                (self.k.shape[0], num_queries, self.k.shape[1]))
        if not self.causal:
            return seen
        return seen & (w[None, :] <= jnp.arange(num_queries, dtype=jnp.int32)[:, None])[None]

    def astype(self, dtype) -> OwnKeys:
        return dataclasses.replace(self, k=self.k.astype(dtype), v=self.v.astype(dtype))

    def as_part(self, num_queries: int):
        """(k, v, mask [R, T, W]): one key set of `layers.attention_parts`."""
        return self.k, self.v, self.mask(num_queries)


jax.tree_util.register_dataclass(OwnKeys, data_fields=["k", "v", "lengths"], meta_fields=["causal"])
