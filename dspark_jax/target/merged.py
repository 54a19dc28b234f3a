"""Merged projections: q, k and v as one product, gate and up as one, as vLLM's merged layers.

A decode step's weight products are short (a few token rows), and on a TPU every product brings
small fusions of its own around it; three q/k/v products and two gate/up products per layer cost
more than one of each over the same bytes (Qwen3-8B, 8 slots on v6e-8: 2.43 -> 2.35 ms a step,
predicted; docs/performance.md). The decode weights (target/decode_weights.py) hold the merged
forms; target/layers.py reads either form.

- `qkv_proj` [Nkv * (G + 2) * D, H], output axis first (as a PyTorch Linear weight), split over
  the mesh on that axis like its parts: for each KV head, its G query heads, its key head, its
  value head, so a chip holding whole KV heads holds their query heads too, as the parts' split
  does (query head i reads KV head i // G). Output-major because XLA:TPU wants it so on v5p: held
  as [H, N] the compiler copied the weight into [N, H] every step (`copy bf16[1536,4096]`, 0.94 ms
  of the 5.82 ms 8-slot Qwen3-8B step on v5p-8, predicted), and [N, H] is what it picks for that
  argument when left to choose (`Layout.AUTO`); on v5e, v6e and v7x both are priced the same
  (docs/performance.md).
- `gate_up_proj` [2, H, I]: gate and up stacked ahead of the weight's own axes, split on I like
  its parts; the product's output [2, ..., I] splits into gate and up on its leading axis.

Both are made only where the rules table splits the query heads, the KV heads and whole KV heads
alike (`merge_choice`), and always together: the gate/up merge alone was priced dearer than no
merge on v6e-8 (3.11 against 2.43 ms at 8 slots, predicted), the compiler then copying the
separate q weights into another layout every step.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from dspark_jax.parallel.sharding import logical_to_pspec
from dspark_jax.target.config import ModelConfig

__all__ = ["MERGED_AXES", "MERGED_PRODUCTS", "MergeChoice", "merge_choice", "merge_qkv", "qkv", "split_qkv",
           "merge_gate_up", "gate_up"]

MERGED_AXES = {"qkv_proj": ("kv_heads", "embed"), "gate_up_proj": (None, "embed", "mlp")}


class MergeChoice(NamedTuple):
    qkv: bool
    gate_up: bool


def merge_choice(cfg: ModelConfig, mesh=None) -> MergeChoice:
    """Whether one layer's products merge on `mesh` (module docstring): the merged q/k/v weight's
    output axis split by the rules table as the query and KV heads are, in whole KV heads."""
    if mesh is None:
        return MergeChoice(True, True)
    h, d, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_kv_heads

    def spec(names, n):
        return tuple(logical_to_pspec(names, (h, n), mesh))

    def merged(n):  # the merged weight's split as (input axis, output axis), like the parts'
        return tuple(logical_to_pspec(MERGED_AXES["qkv_proj"], (n, h), mesh))[::-1]

    ok = (spec(("embed", "heads"), cfg.num_heads * d) == spec(("embed", "kv_heads"), nkv * d)
          == merged(nkv) == merged((cfg.num_heads + 2 * nkv) * d))
    return MergeChoice(ok, ok)


def merge_qkv(q, k, v, cfg: ModelConfig):
    """q [H, Nq D], k, v [H, Nkv D] -> qkv_proj [Nkv (G + 2) D, H]."""
    h, d, nkv = q.shape[0], cfg.head_dim, cfg.num_kv_heads
    g = cfg.num_heads // nkv
    parts = [q.reshape(h, nkv, g * d), k.reshape(h, nkv, d), v.reshape(h, nkv, d)]
    return jnp.concatenate(parts, axis=-1).reshape(h, -1).T


def qkv(h, qkv_proj):
    """h [..., H] through the merged weight [N, H] -> [..., N], one product."""
    return jnp.einsum("...h,nh->...n", h, qkv_proj)


def split_qkv(y, cfg: ModelConfig):
    """The merged product's output [..., Nkv (G + 2) D] -> q [..., Nq, D], k, v [..., Nkv, D]."""
    d, nkv = cfg.head_dim, cfg.num_kv_heads
    g = cfg.num_heads // nkv
    y = y.reshape(*y.shape[:-1], nkv, (g + 2) * d)
    q = y[..., :g * d].reshape(*y.shape[:-2], cfg.num_heads, d)
    return q, y[..., g * d:(g + 1) * d], y[..., (g + 1) * d:]


def merge_gate_up(gate, up):
    """gate, up [H, I] -> gate_up_proj [2, H, I]."""
    return jnp.stack([gate, up])


def gate_up(h, gate_up_proj):
    """h [..., H] through the merged product -> (gate, up) [..., I], one product."""
    y = jnp.einsum("...h,khi->k...i", h, gate_up_proj)
    return y[0], y[1]


# how each merged weight multiplies its input, and which of the weight's axes is the input's width
MERGED_PRODUCTS = {"qkv_proj": (qkv, -1), "gate_up_proj": (gate_up, -2)}
