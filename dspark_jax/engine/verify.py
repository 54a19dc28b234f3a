"""Target verification on a packed token batch with a per-request padded attention view (spec 3.1).

The dense work (q/k/v/o projections, MLP, LM head) runs on `bucket` packed tokens: the
valid tokens of the padded `[R, T]` block (`T = gamma + 1`, each row's anchor and its
first `l_r` drafts), each with its slot and position, padded with masked tokens up to the
compiled bucket size. Attention scatters the packed queries into the `[R, T]` view and
attends each row against its own KV cache (keys <= the query's position, so each row sees
exactly its prefix of `1 + l_r` new tokens). Compute then scales with the bucket, not with
`R * T`, while every shape stays static.

The forward reads the cache and never writes it (`verify_forward`): each row attends to its
committed keys (positions < start) from the cache and to its own new tokens' keys from the
block, and the block's K/V come back as `[L, R, T, Nkv, D]`. The round writes them after its
`lax.switch` over buckets (`write_block`): a cache written inside the switch's branches was
copied whole by XLA, several times per round (tests/engine/test_in_place.py).

With a `Chunk` (chunked prefill, `Engine(prefill_chunk=...)`), prompt tokens of joining slots
are packed after the block's tokens into the same bucket: the dense work is shared, and they
attend in their own `[K, C]` view to their slot's committed keys.

`pack` / `unpack` are the two index maps; `verify_packed` is the forward plus the write.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.target.config import ModelConfig
from dspark_jax.target.kv_cache import KVCache
from dspark_jax.target.paged_kv import PagedKVCache
from dspark_jax.target.layers import lm_head_logits, rms_norm, rope_cos_sin, rope_inv_freq
from dspark_jax.target.transformer import finish_layer, project_qkv

__all__ = ["Packing", "Chunk", "pack", "verify_forward", "write_block", "verify_packed", "target_arrays"]


def target_arrays(model, dtype=None) -> dict:
    """The target's weights as a dict of arrays for the pure forwards (lm_head [H,V] even when tied)."""
    dt = dtype or (model.dtype or model.embed[...].dtype)
    return {"embed": model.embed[...], "layers": model.layers.arrays(dt), "final_norm": model.final_norm[...],
            "lm_head": model.lm_head_weight()}


class Packing(NamedTuple):
    dest: jax.Array  # [R*T] packed index of each padded token (bucket = not packed)
    slot: jax.Array  # [bucket] row of each packed token (R = padding)
    col: jax.Array  # [bucket] column in the padded view
    pos: jax.Array  # [bucket] sequence position (S = padding: cache writes dropped)
    tok: jax.Array  # [bucket] token id
    n: jax.Array  # scalar: number of valid packed tokens


def pack(tokens, start, valid, bucket: int, max_len: int, offset=0) -> Packing:
    """tokens/valid [R, T], start [R] (position of column 0) -> a packing of the valid tokens
    into `bucket` slots, row-major, from packed index `offset` on (a second lane packs after
    the first). Valid tokens beyond the bucket are dropped (callers size the bucket so that
    never happens). Entries of the bucket this lane does not fill have slot R."""
    r, t = tokens.shape
    fv = valid.reshape(-1)
    idx = jnp.cumsum(fv.astype(jnp.int32)) - 1 + offset
    dest = jnp.where(fv, idx, bucket)
    slot = jnp.full((bucket,), r, jnp.int32).at[dest].set(jnp.repeat(jnp.arange(r, dtype=jnp.int32), t), mode="drop")
    col = jnp.zeros((bucket,), jnp.int32).at[dest].set(jnp.tile(jnp.arange(t, dtype=jnp.int32), r), mode="drop")
    tok = jnp.zeros((bucket,), jnp.int32).at[dest].set(tokens.reshape(-1).astype(jnp.int32), mode="drop")
    live = slot < r
    pos = jnp.where(live, start[jnp.minimum(slot, r - 1)] + col, max_len)
    return Packing(dest, slot, col, pos.astype(jnp.int32), tok, jnp.sum(fv.astype(jnp.int32)))


class Chunk(NamedTuple):
    """Prompt tokens packed into a round beside the verification block (chunked prefill): row k
    forwards tokens[k, :n_k] of slot rows[k] (R: no slot) at positions start[k] + column; valid
    [K, C] is each row's prefix of n_k. The slot's cache is read as for its verification."""

    tokens: jax.Array  # [K, C] int32
    start: jax.Array  # [K] int32
    valid: jax.Array  # [K, C] bool
    rows: jax.Array  # [K] int32 slot of each row (R = unused row)


