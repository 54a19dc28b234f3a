"""What turns a projection's raw queries into the ones attention scores: Qwen3's per-head RMSNorm
(when the model has it) and RoPE at each query's position.

A decoder layer normally applies both before its attention (`layers.project_qkv`). On TPU each
is a handful of small XLA fusions per layer (a reduction, its rsqrt, the scaling, the rotation,
casts), each priced at 1-2 us whatever its size: at 8 rows about a fifth of a Qwen3-8B
target-only step (docs/performance.md). The cache kernel (target/paged_kernel.py) applies them to
its query block instead, once per block, in VMEM; `apply` is the same computation in jnp, for
every other path, rounding where `layers.rms_norm` and `layers.apply_rope` round.
"""

from __future__ import annotations

import dataclasses

import jax

from dspark_jax.target.layers import apply_rope, rms_norm

__all__ = ["QueryPrep"]


@dataclasses.dataclass(frozen=True)
class QueryPrep:
    norm: jax.Array | None  # [D] the per-head RMSNorm weight (Qwen3's q_norm), None: no norm
    cos: jax.Array  # [R, T, D] float32, at each query's position (`layers.rope_cos_sin`)
    sin: jax.Array  # [R, T, D] float32
    eps: float = 1e-6  # static: the norm's epsilon

    def apply(self, q):
        """q [R, T, Nq, D] raw -> the queries attention scores."""
        if self.norm is not None:
            q = rms_norm(q, self.norm, self.eps)
        return apply_rope(q, self.cos, self.sin)

    def replace(self, **kw) -> QueryPrep:
        return dataclasses.replace(self, **kw)


jax.tree_util.register_dataclass(QueryPrep, data_fields=["norm", "cos", "sin"], meta_fields=["eps"])
