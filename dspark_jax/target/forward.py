"""The target's one forward: embedding, the decoder layers, final norm, LM head.

Prefill, regeneration, training and the engine's verification all run this function; what they
differ in is the attention, given as metadata (target/attention.py), and how the layer loop runs,
given by the weights' layout:

- stacked (each weight [L, ...], the parameters' layout): one `lax.scan`, compile time independent
  of depth; what training and the cache-free forwards use. Each step slices its layer's weights
  out of the stack, and XLA materialises that slice before the products read it: a copy of every
  weight per step, which a decode step (bound by reading the weights) cannot afford.
- per layer (a tuple of L dicts, `target.decode_weights`): the layers unrolled, each product
  reading its own weight array in place, so a decode step reads every weight once. The engine's
  programs run this way where they are compiled for an accelerator
  (`target.kernels.per_layer_decode`), as MaxText's inference configurations do.

Besides the final
hidden states it returns the raw outputs (residual stream, before the final norm) of selected
layers: layer id i = output of decoder layer i = Hugging Face `hidden_states[i + 1]`, the
drafters' context features.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.parallel.sharding import constrain
from dspark_jax.target.attention import (
    AttentionMetadata,
    cache_read,
    cache_written,
    layer_attention,
    takes_raw_queries,
)
from dspark_jax.target.config import ModelConfig
from dspark_jax.target.kv_cache import KVCache
from dspark_jax.target.layers import (
    finish_layer,
    lm_head_logits,
    project_qkv,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
)
from dspark_jax.target.paged_kv import PagedKVCache
from dspark_jax.target.query_prep import QueryPrep

__all__ = ["ForwardOut", "forward", "check_feature_layers"]


class ForwardOut(NamedTuple):
    logits: jnp.ndarray | None  # [B, T, V] (float32) or None when not requested
    hidden: jnp.ndarray  # [B, T, H] after the final norm
    features: jnp.ndarray | None  # [B, T, m, H] raw outputs of the selected layers (None when m = 0)
    cache: KVCache | PagedKVCache | None  # `CacheUpdate`: K/V written for valid tokens; lengths unchanged
    layer_out: Any = None  # the attention's per-layer outputs stacked on [L, ...] (`PackedVerify`: views' K / V)


def check_feature_layers(cfg: ModelConfig, feature_layers: tuple[int, ...]) -> None:
    for i in feature_layers:
        if not 0 <= i < cfg.num_layers:
            raise ValueError(f"feature layer id {i} outside the target's {cfg.num_layers} layers")


def forward(target_params: dict, cfg: ModelConfig, tokens, positions, attn: AttentionMetadata, *,
            feature_layers: tuple[int, ...] = (), return_logits: bool = True) -> ForwardOut:
    """tokens [B, T] at `positions` [B, T] (for RoPE) through the target, attention as `attn` says.

    `target_params`: embed [V, H], layers (each weight stacked [L, ...], or a tuple of per-layer
    dicts; in the compute dtype), final_norm [H], lm_head [H, V] (`TargetModel.arrays`,
    `decode_weights.decode_arrays`).
    """
    check_feature_layers(cfg, feature_layers)
    b, t = tokens.shape
    layers = target_params["layers"]
    per_layer = isinstance(layers, (tuple, list))
    dtype = (layers[0] if per_layer else layers)["down_proj"].dtype
    axes = attn.activation_axes
    pin = (lambda x: constrain(x, axes)) if axes else (lambda x: x)
    x = pin(jnp.take(target_params["embed"], tokens, axis=0).astype(dtype))
    cos, sin = rope_cos_sin(positions, rope_inv_freq(cfg.head_dim, cfg.rope))
    slot_of_layer = np.full((cfg.num_layers,), -1, np.int32)
    for s, i in enumerate(feature_layers):
        slot_of_layer[i] = s
    m = len(feature_layers)
    cache = cache_read(attn)
    # the cache's pools ride in the carry: each layer writes its slice in place (or only reads);
    # as scan xs -> ys they would be copied whole every forward, and closed over, XLA hoisted
    # their dtype conversion out of the layer loop (a converted copy of the whole cache)
    kv = None if cache is None else (cache.k, cache.v)

    raw = takes_raw_queries(attn)  # the attention kernel applies q's norm and RoPE (target/query_prep.py)

    def layer(p, x, kv, li):
        """One decoder layer over weights `p` -> (x, kv after its cache writes, its outputs)."""
        q, k, v = project_qkv(p, x, cos, sin, cfg, raw_queries=raw)
        prep = QueryPrep(p["q_norm"] if cfg.qk_norm else None, cos, sin, cfg.rms_norm_eps) if raw else None
        out, kv, ys = layer_attention(attn, q, k, v, kv, li, dtype, q_prep=prep)
        return pin(finish_layer(p, x, out, cfg)), kv, ys

    if per_layer:  # unrolled: each product reads its own weight array (no slice of a stack)
        if len(layers) != cfg.num_layers:
            raise ValueError(f"{len(layers)} per-layer weight dicts for a target of {cfg.num_layers} layers")
        feats, outs = [None] * m, []
        for li, p in enumerate(layers):
            x, kv, ys = layer(p, x, kv, li)
            if slot_of_layer[li] >= 0:
                feats[slot_of_layer[li]] = x
            outs.append(ys)
        feats = jnp.stack(feats) if m else None
        layer_out = None if outs[0] is None else jax.tree.map(lambda *a: jnp.stack(a), *outs)
    else:
        def body(carry, xs):
            x, feats, kv = carry
            p, slot, li = xs
            x, kv, ys = layer(p, x, kv, li)
            if m:
                idx = jnp.maximum(slot, 0)
                feats = feats.at[idx].set(jnp.where(slot >= 0, x, feats[idx]))
            return (x, feats, kv), ys

        feats0 = jnp.zeros((m, b, t, cfg.hidden_size), dtype) if m else None
        xs = (layers, jnp.asarray(slot_of_layer), jnp.arange(cfg.num_layers, dtype=jnp.int32))
        (x, feats, kv), layer_out = jax.lax.scan(body, (x, feats0, kv), xs)
    hidden = rms_norm(x, target_params["final_norm"], cfg.rms_norm_eps)
    features = jnp.moveaxis(feats, 0, 2) if m else None
    logits = lm_head_logits(hidden, target_params["lm_head"]) if return_logits else None
    return ForwardOut(logits, hidden, features, cache_written(attn, kv), layer_out)