def unpack(packed, pk: Packing, r: int, t: int):
    """[bucket, ...] -> [R, T, ...] (tokens that were not packed get an arbitrary finite row)."""
    b = packed.shape[0]
    return packed[jnp.clip(pk.dest, 0, b - 1)].reshape(r, t, *packed.shape[1:])


class VerifyOut(NamedTuple):
    logits: jax.Array  # [R, T, V] float32 ([bucket, V], packed, with `packed_logits`)
    hidden: jax.Array  # [R, T, H] final normed hidden
    features: jax.Array  # [R, T, m, H] raw outputs of the feature layers (m >= 1; zeros if none asked)
    cache: KVCache | PagedKVCache | None  # verify_packed: K/V written at the valid tokens' positions; lengths unchanged
    k_new: jax.Array | None = None  # verify_forward: the block's K / V [L, R, T, Nkv, D] (cache dtype), not written
    v_new: jax.Array | None = None
    packing: Packing | None = None  # with `packed_logits`: which packed row holds each [R, T] token
    chunk_hidden: jax.Array | None = None  # with a `chunk`: its rows' final hidden [K, C, H] ...
    chunk_features: jax.Array | None = None  # ... feature-layer outputs [K, C, m, H] ...
    chunk_k: jax.Array | None = None  # ... and K / V [L, K, C, Nkv, D], for `write_block(..., rows=)`
    chunk_v: jax.Array | None = None


def verify_forward(tp: dict, cfg: ModelConfig, cache: KVCache | PagedKVCache, tokens, start, valid, *, bucket: int,
                   feature_layers: tuple[int, ...] = (), packed_logits: bool = False, chunk: Chunk | None = None,
                   logit_rows: int | None = None) -> VerifyOut:
    """Forward the valid tokens of `tokens` [R, T] (positions start[r] + column) through the target.

    Dense work on `bucket` packed tokens; attention on the padded [R, T] view: a row's queries
    attend to its cache keys before `start` (read, never written) and to the valid block keys at
    or before their own column. Returns the block's K / V for `write_block`; `cache` is None.
    `packed_logits`: logits stay packed ([bucket, V], with the packing), so whatever works on
    the vocabulary afterwards (sampling, rejection) can scale with the bucket, not R * T.
    `chunk`: prompt tokens of prefilling slots packed after the block's (the same dense work,
    their own [K, C] attention view; attention skipped when the chunk is empty); their hidden,
    features and K / V come back in the `chunk_*` fields. `logit_rows`: logits only for the
    first packed rows (the block's tokens come first, so R * T covers them: a chunk's tokens
    need no logits).
    """
    r, t = tokens.shape
    s = cache.max_len
    pk = pack(tokens, start, valid, bucket, s)
    pc = None if chunk is None else pack(chunk.tokens, chunk.start, chunk.valid, bucket, s, offset=pk.n)
    in_block = pk.slot < r
    tok = pk.tok if pc is None else jnp.where(in_block, pk.tok, pc.tok)
    pos = pk.pos if pc is None else jnp.where(in_block, pk.pos, pc.pos)
    dtype = tp["layers"]["q_proj"].dtype
    kv_dtype = cache.k.dtype
    x = jnp.take(tp["embed"], tok, axis=0).astype(dtype)[None]  # [1, Bk, H]
    cos, sin = rope_cos_sin(jnp.minimum(pos, s - 1)[None], rope_inv_freq(cfg.head_dim, cfg.rope))
    slot_of_layer = np.full((cfg.num_layers,), -1, np.int32)
    for i, l in enumerate(feature_layers):
        slot_of_layer[l] = i
    m = max(len(feature_layers), 1)
    feats0 = jnp.zeros((m, bucket, cfg.hidden_size), dtype)

    def view_attention(q, k, v, lp: Packing, n_rows, width, view_start, view_valid, rows, ck, cv, li):
        """One view's attention: the packed q / k / v of its tokens scattered into [n_rows, width],
        each row against its slot's committed keys and its own earlier tokens -> (out [Bk, Nq, D]
        at the packed tokens, the view's K / V as the cache would hold them)."""
        blank = jnp.zeros((n_rows, width, cfg.num_kv_heads, cfg.head_dim), kv_dtype)
        kb = blank.at[lp.slot, lp.col].set(k[0].astype(kv_dtype), mode="drop")
        vb = blank.at[lp.slot, lp.col].set(v[0].astype(kv_dtype), mode="drop")
        qv = jnp.zeros((n_rows, width, *q.shape[2:]), q.dtype).at[lp.slot, lp.col].set(q[0], mode="drop")
        col = jnp.arange(width, dtype=jnp.int32)
        causal = (col[None, :] <= col[:, None])[None] & view_valid[:, None, :]
        # committed keys (< start) read from the cache in place, the view's own keys beside them
        o = cache.attend_committed(qv, ck, cv, li, view_start, [(kb.astype(dtype), vb.astype(dtype), causal)], dtype,
                                   rows=rows)
        return o[jnp.minimum(lp.slot, n_rows - 1), lp.col], kb, vb

    def body(carry, layer):
        # the cache rides in the carry, read only: closed over, XLA hoisted its dtype conversion
        # out of the layer loop (a converted copy of the whole cache)
        x, feats, (ck, cv) = carry
        p, fslot, li = layer
        q, k, v = project_qkv(p, x, cos, sin, cfg)
        o, kb, vb = view_attention(q, k, v, pk, r, t, start, valid, None, ck, cv, li)
        ys = (kb, vb)
        if chunk is not None:
            kc, cw = chunk.tokens.shape

            def chunk_attention(ck, cv):
                return view_attention(q, k, v, pc, kc, cw, chunk.start, chunk.valid, chunk.rows, ck, cv, li)

            def no_chunk(ck, cv):
                shapes = jax.eval_shape(chunk_attention, ck, cv)
                return tuple(jnp.zeros(a.shape, a.dtype) for a in shapes)

            oc, kcb, vcb = jax.lax.cond(pc.n > 0, chunk_attention, no_chunk, ck, cv)
            o = jnp.where(in_block[:, None, None], o, oc)
            ys = (kb, vb, kcb, vcb)
        x = finish_layer(p, x, o[None], cfg)
        if feature_layers:
            i = jnp.maximum(fslot, 0)
            feats = feats.at[i].set(jnp.where(fslot >= 0, x[0], feats[i]))
        return (x, feats, (ck, cv)), ys

    layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    (x, feats, _), ys = jax.lax.scan(body, (x, feats0, (cache.k, cache.v)),
                                     (tp["layers"], jnp.asarray(slot_of_layer), layer_ids))
    h = rms_norm(x[0], tp["final_norm"], cfg.rms_norm_eps)
    logits = lm_head_logits(h if logit_rows is None else h[: min(int(logit_rows), bucket)], tp["lm_head"])
    features = jnp.moveaxis(feats, 0, 1)  # [Bk, m, H]
    out = VerifyOut(logits if packed_logits else unpack(logits, pk, r, t), unpack(h, pk, r, t),
                    unpack(features, pk, r, t), None, ys[0], ys[1], pk if packed_logits else None)
    if chunk is not None:
        kc, cw = chunk.tokens.shape
        out = out._replace(chunk_hidden=unpack(h, pc, kc, cw), chunk_features=unpack(features, pc, kc, cw),
                           chunk_k=ys[2], chunk_v=ys[3])
    return out


