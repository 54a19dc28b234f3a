"""The drafter's parallel backbone as pure functions over a params dict (docs/method.md §2.1).

`params` is `Drafter.arrays(dtype)`: {"embed" [V,H], "fc" [m*H,H], "hidden_norm" [H],
"layers" {name: [L,...]} (DecoderStack names), "final_norm" [H], ...}; `cfg` is the
drafter's layer ModelConfig (the target's width, Qwen3 layer math, drafter depth).

Context injection follows the DeepSpec reference: `ctx = RMSNorm(fc([f_l1;...;f_lm]))`
is computed once; every drafter layer projects ctx with its *own* k_proj / v_proj, then
k_norm and RoPE at the context positions. ctx does **not** go through the layer's
input_layernorm (the reference applies it to the block tokens only). Context keys sit in
front of the block's keys; queries come from block tokens only.

Attention is computed per block as one softmax over [context keys; the block's own G
keys]: blocks never see each other, so the (A*G)^2 block-to-block score matrix of a
dense mask is never built. `training_mask` gives the equivalent dense mask for tests.
A block whose row sees nothing (a dummy anchor) gets a uniform softmax: finite output.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dspark_jax.parallel.sharding import constrain
from dspark_jax.target.attention_backend import attention_backend
from dspark_jax.target.config import ModelConfig
from dspark_jax.target.kernels import row_tile
from dspark_jax.target.layers import (
    MASK_VALUE,
    apply_rope,
    finish_layer,
    project_qkv,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
)
from dspark_jax.target.own_keys import OwnKeys

__all__ = [
    "fuse_context", "context_kv", "block_embed", "context_mask", "training_mask", "block_attention",
    "backbone_train", "update_context", "draft_hidden",
]


def fuse_context(params: dict, features, cfg: ModelConfig):
    """features [..., m, H] (raw target layer outputs, in layer-id order) -> ctx [..., H].

    Feature block i multiplies rows i*H:(i+1)*H of `fc` (columns of torch's fc.weight).
    """
    fc = params["fc"]
    flat = features.reshape(*features.shape[:-2], features.shape[-2] * features.shape[-1]).astype(fc.dtype)
    return rms_norm(flat @ fc, params["hidden_norm"], cfg.rms_norm_eps)


def context_kv(p: dict, ctx, cos, sin, cfg: ModelConfig):
    """One layer's context keys/values: own k_proj/v_proj, k_norm, RoPE. ctx [B,T,H] -> [B,T,Nkv,D] x2."""
    b, t, _ = ctx.shape
    k = (ctx @ p["k_proj"]).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = (ctx @ p["v_proj"]).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    return apply_rope(k, cos, sin), v


def block_embed(embed, anchor_tok, mask_id: int, gamma: int, dtype=None):
    """Block inputs `[x_p, MASK, ..., MASK]`: anchor_tok [...] -> [..., gamma, H]."""
    slots = jnp.arange(gamma)
    ids = jnp.where(slots == 0, anchor_tok[..., None], jnp.int32(mask_id))
    x = jnp.take(embed, ids, axis=0)
    return x if dtype is None else x.astype(dtype)


def context_mask(anchors, keep, num_ctx: int, window: int | None = None):
    """[..., A] anchors -> [..., A, num_ctx] bool: context position s visible to the block at p
    iff s < p (and s >= p - window with a sliding window) and the block is kept."""
    s = jnp.arange(num_ctx, dtype=jnp.int32)
    anchor = anchors[..., None].astype(jnp.int32)
    m = s < anchor
    if window is not None:
        m = m & (s >= anchor - window)
    return m & keep[..., None]


def training_mask(anchors, keep, S: int, G: int, window: int | None = None):
    """Dense equivalent of the training attention pattern, for tests and inspection.

    Query i = block i // G, slot i % G; keys = S context positions, then the A*G block
    tokens in the same order. Returns [B, A*G, S + A*G] bool (True = may attend).
    """
    b, a = anchors.shape
    ctx = jnp.repeat(context_mask(anchors, keep, S, window), G, axis=1)  # [B, A*G, S]
    blk = jnp.arange(a * G) // G
    same = blk[:, None] == blk[None, :]
    own = same[None] & jnp.repeat(keep, G, axis=1)[:, :, None]  # [B, A*G, A*G]
    return jnp.concatenate([ctx, own], axis=-1)


def block_attention(q, ck, cv, bk, bv, ctx_mask, block_valid):
    """Per-block attention over [context keys; the block's own keys] with one softmax.

    q [B,A,G,Nq,D]; ck, cv [B,S,Nkv,D] shared by all blocks of a row; bk, bv [B,A,G,Nkv,D];
    ctx_mask [B,A,S]; block_valid [B,A] (whether the block sees itself). Scores and the
    softmax in float32; fully masked rows give a uniform (finite) distribution.
    Returns [B,A,G,Nq,D].
    """
    b, a, g, nq, d = q.shape
    nkv = ck.shape[2]
    qg = q.reshape(b, a, g, nkv, nq // nkv, d)
    scale = 1.0 / math.sqrt(d)
    # Each einsum's output keeps its dot's natural order (batch dims, lhs free, rhs free), so no
    # score-sized transposes: context scores [b, kv, a, g, r, S], block scores [b, a, kv, g, r, G].
    sc = jnp.einsum("bagkrd,bskd->bkagrs", qg, ck, preferred_element_type=jnp.float32) * scale
    sb = jnp.einsum("bagkrd,bajkd->bakgrj", qg, bk, preferred_element_type=jnp.float32) * scale
    sc = jnp.where(ctx_mask[:, None, :, None, None, :], sc, MASK_VALUE)
    sb = jnp.where(block_valid[:, :, None, None, None, None], sb, MASK_VALUE)
    to_block = lambda x: jnp.swapaxes(x, 1, 2)  # [b, kv, a, ...] <-> [b, a, kv, ...] on row statistics
    m = jax.lax.stop_gradient(jnp.maximum(sc.max(-1), to_block(sb.max(-1))))  # [b, kv, a, g, r]
    ec, eb = jnp.exp(sc - m[..., None]), jnp.exp(sb - to_block(m)[..., None])
    den = ec.sum(-1) + to_block(eb.sum(-1))
    oc = jnp.einsum("bkagrs,bskd->bkagrd", ec.astype(cv.dtype), cv, preferred_element_type=jnp.float32)
    ob = jnp.einsum("bakgrj,bajkd->bakgrd", eb.astype(bv.dtype), bv, preferred_element_type=jnp.float32)
    out = (oc + to_block(ob)) / den[..., None]  # normalised after the value matmuls: one pass less over the scores
    out = out.astype(cv.dtype).transpose(0, 2, 3, 1, 4, 5)  # [b, a, g, kv, r, d]
    return out.reshape(b, a, g, nq, d)


def _inv_freq(cfg: ModelConfig):
    return rope_inv_freq(cfg.head_dim, cfg.rope)


def backbone_train(params: dict, cfg: ModelConfig, tokens, ctx, anchors, keep, *, gamma: int, mask_id: int,
                   window: int | None = None, remat: bool = False):
    """Training forward of all anchor blocks at once.

    tokens [B,S]; ctx [B,S,H] (fused, `fuse_context`); anchors [B,A] (any order, may
    overlap); keep [B,A] (False = dummy block, sees nothing, finite output).
    Block a holds `[x_p, MASK...]` at positions p..p+G-1 and sees context positions < p
    (within `window` if set) and itself. Returns h [B,A,G,H] after the final RMSNorm.
    `remat`: each layer is recomputed in the backward pass, so one layer's attention scores
    (heads x A*G x S) are alive at a time instead of every layer's.
    """
    b, s = tokens.shape
    a = anchors.shape[1]
    g = gamma
    dtype = params["fc"].dtype
    anchors = anchors.astype(jnp.int32)
    anchor_tok = jnp.take_along_axis(tokens, jnp.clip(anchors, 0, s - 1), axis=1)
    x = block_embed(params["embed"], anchor_tok, mask_id, g, dtype).reshape(b, a * g, -1)
    pos = (anchors[..., None] + jnp.arange(g, dtype=jnp.int32)).reshape(b, a * g)
    inv = _inv_freq(cfg)
    cos_b, sin_b = rope_cos_sin(pos, inv)
    cos_c, sin_c = rope_cos_sin(jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)), inv)
    cmask = context_mask(anchors, keep, s, window)
    ctx = ctx.astype(dtype)

    def body(x, p):
        q, k, v = project_qkv(p, x, cos_b, sin_b, cfg)
        ck, cv = context_kv(p, ctx, cos_c, sin_c, cfg)
        split = lambda t: t.reshape(b, a, g, *t.shape[2:])
        out = block_attention(split(q), ck, cv, split(k), split(v), cmask, keep)
        x = finish_layer(p, x, out.reshape(b, a * g, *out.shape[3:]), cfg)
        return constrain(x, ("batch", "seq", "act_embed")), None

    x, _ = jax.lax.scan(jax.checkpoint(body) if remat else body, x, params["layers"])
    h = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    return h.reshape(b, a, g, -1)


