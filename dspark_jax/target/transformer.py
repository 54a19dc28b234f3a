"""Qwen3 / Llama-3 dense decoder in Flax NNX with layers stacked and run under `lax.scan`.

Parameters of all decoder layers are stacked on a leading `layers` axis, so compile time
does not grow with depth. The forward also returns the raw outputs (residual stream,
before the final norm) of selected layers: layer id i = output of decoder layer i =
Hugging Face `hidden_states[i + 1]`. These are the drafter's context features.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.parallel.sharding import constrain
from dspark_jax.target.config import ModelConfig
from dspark_jax.target.kv_cache import KVCache
from dspark_jax.target.paged_kv import PagedKVCache
from dspark_jax.target.layers import apply_rope, attention, causal_attention, lm_head_logits, rms_norm, rope_cos_sin, rope_inv_freq, swiglu
from dspark_jax.target.splash import splash_causal_attention, use_splash

INIT_STD = 0.02
ATTENTION_BLOCK = 128  # query block of the causal self-attention without a cache


def layer_param_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Name -> (per-layer shape, logical axes) of one decoder layer. The single source of truth."""
    h, q, kv, i, d = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size, cfg.head_dim
    shapes = {
        "input_norm": ((h,), ("norm",)),
        "q_proj": ((h, q), ("embed", "heads")),
        "k_proj": ((h, kv), ("embed", "kv_heads")),
        "v_proj": ((h, kv), ("embed", "kv_heads")),
        "o_proj": ((q, h), ("heads", "embed")),
        "post_norm": ((h,), ("norm",)),
        "gate_proj": ((h, i), ("embed", "mlp")),
        "up_proj": ((h, i), ("embed", "mlp")),
        "down_proj": ((i, h), ("mlp", "embed")),
    }
    if cfg.qk_norm:
        shapes["q_norm"] = ((d,), ("head_dim",))
        shapes["k_norm"] = ((d,), ("head_dim",))
    return shapes


