"""Deliberately broken variants of lossless pieces. The tests inject them and must catch them;
nothing on the production path can select them.

- `verify_no_residual`: after a rejection, resample from p instead of norm(max(p - q, 0)).
- `UnfilteredQ`: a DSpark kind whose drafts are verified against the unfiltered softmax of the
  drafter's logits instead of the (temperature / top-k / top-p) distribution they were sampled from.
- `schedule_retroactive_lossy`: Algorithm 1 without its early stop (argmax over all
  prefixes), which lets a draft's own value decide whether it is verified (docs/method.md §3, the paper's Appendix A);
  its numpy reference is `schedule_retroactive_lossy_np` in tests/scheduler/prefix_reference.py.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from dspark_jax.decoding import rejection
from dspark_jax.decoding.sampling import sample
from dspark_jax.drafter import heads
from dspark_jax.drafter.kinds.block import BlockKind
from dspark_jax.scheduler import prefix

__all__ = ["verify_no_residual", "UnfilteredQ", "schedule_retroactive_lossy"]


def verify_no_residual(key, d, q, p, l):
    """`rejection.verify`'s signature; resamples a rejected slot from p (biased towards q's support)."""
    g = d.shape[1]
    k_u, k_s = jax.random.split(key)
    pd = rejection.probs_at(p, d)  # p: [R, G+1, V] or the round's PackedProbs
    qd = rejection.probs_at(q, d)  # q: [R, G, V] or the round's PackedProbs
    u = jax.random.uniform(k_u, d.shape, jnp.float32)
    accept = (u * qd < pd) & (jnp.arange(g)[None] < l[:, None])
    acc = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    last = sample(k_s, rejection.probs_row(p, acc))
    pos = jnp.arange(g + 1)[None]
    ext = jnp.concatenate([d, jnp.zeros_like(d[:, :1])], axis=1)
    out = jnp.where(pos < acc[:, None], ext, jnp.where(pos == acc[:, None], last[:, None], -1))
    return acc, out, acc + 1


class UnfilteredQ(BlockKind):
    """Drafts like DSpark / DFlash but hands the verifier softmax(U + B) instead of the q sampled from."""

    def __init__(self, name: str = "dspark"):
        self.name = name

    def draft(self, spec, dp, dcache, last, anchor, pos, keys, sampling, path):
        toks, _, z, dcache = super().draft(spec, dp, dcache, last, anchor, pos, keys, sampling, path)
        h = self.draft_hidden(spec, dp, dcache, anchor, pos)
        prev = jnp.concatenate([anchor[:, None], toks[:, :-1]], axis=1)
        q_raw = jax.nn.softmax(heads.base_logits(dp, h) + heads.head_bias_train(dp, h, prev), axis=-1)
        return toks, q_raw, z, dcache


@partial(jax.jit, static_argnames=("mode", "cost"))
def schedule_retroactive_lossy(a, active, table: prefix.CostTable, mode="sps", cost="interp"):
    """The prefix with the argmax over ALL prefix throughputs Theta_i (looks past a non-improving candidate)."""
    a, active, cand = prefix._prep(a, active)
    sorted_a, n_cand, rank = prefix._order(a, cand)
    n_act = jnp.sum(active).astype(jnp.int32)
    return prefix._lengths(rank, cand, prefix._global_n(sorted_a, n_cand, n_act, table, mode, cost))