def _run_layers(body, x, layers):
    """`body(x, (layer weights, layer index)) -> (x, None)` over the drafter's layers: a `lax.scan`
    over stacked weights ({name: [L, ...]}), unrolled over per-layer ones (a tuple of dicts,
    drafter/decode_weights.py: each product reads its weight in place, no slice of a stack)."""
    if isinstance(layers, (tuple, list)):
        for li, p in enumerate(layers):
            x, _ = body(x, (p, jnp.int32(li)))
        return x
    n = jax.tree.leaves(layers)[0].shape[0]
    x, _ = jax.lax.scan(body, x, (layers, jnp.arange(n, dtype=jnp.int32)))
    return x


def _padded_columns(r: int, t: int) -> int:
    """Columns that give at least the platform's row tile of token rows (`target.kernels.row_tile`):
    on a TPU a product of fewer than 8 rows runs on the vector unit, dearer than 8 rows."""
    tile = row_tile()
    return max(t, -(-tile // r)) if r * t < tile else t


def update_context(params: dict, cfg: ModelConfig, cache, features, positions, valid, rows=None):
    """Write the context K/V of new target features into the drafter cache (a dense `KVCache`
    or a `PagedKVCache`: only their shared interface is used).

    features [R,T,m,H] (raw target layer outputs of committed tokens); positions [R,T]
    (the tokens' sequence positions); valid [R,T] (padding is not written). Only context
    K/V ever enter this cache (block K/V are never stored), so it needs no rollback: a
    block only reads positions < its anchor. `lengths` is set to one past the last
    position written in this call for rows with any valid token (others unchanged);
    `draft_hidden` does not read it. `rows` [K]: the inputs' rows are those slots (a prefill
    chunk; rows >= R are dropped). Fewer than the row tile of tokens are padded to it
    (invalid, not written).
    """
    r, t = positions.shape
    tp = _padded_columns(r, t)
    if tp > t:
        pad = lambda a: jnp.pad(a, [(0, 0), (0, tp - t)] + [(0, 0)] * (a.ndim - 2))
        features, positions, valid = pad(features), pad(positions), pad(valid)
    ctx = fuse_context(params, features, cfg)
    cos, sin = rope_cos_sin(positions, _inv_freq(cfg))
    write = jnp.where(valid, positions, cache.max_len)  # out of range: dropped
    slots = jnp.arange(r, dtype=jnp.int32) if rows is None else jnp.asarray(rows, jnp.int32)
    rows = slots[:, None]

    def body(kv, layer):
        p, li = layer
        k, v = context_kv(p, ctx, cos, sin, cfg)
        return cache.write_layer_at(*kv, li, rows, write, k, v), None  # in place: the cache is carried

    k, v = _run_layers(body, (cache.k, cache.v), params["layers"])
    end = jnp.max(jnp.where(valid, positions + 1, 0), axis=1).astype(jnp.int32)
    n = cache.lengths.shape[0]
    lengths = cache.lengths.at[jnp.where(valid.any(axis=1), slots, n)].set(end, mode="drop")
    return cache._replace(k=k, v=v, lengths=lengths)


def draft_hidden(params: dict, cfg: ModelConfig, cache, anchor_tok, anchor_pos, *, gamma: int,
                 mask_id: int, window: int | None = None):
    """Inference forward of one block per row: anchor_tok, anchor_pos [R] -> h [R,G,H].

    The block sees cache positions < anchor_pos (and >= anchor_pos - window) and itself;
    positions below the anchor must have been written by `update_context`. Where the kernel reads
    the cache and R x G is under the row tile, the block runs padded with mask slots past G that no
    slot sees (its own keys counted to G) and are dropped.
    """
    r = anchor_tok.shape[0]
    dtype = params["fc"].dtype
    anchor_pos = anchor_pos.astype(jnp.int32)
    # a cache the attention backend reads by the Pallas kernel: context keys < anchor in place, the
    # block's own keys in the same softmax (`OwnKeys`; no sliding window there: the kernel has no
    # lower bound)
    kernel = window is None and attention_backend(cache.impl).kernel
    width = _padded_columns(r, gamma) if kernel else gamma
    x = block_embed(params["embed"], anchor_tok, mask_id, width, dtype)
    pos = anchor_pos[:, None] + jnp.arange(width, dtype=jnp.int32)
    cos, sin = rope_cos_sin(pos, _inv_freq(cfg))
    keep = jnp.ones((r, 1), bool)
    cmask = context_mask(anchor_pos[:, None], keep, cache.max_len, window)
    whole_block = jnp.full((r,), gamma, jnp.int32)  # own keys each query sees: all of its block

    def body(x, layer):
        p, li = layer
        q, k, v = project_qkv(p, x, cos, sin, cfg)
        if kernel:
            out = cache.attend_committed(q, cache.k, cache.v, li, anchor_pos, OwnKeys(k, v, whole_block, causal=False),
                                         dtype)
            return finish_layer(p, x, out, cfg), None
        ck, cv = cache.layer_view(cache.k, cache.v, li, dtype)  # a paged cache gathers the row's pages
        out = block_attention(q[:, None], ck, cv, k[:, None], v[:, None], cmask, keep)
        return finish_layer(p, x, out[:, 0], cfg), None

    x = _run_layers(body, x, params["layers"])
    return rms_norm(x[:, :gamma], params["final_norm"], cfg.rms_norm_eps)
