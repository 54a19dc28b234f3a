"""Per-mode drafter adapters: prefill, draft (per-row keys) and the post-verification update.

Every function takes the static `Spec`, the drafter's array dict and the `DecodeState`
pieces, so one round is one traced program whatever the mode. Draft randomness is per
row (`keys` [R]): a request's drafts depend on its own key and round only, never on the
other slots (the drafters' own sampling helpers take one key per batch, so they are
vmapped over rows here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp

from dspark_jax.drafter import backbone, heads
from dspark_jax.drafter import eagle3 as e3
from dspark_jax.drafter import mtp as mtp1
from dspark_jax.target.config import ModelConfig
from dspark_jax.target.kv_cache import KVCache
from dspark_jax.decoding.sampling import SamplingParams, sampling_path

MODES = ("ar", "dspark", "dflash", "eagle3", "mtp1")


@dataclass(frozen=True)
class Spec:
    """Everything static about a compiled engine (hashable: the jit cache key)."""

    mode: str
    G: int  # compiled block size (draft tokens per round); 0 for target-only
    tcfg: ModelConfig  # target
    dcfg: ModelConfig | None  # drafter layer config (DSpark/DFlash) or the target config (Eagle3/MTP-1)
    mask_id: int
    window: int | None
    feature_layers: tuple[int, ...]
    buckets: tuple[int, ...]
    max_len: int
    policy: Callable
    verifier: str = "exact"  # "exact" | deliberately broken, for tests: "no_residual" | "unfiltered_q"
    skip_drafting: str | None = None  # None | "best_case" | "known": when to skip the draft (engine.py)
    theta: str = "latency"  # throughput objective of the skip rule ("sps" | "latency")
    probe_every: int = 8  # "known" rule: first probe interval (rounds) to refresh the survivals ...
    probe_max: int = 64  # ... doubled after each draft whose survivals say no speculation pays, up to this

    @property
    def Gs(self) -> int:
        """Width of confidence / survival arrays (>= 1 so target-only still has shapes)."""
        return max(self.G, 1)


# ------------------------------------------------------------------ prefill


def prefill_drafter(spec: Spec, dp, dcache, last, feats, hidden, tokens, plen, join):
    """After the target prefill of x_0..x_{n-2}: write the drafter's context for joining rows.

    feats [R, P, m, H] / hidden [R, P, H] of positions 0..P-1; tokens [R, P]; plen [R] = n.
    """
    r, p = tokens.shape
    col = jnp.arange(p, dtype=jnp.int32)[None]
    if spec.mode in ("dspark", "dflash"):
        valid = (col < plen[:, None] - 1) & join[:, None]
        dcache = backbone.update_context(dp, spec.dcfg, dcache, feats, jnp.broadcast_to(col, (r, p)), valid)
        return dcache, last
    if spec.mode in ("eagle3", "mtp1"):
        nxt = jnp.concatenate([tokens[:, 1:], jnp.zeros((r, 1), jnp.int32)], axis=1)
        valid = (col < plen[:, None] - 2) & join[:, None]
        dcache = dcache.with_lengths(jnp.where(join, 0, dcache.lengths))
        idx = jnp.clip(plen - 2, 0, p - 1)
        if spec.mode == "eagle3":
            dcache = e3.eagle3_update(dp, dcache, feats, nxt, valid, cfg=spec.tcfg)
            new_last = feats[jnp.arange(r), idx]
        else:
            dcache = mtp1.mtp_update(dp, dcache, hidden, nxt, valid, cfg=spec.tcfg)
            new_last = hidden[jnp.arange(r), idx]
        return dcache, jnp.where(join.reshape(r, *([1] * (last.ndim - 1))), new_last.astype(last.dtype), last)
    return dcache, last


# ------------------------------------------------------------------ draft


def draft(spec: Spec, dp, dcache, last, anchor, pos, keys, sampling: SamplingParams):
    """-> (tokens [R, G], q [R, G, V], z [R, G], q_raw [R, G, V] or None, dcache).

    The sampling path is chosen once for the batch, outside the per-row vmaps (else every
    row would run all of `sampling_probs`' paths, the full-vocabulary sort included)."""
    r = anchor.shape[0]
    path = sampling_path(*sampling, spec.tcfg.vocab_size)
    if spec.mode in ("dspark", "dflash"):
        h = backbone.draft_hidden(dp, spec.dcfg, dcache, anchor, pos, gamma=spec.G, mask_id=spec.mask_id,
                                  window=spec.window)

        def one(k, h_r, a_r, s_r):
            t, q, z = heads.sample_block(k, dp, h_r[None], a_r[None], s_r, path)
            return t[0], q[0], z[0]

        toks, q, z = jax.vmap(one)(keys, h, anchor, sampling)
        q_raw = None
        if spec.verifier == "unfiltered_q":
            prev = jnp.concatenate([anchor[:, None], toks[:, :-1]], axis=1)
            logits = heads.base_logits(dp, h) + heads.head_bias_train(dp, h, prev)
            q_raw = jax.nn.softmax(logits, axis=-1)
        return toks, q, z, q_raw, dcache
    if spec.mode in ("eagle3", "mtp1"):
        def draft_rows(k, c, lst, a, p, s):
            if spec.mode == "eagle3":
                return e3.eagle3_draft(k, dp, c, lst, a, p, spec.G, s, cfg=spec.tcfg, path=path)
            return mtp1.mtp_draft(k, dp, c, lst, a, p, s, cfg=spec.tcfg, path=path)

        def one(k, ck, cv, ln, l_r, a_r, p_r, s_r):
            t, q, c = draft_rows(k, KVCache(ck[:, None], cv[:, None], ln[None]), l_r[None], a_r[None], p_r[None], s_r)
            return t[0], q[0], c.k[:, 0], c.v[:, 0], c.lengths[0]

        toks, q, k, v, ln = jax.vmap(one, in_axes=(0, 1, 1, 0, 0, 0, 0, 0), out_axes=(0, 0, 1, 1, 0))(
            keys, dcache.k, dcache.v, dcache.lengths, last, anchor, pos, sampling)
        return toks, q, jnp.zeros((r, spec.G), jnp.float32), None, KVCache(k, v, ln)
    raise ValueError(f"no drafter in mode {spec.mode!r}")


# ------------------------------------------------------------------ update


def update_drafter(spec: Spec, dp, dcache, last, feats, hidden, pos, drafts, acc, active):
    """After verification: the drafter sees the target features of [old anchor, accepted drafts].

    feats [R, G+1, m, H], hidden [R, G+1, H] of positions pos..pos+G; acc [R] accepted drafts.
    """
    r, t = feats.shape[:2]
    col = jnp.arange(t, dtype=jnp.int32)[None]
    if spec.mode in ("dspark", "dflash"):
        valid = (col <= acc[:, None]) & active[:, None]
        return backbone.update_context(dp, spec.dcfg, dcache, feats, pos[:, None] + col, valid), last
    if spec.mode in ("eagle3", "mtp1"):
        g = drafts.shape[1]
        valid = (col[:, :g] < acc[:, None]) & active[:, None]
        if spec.mode == "eagle3":
            dcache = e3.eagle3_update(dp, dcache, feats[:, :g], drafts, valid, cfg=spec.tcfg)
            new_last = feats[jnp.arange(r), acc]
        else:
            dcache = mtp1.mtp_update(dp, dcache, hidden[:, :g], drafts, valid, cfg=spec.tcfg)
            new_last = hidden[jnp.arange(r), acc]
        keep = active.reshape(r, *([1] * (last.ndim - 1)))
        return dcache, jnp.where(keep, new_last.astype(last.dtype), last)
    return dcache, last