def _init(rngs: nnx.Rngs, name: str, shape, dtype):
    if name.endswith("norm"):
        return jnp.ones(shape, dtype)
    return (INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class DecoderStack(nnx.Module):
    """All decoder layers' weights, each stacked on a leading `layers` axis."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, num_layers: int | None = None, param_dtype=jnp.float32):
        self.num_layers = num_layers or cfg.num_layers
        self.names = tuple(layer_param_shapes(cfg))
        for name, (shape, axes) in layer_param_shapes(cfg).items():
            value = _init(rngs, name, (self.num_layers, *shape), param_dtype)
            setattr(self, name, nnx.Param(value, out_sharding=("layers", *axes)))

    def arrays(self, dtype=None) -> dict:
        out = {n: getattr(self, n)[...] for n in self.names}
        return out if dtype is None else jax.tree.map(lambda a: a.astype(dtype), out)


def project_qkv(p: dict, x, cos, sin, cfg: ModelConfig):
    """Pre-norm, q/k/v projections, Qwen3 q/k RMSNorm, RoPE. x [B,T,H] -> q [B,T,Nq,D], k/v [B,T,Nkv,D]."""
    b, t, _ = x.shape
    h = rms_norm(x, p["input_norm"], cfg.rms_norm_eps)
    q = (h @ p["q_proj"]).reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = (h @ p["k_proj"]).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = (h @ p["v_proj"]).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def finish_layer(p: dict, x, attn_out, cfg: ModelConfig):
    """Attention output projection + residual, then the SwiGLU MLP block + residual."""
    b, t = x.shape[:2]
    x = x + attn_out.reshape(b, t, -1) @ p["o_proj"]
    h = rms_norm(x, p["post_norm"], cfg.rms_norm_eps)
    return x + swiglu(h, p["gate_proj"], p["up_proj"], p["down_proj"])


class ForwardOut(NamedTuple):
    logits: jnp.ndarray | None  # [R, T, V] (float32) or None when not requested
    hidden: jnp.ndarray  # [R, T, H] after the final norm
    features: jnp.ndarray | None  # [R, T, m, H] raw outputs of the selected layers
    cache: KVCache | PagedKVCache | None  # K/V written for valid tokens; lengths unchanged


class TargetModel(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32, dtype=None):
        self.cfg = cfg
        self.dtype = dtype  # compute dtype; None = the parameters' dtype
        # cache-free causal attention: "auto" = splash kernel on TPU where it fits, else dense
        self.attention = "auto"
        self.embed = nnx.Param(_init(rngs, "embed", (cfg.vocab_size, cfg.hidden_size), param_dtype), out_sharding=("vocab", "embed"))
        self.layers = DecoderStack(cfg, rngs=rngs, param_dtype=param_dtype)
        self.final_norm = nnx.Param(jnp.ones((cfg.hidden_size,), param_dtype), out_sharding=("norm",))
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Param(_init(rngs, "lm_head", (cfg.hidden_size, cfg.vocab_size), param_dtype), out_sharding=("embed", "vocab"))
        else:
            self.lm_head = None

    def _dtype(self):
        return self.dtype or self.embed[...].dtype

    def embed_tokens(self, tokens):
        return jnp.take(self.embed[...], tokens, axis=0).astype(self._dtype())

    def lm_head_weight(self):
        """[H, V] kernel (the transposed embedding when tied)."""
        return self.embed[...].T if self.lm_head is None else self.lm_head[...]

    def logits(self, hidden):
        return lm_head_logits(hidden, self.lm_head_weight())

    def __call__(self, tokens, positions=None, valid=None, cache: KVCache | PagedKVCache | None = None,
                 feature_layers: tuple[int, ...] = (), return_logits: bool = True) -> ForwardOut:
        """Forward a chunk of new tokens [R, T] at `positions` (default 0..T-1).

        `valid` [R, T] marks real tokens; the valid tokens of a row must sit at consecutive
        positions starting at the row's cache length. Without a cache the chunk attends
        causally to itself (training / full forward); with one (dense or paged), to the cache.
        """
        cfg = self.cfg
        r, t = tokens.shape
        causal_chunk = positions is None and cache is None  # tokens at 0..T-1 attending to themselves
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (r, t))
        if valid is None:
            valid = jnp.ones((r, t), bool)
        for i in feature_layers:
            if not 0 <= i < cfg.num_layers:
                raise ValueError(f"feature layer id {i} outside the target's {cfg.num_layers} layers")
        dtype = self._dtype()
        x = constrain(self.embed_tokens(tokens), ("batch", "seq", "act_embed"))
        cos, sin = rope_cos_sin(positions, rope_inv_freq(cfg.head_dim, cfg.rope))
        params = self.layers.arrays(dtype)
        slot_of_layer = np.full((cfg.num_layers,), -1, np.int32)
        for s, i in enumerate(feature_layers):
            slot_of_layer[i] = s
        m = len(feature_layers)
        feats0 = jnp.zeros((max(m, 1), r, t, cfg.hidden_size), dtype)

        splash = causal_chunk and use_splash(self.attention, t, cfg.head_dim)
        if cache is None:
            # explicit positions: a dense mask; default ones: block-skipping causal attention, no mask
            mask = None if causal_chunk else (positions[:, None, :] <= positions[:, :, None]) & valid[:, None, :]
            xs = (params, jnp.asarray(slot_of_layer))
        else:
            key_idx = jnp.arange(cache.max_len, dtype=jnp.int32)
            mask = key_idx[None, None, :] <= positions[:, :, None]
            write_pos = jnp.where(valid, positions, cache.max_len)  # out of range: dropped
            rows = jnp.arange(r)[:, None]
            xs = (params, jnp.asarray(slot_of_layer), jnp.arange(cfg.num_layers, dtype=jnp.int32))

        def body(carry, layer):
            # the whole cache rides in the carry and each layer writes its slice in place; as
            # scan xs -> ys it would be copied whole every forward
            x, feats, kv = carry
            if cache is None:
                p, slot = layer
            else:
                p, slot, li = layer
            q, k, v = project_qkv(p, x, cos, sin, cfg)
            if cache is None:
                if splash:
                    out = splash_causal_attention(q, k, v, valid)
                elif causal_chunk:
                    out = causal_attention(q, k, v, valid, ATTENTION_BLOCK)
                else:
                    out = attention(q, k, v, mask)
            else:
                kv = cache.write_layer_at(kv[0], kv[1], li, rows, write_pos, k, v)  # dense or paged
                out = cache.attend_layer(q, kv[0], kv[1], li, mask, dtype, positions=positions)
            x = constrain(finish_layer(p, x, out, cfg), ("batch", "seq", "act_embed"))
            if m:
                idx = jnp.maximum(slot, 0)
                feats = feats.at[idx].set(jnp.where(slot >= 0, x, feats[idx]))
            return (x, feats, kv), None

        kv0 = None if cache is None else (cache.k, cache.v)
        (x, feats, new_kv), _ = jax.lax.scan(body, (x, feats0, kv0), xs)
        hidden = rms_norm(x, self.final_norm[...], cfg.rms_norm_eps)
        new_cache = None if cache is None else cache._replace(k=new_kv[0], v=new_kv[1])
        features = jnp.moveaxis(feats, 0, 2) if m else None
        logits = self.logits(hidden) if return_logits else None
        return ForwardOut(logits, hidden, features, new_cache)
