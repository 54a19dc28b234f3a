"""Speculative verification (rejection sampling) for a batch of requests (docs/method.md §5).

``q`` and ``p`` must be the exact distributions the tokens are / would be sampled from,
i.e. both produced by :func:`dspark_jax.decoding.sampling.sampling_probs` with the same sampling
parameters. Greedy decoding needs nothing special: one-hot p and q give "accept iff the
draft equals the target argmax" and the correction is the target argmax.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from dspark_jax.decoding.sampling import sample

__all__ = ["verify", "residual_distribution", "PackedProbs", "probs_at", "probs_row"]


class PackedProbs(NamedTuple):
    """Target distributions left where the verification computed them: request r's row j is
    `packed[dest[r, j]]` (the bucket's packed rows), so verifying never builds `[R, G+1, V]`;
    only the rows rejection reads are gathered (`probs_at`, `probs_row`)."""

    packed: jax.Array  # [B, V]
    dest: jax.Array  # [R, G+1] int32 packed row of each (request, slot)


def _packed(p) -> PackedProbs:
    """`[R, G+1, V]` probabilities as the packed view of themselves (row r * (G+1) + j), so both
    inputs take the one gather path below."""
    if isinstance(p, PackedProbs):
        return p
    r, t, v = p.shape
    return PackedProbs(jnp.reshape(p, (r * t, v)), jnp.arange(r * t, dtype=jnp.int32).reshape(r, t))


def probs_at(p, tokens) -> jax.Array:
    """p_j(tokens_j) for j < G: `[R, G]`, from `[R, G+1, V]` probabilities or PackedProbs."""
    p = _packed(p)
    return p.packed.astype(jnp.float32)[p.dest[:, : tokens.shape[1]], tokens]


def probs_row(p, idx) -> jax.Array:
    """Row idx[r] of request r's distributions: `[R, V]`."""
    p = _packed(p)
    return p.packed.astype(jnp.float32)[p.dest[jnp.arange(idx.shape[0]), idx]]


def residual_distribution(p_row: jax.Array, q_row: jax.Array) -> jax.Array:
    """Unnormalised ``max(p - q, 0)``, or ``p`` where that has no mass. ``[..., V]``."""
    resid = jnp.maximum(p_row - q_row, 0.0)
    has_mass = jnp.sum(resid, axis=-1, keepdims=True) > 0.0
    return jnp.where(has_mass, resid, p_row)


def verify(
    key: jax.Array,
    draft_tokens: jax.Array,
    q: jax.Array,
    p: jax.Array,
    lengths: jax.Array,
    eos_id: Optional[int] = None,
    pad_id: int = -1,
):
    """Verify ``lengths[r]`` drafts per row; returns ``(accepted_count, out_tokens, n_out)``.

    Args:
      key: PRNG key.
      draft_tokens: int ``[R, G]``; only the first ``lengths[r]`` of row r are verified.
      q: ``[R, G, V]`` drafter distributions the drafts were sampled from, or the same as
        `PackedProbs` (rows of a flat ``[R * G, V]`` left where the draft wrote them).
      p: ``[R, G+1, V]`` target distributions (row j predicts the token at slot j; row G
        is the bonus row after all G drafts), or the same as `PackedProbs` (the engine's round:
        only the rows read are gathered, with the same arithmetic).
      lengths: int ``[R]`` in ``0..G``.
      eos_id: optional (static) EOS id. Output tokens after the first EOS are dropped and
        ``n_out`` counts up to and including it (no bonus/correction after an EOS draft).
      pad_id: value written in ``out_tokens`` beyond ``n_out``.

    Returns:
      accepted_count: int32 ``[R]``, draft tokens accepted that appear in the output
        (``<= lengths``). Without an EOS truncation ``n_out == accepted_count + 1``; when
        an accepted draft is EOS, ``n_out == accepted_count`` (it ends the output).
      out_tokens: int32 ``[R, G+1]``: accepted drafts, then the correction (first
        rejection, sampled from ``norm(max(p_j - q_j, 0))``, or ``p_j`` when that has no
        mass) or the bonus (all accepted, sampled from ``p[lengths]``), then ``pad_id``.
      n_out: int32 ``[R]`` number of valid tokens in ``out_tokens``.
    """
    draft_tokens = jnp.asarray(draft_tokens, jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)
    R, G = draft_tokens.shape
    k_u, k_s = jax.random.split(key)

    pd = probs_at(p, draft_tokens)
    qd = probs_at(q, draft_tokens)
    u = jax.random.uniform(k_u, (R, G), jnp.float32)
    # accept w.p. min(1, pd/qd): u < pd/qd  <=>  u*qd < pd  (u in [0, 1)).
    accept = (u * qd < pd) & (jnp.arange(G)[None, :] < lengths[:, None])
    acc = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)

    p_a = probs_row(p, acc)  # [R, V]
    q_a = probs_row(q, jnp.minimum(acc, G - 1))
    rejected = acc < lengths
    dist = jnp.where(rejected[:, None], residual_distribution(p_a, q_a), p_a)
    last = sample(k_s, dist)

    pos = jnp.arange(G + 1)[None, :]
    drafts_ext = jnp.concatenate([draft_tokens, jnp.zeros((R, 1), jnp.int32)], axis=1)
    out = jnp.where(pos < acc[:, None], drafts_ext, jnp.where(pos == acc[:, None], last[:, None], pad_id))
    n_out = acc + 1
    if eos_id is not None:
        is_eos = (out == eos_id) & (pos < n_out[:, None])
        first_eos = jnp.argmax(is_eos, axis=1)
        n_out = jnp.where(jnp.any(is_eos, axis=1), first_eos + 1, n_out).astype(jnp.int32)
        acc = jnp.minimum(acc, n_out)
        out = jnp.where(pos < n_out[:, None], out, pad_id)
    return acc.astype(jnp.int32), out.astype(jnp.int32), n_out.astype(jnp.int32)
