"""Target verification on a packed token batch with a per-request padded attention view (docs/method.md §3.1).

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

The forward is the target's one forward (`target.forward`) with `PackedVerify` attention
metadata; the packing's index maps are `target.packing.pack` / `unpack`. `verify_packed` is the
forward plus the write.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax.target.attention import PackedVerify, VerifyView, view_rows
from dspark_jax.target.config import ModelConfig
from dspark_jax.target.forward import forward
from dspark_jax.target.kernels import row_tile
from dspark_jax.target.kv_cache import KVCache
from dspark_jax.target.layers import lm_head_logits
from dspark_jax.target.packing import Packing, pack, pack_in_place, unpack
from dspark_jax.target.paged_kv import PagedKVCache

__all__ = ["Chunk", "verify_forward", "write_block", "verify_packed", "target_arrays"]


def target_arrays(model, dtype=None) -> dict:
    """The target's weights as a dict of arrays for the pure forwards (lm_head [H,V] even when tied)."""
    return model.arrays(dtype)


class Chunk(NamedTuple):
    """Prompt tokens packed into a round beside the verification block (chunked prefill): row k
    forwards tokens[k, :n_k] of slot rows[k] (R: no slot) at positions start[k] + column; valid
    [K, C] is each row's prefix of n_k. The slot's cache is read as for its verification."""

    tokens: jax.Array  # [K, C] int32
    start: jax.Array  # [K] int32
    valid: jax.Array  # [K, C] bool
    rows: jax.Array  # [K] int32 slot of each row (R = unused row)


# the largest multi-column view packed in place (tokens); one-column views always are. Since the
# kernel prepares the queries itself, in place is priced cheaper at every bucket up to 64 x 8 on
# v6e-8 (a 64-slot Qwen3-8B round 8.10 -> 6.91 ms), dearer at 128 x 8 on v7x-8 (9.58 -> 11.57 ms;
# docs/performance.md item 16)
IN_PLACE_MAX_TOKENS = 512


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


def verify_forward(target_params: dict, cfg: ModelConfig, cache: KVCache | PagedKVCache, tokens, start, valid, *,
                   bucket: int, feature_layers: tuple[int, ...] = (), packed_logits: bool = False,
                   chunk: Chunk | None = None, logit_rows: int | None = None) -> VerifyOut:
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
    # a view the bucket holds whole is packed in place (nothing to compact, no scatter) where it is
    # one column (the target-only step, a round verifying no drafts) or small: XLA:TPU priced a
    # drafting round's full bucket in place cheaper at 1, 8, 16 and 32 slots x 8 tokens, dearer at
    # 64 x 8 (v6e-8, docs/performance.md item 11)
    in_place = chunk is None and bucket >= r * t and (t == 1 or r * t <= IN_PLACE_MAX_TOKENS)
    pk = pack_in_place(tokens, start, valid, bucket, s) if in_place else pack(tokens, start, valid, bucket, s)
    pad = (view_rows(cache, r, t, bucket) if in_place else r) - r  # view rows past the slots: no token
    block = VerifyView(pk, jnp.pad(start, (0, pad)), jnp.pad(valid, ((0, pad), (0, 0))), in_place=in_place)
    chunk_view = None
    if chunk is not None:
        pc = pack(chunk.tokens, chunk.start, chunk.valid, bucket, s, offset=pk.n)
        chunk_view = VerifyView(pc, chunk.start, chunk.valid, chunk.rows)
        in_block = pk.slot < r
        tok, pos = jnp.where(in_block, pk.tok, pc.tok), jnp.where(in_block, pk.pos, pc.pos)
    else:
        tok, pos = pk.tok, pk.pos
    # padding tokens sit at position S (their writes dropped); RoPE reads a position inside the cache
    fo = forward(target_params, cfg, tok[None], jnp.minimum(pos, s - 1)[None], PackedVerify(cache, block, chunk_view),
                 feature_layers=feature_layers, return_logits=False)
    h = fo.hidden[0]
    # logits for the first rows only, no fewer than the platform's row tile (fewer cost more on a TPU)
    rows = bucket if logit_rows is None else min(max(int(logit_rows), row_tile()), bucket)
    logits = lm_head_logits(h[:rows], target_params["lm_head"])
    if fo.features is None:  # callers read [.., m, H] with m >= 1
        features = jnp.zeros((bucket, 1, cfg.hidden_size), h.dtype)
    else:
        features = fo.features[0]  # [bucket, m, H]
    ys = fo.layer_out
    out = VerifyOut(logits if packed_logits else unpack(logits, pk, r, t), unpack(h, pk, r, t),
                    unpack(features, pk, r, t), None, ys[0][:, :r], ys[1][:, :r], pk if packed_logits else None)
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

    # one scatter for all layers: a loop over layers recomputed the write's indices in every step
    # (a Qwen3-8B 8-slot step on v6e-8, predicted: 2.90 ms looped, 2.43 ms in one scatter)
    layers = jnp.arange(k_new.shape[0], dtype=jnp.int32)[:, None, None]
    k, v = cache.write_layer_at(cache.k, cache.v, layers, rows[None], pos[None], k_new, v_new)
    return cache._replace(k=k, v=v)


def verify_packed(target_params: dict, cfg: ModelConfig, cache: KVCache | PagedKVCache, tokens, start, valid, *,
                  bucket: int, feature_layers: tuple[int, ...] = ()) -> VerifyOut:
    """`verify_forward` and `write_block` in one call (benchmarks, tests); the engine's round
    writes after its bucket switch instead."""
    vo = verify_forward(target_params, cfg, cache, tokens, start, valid, bucket=bucket, feature_layers=feature_layers)
    return vo._replace(cache=write_block(cache, vo.k_new, vo.v_new, start, valid))
