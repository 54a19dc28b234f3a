"""MTP-1 baseline, DeepSeek-V3 style (docs/method.md §6).

    x_t = Dense(2H -> H)([h_norm(h_t); e_norm(embed(x_{t+1}))])
    -> one causal decoder layer of the target's family (own KV cache at inference)
    -> final norm -> the target's frozen LM head, predicting x_{t+2}.

`h_t` is the target's final hidden state at position t, *after* its final norm
(`ForwardOut.hidden`), as in DeepSeek-V3 serving engines, where the main model hands
its normed output to the MTP module, which normalises it again. Note the
concatenation order: docs/method.md §6 writes `[h; e]`; the DeepSeek-V3 checkpoints'
`eh_proj` takes `[e; h]`, so importing such weights would swap the two row blocks of
`proj`.

Loss: DeepSeek-V3 trains MTP with cross-entropy on the ground-truth labels
(`L_MTP = lambda * CE`); `mtp_loss` does that, plus an optional soft cross-entropy
against the target's distribution (`soft_weight`, default 0).

One draft token per round; the cache convention is `eagle3.py`'s: a draft anchored at p
needs `lengths == p - 1`, runs at position p-1 and returns `lengths = p`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.decoding.sampling import SamplingParams, probs_from_params, sample
from dspark_jax.drafter.eagle3 import (
    _cast,
    _frozen_head,
    _Layer,
    _normal,
    _rope,
    cached_attention,
    commit_positions,
    committed,
    create_cache,
)
from dspark_jax.drafter.frozen import attach_target  # noqa: F401  (re-exported)
from dspark_jax.target.config import ModelConfig
from dspark_jax.target.kv_cache import KVCache
from dspark_jax.target.layers import attention, finish_layer, lm_head_logits, project_qkv, rms_norm
from dspark_jax.target.transformer import layer_param_shapes

__all__ = ["MTPDrafter", "attach_target", "mtp_train_logits", "mtp_loss", "mtp_update", "mtp_prefill",
           "mtp_draft_logits", "mtp_draft", "create_cache"]


class MTPDrafter(nnx.Module):
    """The MTP-1 module for a target with config `target_cfg`; `arrays()` gives the pure arrays."""

    def __init__(self, target_cfg: ModelConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32, dtype=None):
        self.cfg = target_cfg
        self.dtype = dtype
        h = target_cfg.hidden_size
        self.h_norm = nnx.Param(jnp.ones((h,), param_dtype), out_sharding=("norm",))
        self.e_norm = nnx.Param(jnp.ones((h,), param_dtype), out_sharding=("norm",))
        self.proj = nnx.Param(_normal(rngs, (2 * h, h), param_dtype), out_sharding=("fused", "embed"))
        self.layer = _Layer(layer_param_shapes(target_cfg), rngs=rngs, param_dtype=param_dtype)
        self.final_norm = nnx.Param(jnp.ones((h,), param_dtype), out_sharding=("norm",))
        self.embed, self.lm_head = _frozen_head(target_cfg, rngs, param_dtype)

    def arrays(self, dtype=None) -> dict:
        out = {"h_norm": self.h_norm[...], "e_norm": self.e_norm[...], "proj": self.proj[...],
               "layer": self.layer.arrays(), "final_norm": self.final_norm[...],
               "embed": self.embed[...], "lm_head": self.lm_head[...]}
        return _cast(out, dtype or self.dtype)


def _inputs(params, hidden, next_tokens, cfg: ModelConfig):
    """[h_norm(h_t); e_norm(embed(x_{t+1}))] @ proj -> [R, T, H]."""
    if hidden.shape[-1] != cfg.hidden_size:
        raise ValueError(f"target hidden states are {hidden.shape[-1]} wide, the MTP module expects "
                         f"{cfg.hidden_size}: pass the target's final (normed) hidden states")
    w = params["proj"]
    eps = cfg.rms_norm_eps
    emb = jnp.take(params["embed"], next_tokens, axis=0).astype(w.dtype)
    h = rms_norm(hidden.astype(w.dtype), params["h_norm"], eps)
    x = jnp.concatenate([h, rms_norm(emb, params["e_norm"], eps)], axis=-1)
    return x @ w


def _logits(params, x, cfg: ModelConfig):
    h = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    return lm_head_logits(h, params["lm_head"])


def mtp_train_logits(params, tokens, hidden, valid=None, *, cfg: ModelConfig):
    """fp32 logits [B, S, V] for all positions at once (causal); row t predicts x_{t+2}.

    tokens [B, S] = x_0..x_{S-1}; hidden [B, S, H] the target's final hidden states; valid [B, S].
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    b, s = tokens.shape
    if valid is None:
        valid = jnp.ones((b, s), bool)
    nxt = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), tokens.dtype)], axis=1)
    x = _inputs(params, hidden, nxt, cfg)
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    cos, sin = _rope(pos, cfg)
    p = params["layer"]
    q, k, v = project_qkv(p, x, cos, sin, cfg)
    mask = (pos[:, None, :] <= pos[:, :, None]) & valid[:, None, :]
    x = finish_layer(p, x, attention(q, k, v, mask), cfg)
    return _logits(params, x, cfg)