def write_block(cache: KVCache | PagedKVCache, k_new, v_new, start, valid, rows=None) -> KVCache | PagedKVCache:
    """Write a verification's block K / V [L, R, T, Nkv, D] at positions start[r] + column of the
    valid tokens (all layers at once, in place on a donated cache); lengths unchanged. `rows`
    [K]: the block's rows are those slots (a prefill chunk; rows >= R are dropped)."""
    r, t = valid.shape
    pos = jnp.where(valid, start[:, None] + jnp.arange(t, dtype=jnp.int32)[None], cache.max_len)  # invalid: dropped
    rows = jnp.arange(r)[:, None] if rows is None else jnp.asarray(rows, jnp.int32)[:, None]

    def one_layer(li, kv):  # layer by layer in a loop carry: updated in place (one scatter over all
        return cache.write_layer_at(kv[0], kv[1], li, rows, pos, k_new[li], v_new[li])  # layers copied on a mesh)

    k, v = jax.lax.fori_loop(0, k_new.shape[0], one_layer, (cache.k, cache.v))
    return cache._replace(k=k, v=v)


def verify_packed(tp: dict, cfg: ModelConfig, cache: KVCache | PagedKVCache, tokens, start, valid, *, bucket: int,
                  feature_layers: tuple[int, ...] = ()) -> VerifyOut:
    """`verify_forward` and `write_block` in one call (benchmarks, tests); the engine's round
    writes after its bucket switch instead."""
    vo = verify_forward(tp, cfg, cache, tokens, start, valid, bucket=bucket, feature_layers=feature_layers)
    return vo._replace(cache=write_block(cache, vo.k_new, vo.v_new, start, valid))
