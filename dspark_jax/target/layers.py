"""Pure building blocks shared by the target and the drafter: RMSNorm, RoPE, SwiGLU, attention,
and the two halves of a decoder layer around its attention."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.target.config import ModelConfig, RopeConfig
from dspark_jax.target.merged import gate_up, qkv, split_qkv

# A large finite negative, so a fully masked row gives a uniform (finite) softmax, not NaN.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def lm_head_logits(hidden, kernel):
    """hidden [..., H] @ the LM head kernel [H, V] -> float32 logits [..., V] (every LM head in the
    project, the target's and the drafters' frozen copy, goes through here)."""
    return jnp.einsum("...h,hv->...v", hidden, kernel.astype(hidden.dtype), preferred_element_type=jnp.float32)


def rms_norm(x, weight, eps: float):
    """RMSNorm in float32, cast back to the input dtype (as Hugging Face Qwen3/Llama do)."""
    dtype = x.dtype
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(dtype) * x32.astype(dtype)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> np.ndarray:
    """Inverse frequencies, including Llama-3 frequency-dependent scaling."""
    inv = 1.0 / (rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if rope.type == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def rope_cos_sin(positions, inv_freq):
    """positions [...] int -> cos, sin [..., head_dim] in float32 (halves repeated, HF layout)."""
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    ang = jnp.concatenate([ang, ang], axis=-1)
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x, cos, sin):
    """x [..., T, N, D]; cos/sin [..., T, D]. Rotate-half convention of Hugging Face."""
    dtype = x.dtype
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[..., None, :] + rot * sin[..., None, :]
    return out.astype(dtype)


def swiglu(x, gate, up, down):
    return (jax.nn.silu(x @ gate) * (x @ up)) @ down


def _qkv(p: dict, h, cfg: ModelConfig):
    """h [B,T,H] -> q [B,T,Nq,D], k, v [B,T,Nkv,D], from the three products or the merged one
    (target/merged.py)."""
    b, t, _ = h.shape
    d, nkv = cfg.head_dim, cfg.num_kv_heads
    if "qkv_proj" not in p:
        return ((h @ p["q_proj"]).reshape(b, t, cfg.num_heads, d), (h @ p["k_proj"]).reshape(b, t, nkv, d),
                (h @ p["v_proj"]).reshape(b, t, nkv, d))
    return split_qkv(qkv(h, p["qkv_proj"]), cfg)


def project_qkv(p: dict, x, cos, sin, cfg: ModelConfig, raw_queries: bool = False):
    """Pre-norm, q/k/v projections, Qwen3 q/k RMSNorm, RoPE. x [B,T,H] -> q [B,T,Nq,D], k/v [B,T,Nkv,D].
    `raw_queries`: q as projected, its norm and RoPE left to the attention (target/query_prep.py)."""
    h = rms_norm(x, p["input_norm"], cfg.rms_norm_eps)
    q, k, v = _qkv(p, h, cfg)
    if cfg.qk_norm:
        q = q if raw_queries else rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    return q if raw_queries else apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def finish_layer(p: dict, x, attn_out, cfg: ModelConfig):
    """Attention output projection + residual, then the SwiGLU MLP block + residual."""
    b, t = x.shape[:2]
    x = x + attn_out.reshape(b, t, -1) @ p["o_proj"]
    h = rms_norm(x, p["post_norm"], cfg.rms_norm_eps)
    if "gate_up_proj" in p:  # merged (target/merged.py)
        gate, up = gate_up(h, p["gate_up_proj"])
        return x + (jax.nn.silu(gate) * up) @ p["down_proj"]
    return x + swiglu(h, p["gate_proj"], p["up_proj"], p["down_proj"])


def attention(q, k, v, mask):
    """Grouped-query attention.

    q [B, T, Nq, D]; k, v [B, S, Nkv, D]; mask [B, T, S] bool (True = may attend).
    Scores and softmax in float32; fully masked rows stay finite. Laid out heads-first
    ([B, Nkv, G * T, S]: batch dims leading, keys last) so the score and value matmuls are
    plain batched matmuls and the mask and softmax run along the contiguous key axis; the
    kv-major layout this replaces spent about a third of a forward transposing scores.
    """
    b, t, nq, d = q.shape
    nkv = k.shape[2]
    g = nq // nkv
    qh = q.reshape(b, t, nkv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, nkv, g * t, d)
    scores = jnp.einsum("bkqd,bskd->bkqs", qh, k, preferred_element_type=jnp.float32)
    scores = scores.reshape(b, nkv, g, t, -1) * (1.0 / math.sqrt(d))
    scores = jnp.where(mask[:, None, None, :, :], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(b, nkv, g * t, -1)
    out = jnp.einsum("bkqs,bskd->bkqd", probs, v)
    return out.reshape(b, nkv, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, nq, d)


def attention_parts(q, parts):
    """`attention` over the union of several key sets, each (k [B, S_i, Nkv, D], v, mask [B, T, S_i]),
    with one softmax across them (a shared max, one normaliser) and no concatenation: a cache
    read in place beside a block of new keys, without copying the cache into a joint buffer."""
    b, t, nq, d = q.shape
    nkv = parts[0][0].shape[2]
    g = nq // nkv
    qh = q.reshape(b, t, nkv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, nkv, g * t, d)
    scores = []
    for k, _, mask in parts:
        s = jnp.einsum("bkqd,bskd->bkqs", qh, k, preferred_element_type=jnp.float32)
        s = s.reshape(b, nkv, g, t, -1) * (1.0 / math.sqrt(d))
        scores.append(jnp.where(mask[:, None, None, :, :], s, MASK_VALUE))
    top = functools.reduce(jnp.maximum, [jnp.max(s, axis=-1, keepdims=True) for s in scores])
    exps = [jnp.exp(s - top) for s in scores]
    denom = functools.reduce(jnp.add, [jnp.sum(e, axis=-1, keepdims=True) for e in exps])
    out = functools.reduce(jnp.add, [
        jnp.einsum("bkqs,bskd->bkqd", (e / denom).astype(v.dtype).reshape(b, nkv, g * t, -1), v)
        for e, (_, v, _) in zip(exps, parts)])
    return out.reshape(b, nkv, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, nq, d)


def causal_attention(q, k, v, key_valid, block: int = 128):
    """`attention` for a chunk attending causally to itself at positions 0..T-1 (no cache).

    Queries go in blocks of `block`; block i sees keys [0, end of block i) only, so the
    masked upper triangle is mostly never computed (work (n + 1) / 2n of the dense scores
    for n blocks). key_valid [B, T]: padding keys are masked as in `attention`.
    """
    t = q.shape[1]
    outs = []
    for start in range(0, t, block):
        end = min(start + block, t)
        causal = jnp.arange(end)[None, :] <= jnp.arange(start, end)[:, None]
        outs.append(attention(q[:, start:end], k[:, :end], v[:, :end], causal[None] & key_valid[:, None, :end]))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