def mtp_loss_denominator(loss_mask):
    """Rows whose label x_{t+2} is a loss token (at least 1): what `mtp_loss` averages over."""
    return jnp.maximum(jnp.sum(jnp.asarray(loss_mask)[:, 2:].astype(jnp.float32)), 1.0)


def mtp_loss(logits, tokens, loss_mask, *, target_logits=None, soft_weight: float = 0.0):
    """Mean CE of row t against the label x_{t+2} over rows whose label is a loss token.

    With `soft_weight > 0`, adds `soft_weight *` the soft CE against the target's
    distribution row t+1 (`target_logits` [B, S, V], row t predicts x_{t+1}).
    """
    b, s, _ = logits.shape
    tokens = jnp.asarray(tokens, jnp.int32)
    logq = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    labels = jnp.concatenate([tokens[:, 2:], jnp.zeros((b, min(2, s)), tokens.dtype)], axis=1)[:, :s]
    mask = jnp.concatenate([loss_mask[:, 2:], jnp.zeros((b, min(2, s)), bool)], axis=1)[:, :s].astype(jnp.float32)
    den = mtp_loss_denominator(loss_mask)
    ce = -jnp.take_along_axis(logq, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    loss = jnp.sum(mask * ce) / den
    if soft_weight:
        if target_logits is None:
            raise ValueError("soft_weight > 0 needs target_logits (the target's next-token logits)")
        rows = jnp.minimum(jnp.arange(s) + 1, s - 1)
        tp = jax.lax.stop_gradient(jax.nn.softmax(target_logits.astype(jnp.float32), axis=-1))[:, rows]
        loss = loss + soft_weight * jnp.sum(mask * -jnp.sum(tp * logq, axis=-1)) / den
    return loss


def _layer_step(params, cache, hidden, next_tokens, positions, valid, cfg: ModelConfig, rows=None):
    p = params["layer"]
    x = _inputs(params, hidden, next_tokens, cfg)
    cos, sin = _rope(positions, cfg)
    q, k, v = project_qkv(p, x, cos, sin, cfg)
    out, cache = cached_attention(cache, q, k, v, positions, valid, rows)
    return finish_layer(p, x, out, cfg), cache


def mtp_update(params, cache: KVCache, hidden, tokens, valid=None, *, cfg: ModelConfig, rows=None,
               at=None) -> KVCache:
    """Commit hidden [R, T, H] of new positions lengths.. with tokens [R, T] (the token after
    each position); valid [R, T] a prefix per row. Advances `lengths` by the valid count.
    `rows` / `at`: as `eagle3_update` (a prefill chunk of some slots)."""
    r, t = tokens.shape
    if valid is None:
        valid = jnp.ones((r, t), bool)
    positions = commit_positions(cache, t, at, rows)
    _, cache = _layer_step(params, cache, hidden, tokens, positions, valid, cfg, rows)
    return committed(cache, positions, valid, rows)


def mtp_prefill(params, cache: KVCache, hidden, tokens, valid=None, *, cfg: ModelConfig) -> KVCache:
    """`mtp_update` from an empty cache."""
    return mtp_update(params, cache.with_lengths(jnp.zeros_like(cache.lengths)), hidden, tokens, valid, cfg=cfg)


def mtp_draft_logits(params, cache: KVCache, h_final_last, anchor_tok, anchor_pos, *, cfg: ModelConfig):
    """fp32 logits [R, V] for x_{p+1} from h_{p-1} [R, H] and the anchor x_p [R]; cache -> lengths p."""
    pos = (anchor_pos.astype(jnp.int32) - 1)[:, None]
    ones = jnp.ones_like(pos, bool)
    x, cache = _layer_step(params, cache, h_final_last[:, None], anchor_tok[:, None], pos, ones, cfg)
    return _logits(params, x[:, 0], cfg), cache.with_lengths(anchor_pos.astype(jnp.int32))


def mtp_draft(key, params, cache: KVCache, h_final_last, anchor_tok, anchor_pos,
              sampling: SamplingParams = SamplingParams(), *, cfg: ModelConfig, path=None):
    """One draft token: (tokens [R, 1], the exact distribution q [R, 1, V], cache with lengths p)."""
    logits, cache = mtp_draft_logits(params, cache, h_final_last, anchor_tok, anchor_pos, cfg=cfg)
    q = probs_from_params(logits, sampling, path)
    return sample(key, q)[:, None], q[:, None], cache
