"""Batched target-only sampling with a static-shape KV cache.

Prefill writes each row's prompt into the cache in one forward pass, then the decode
loop samples one token per row per step. Both run the engine's decode path: the one forward
(target/forward.py) over the weights as the engine's programs hold them
(`decode_weights.decode_arrays`: one array per layer where `kernels.per_layer_decode` says so,
each weight read once a step; the model then holds that split in place of its stacks, so the
weights are on the devices once) and the cache read by the attention backend the engine's
programs use (target/attention_backend.py). The whole loop is one compiled ``lax.while_loop``
that exits early once every row is done (stop token or its own max-new-tokens), so the
host is not in the loop. ``generate_host_loop`` runs the same step from Python (one
jitted call per token) for the benchmark's loop-vs-host ratio and as a cross-check.

Randomness: row r draws step s with ``fold_in(fold_in(key(seed), sample_index[r]), s)``,
so a sample's tokens depend only on (seed, its index, the model), never on which batch
or slot it landed in, nor on where a resumed run restarted.

Sampling settings (temperature, top-k, top-p; scalars or per-row arrays) and the stop
ids are traced values: changing them does not recompile. Static: batch size, padded
prompt length and ``max_new_tokens``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.decoding.sampling import SamplingParams, sample, sampling_probs
from dspark_jax.target.attention import cache_update
from dspark_jax.target.config import ModelConfig
from dspark_jax.target.decode_weights import decode_arrays
from dspark_jax.target.forward import forward
from dspark_jax.target.kernels import per_layer_decode
from dspark_jax.target.kv_cache import KVCache
from dspark_jax.target.layers import lm_head_logits

__all__ = ["GenerateOut", "generate", "generate_host_loop", "row_keys"]


class GenerateOut(NamedTuple):
    tokens: jax.Array  # [R, max_new_tokens] int32; pad_id after each row's length
    lengths: jax.Array  # [R] int32 generated tokens per row (a final stop token included)


def row_keys(seed, sample_index) -> jax.Array:
    """Per-row keys ``fold_in(key(seed), sample_index[r])`` (``seed`` may already be a key)."""
    base = seed if isinstance(seed, jax.Array) and jnp.issubdtype(seed.dtype, jax.dtypes.prng_key) \
        else jax.random.key(seed)
    idx = jnp.asarray(sample_index, jnp.uint32)
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(base, idx)


class _Carry(NamedTuple):
    step: jax.Array
    cache: KVCache
    logits: jax.Array  # [R, V] next-token logits of each row
    tokens: jax.Array  # [R, N]
    lengths: jax.Array  # [R]
    done: jax.Array  # [R] bool


def _forward(cfg: ModelConfig, tp: dict, tokens, positions, valid, cache: KVCache):
    """New tokens written into `cache` and attending to it -> (final hidden [R, T, H], cache)."""
    out = forward(tp, cfg, tokens, positions, cache_update(cache, positions, valid), return_logits=False)
    return out.hidden, out.cache


def _prefill(cfg: ModelConfig, tp: dict, prompts, prompt_lens, max_new_row, pad_id, max_new_tokens: int) -> _Carry:
    r, p = prompts.shape
    cache = KVCache.create(cfg, r, p + max_new_tokens, dtype=tp["embed"].dtype)
    pos = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (r, p))
    hidden, cache = _forward(cfg, tp, prompts, pos, pos < prompt_lens[:, None], cache)
    logits = lm_head_logits(hidden[jnp.arange(r), jnp.maximum(prompt_lens - 1, 0)], tp["lm_head"])
    return _Carry(jnp.int32(0), cache.with_lengths(prompt_lens), logits,
                  jnp.full((r, max_new_tokens), pad_id, jnp.int32), jnp.zeros((r,), jnp.int32), max_new_row <= 0)


def _step(cfg: ModelConfig, tp: dict, c: _Carry, keys, prompt_lens, max_new_row, params: SamplingParams, stop_ids,
          pad_id):
    """Sample one token per active row, record it, and forward it to get the next logits."""
    probs = sampling_probs(c.logits, params.temperature, params.top_k, params.top_p)
    step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, c.step.astype(jnp.uint32))
    tok = jax.vmap(sample)(step_keys, probs)
    active = ~c.done
    tok = jnp.where(active, tok, pad_id)
    tokens = c.tokens.at[:, c.step].set(tok)
    lengths = c.lengths + active.astype(jnp.int32)
    stopped = jnp.any(tok[:, None] == stop_ids[None, :], axis=-1)
    done = c.done | (active & (stopped | (lengths >= max_new_row)))
    pos = (prompt_lens + c.step)[:, None]
    hidden, cache = _forward(cfg, tp, tok[:, None], pos, (~done)[:, None], c.cache)
    logits = lm_head_logits(hidden[:, 0], tp["lm_head"])
    return _Carry(c.step + 1, cache.with_lengths(prompt_lens + lengths), logits, tokens, lengths, done)


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens"))
def _generate_jit(cfg, tp, prompts, prompt_lens, keys, max_new_row, params, stop_ids, pad_id, max_new_tokens: int):
    c = _prefill(cfg, tp, prompts, prompt_lens, max_new_row, pad_id, max_new_tokens)

    def cond(c):
        return (c.step < max_new_tokens) & ~jnp.all(c.done)

    def body(c):
        return _step(cfg, tp, c, keys, prompt_lens, max_new_row, params, stop_ids, pad_id)

    c = jax.lax.while_loop(cond, body, c)
    return GenerateOut(c.tokens, c.lengths)


_prefill_jit = jax.jit(_prefill, static_argnames=("cfg", "max_new_tokens"))
_step_jit = jax.jit(_step, static_argnames=("cfg",), donate_argnames=("c",))


def _prepare(model, prompts, prompt_lens, max_new_tokens, sample_index, seed, sampling, max_new, stop_ids):
    prompts = jnp.asarray(prompts, jnp.int32)
    if prompts.ndim != 2:
        raise ValueError(f"prompts must be [rows, prompt_len] int tokens, got shape {prompts.shape}")
    r, p = prompts.shape
    lens = np.asarray(prompt_lens, np.int64).reshape(-1)
    if lens.shape != (r,) or lens.min(initial=1) < 1 or lens.max(initial=1) > p:
        raise ValueError(f"prompt_lens must be {r} values in [1, {p}] (each row needs at least one prompt token)")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    idx = np.arange(r) if sample_index is None else np.asarray(sample_index).reshape(-1)
    if idx.shape != (r,):
        raise ValueError(f"sample_index must have one entry per row ({r}), got shape {idx.shape}")
    mx = np.full((r,), max_new_tokens) if max_new is None else np.broadcast_to(np.asarray(max_new), (r,))
    if np.any(mx > max_new_tokens):
        raise ValueError(f"per-row max_new ({int(mx.max())}) exceeds the static max_new_tokens ({max_new_tokens})")
    t, k, tp = sampling if sampling is not None else SamplingParams()
    sampling = SamplingParams(jnp.asarray(t, jnp.float32), jnp.asarray(k, jnp.int32), jnp.asarray(tp, jnp.float32))
    stops = jnp.asarray(list(stop_ids) or [-1], jnp.int32)
    tp = decode_arrays(model, per_layer=per_layer_decode(), hold=True)  # the model keeps the split: one copy
    return (model.cfg, tp, prompts, jnp.asarray(lens, jnp.int32), row_keys(seed, idx),
            jnp.asarray(mx, jnp.int32), sampling, stops)


def generate(model, prompts, prompt_lens, *, max_new_tokens: int, sampling: SamplingParams | None = None,
             seed=0, sample_index=None, max_new=None, stop_ids=(), pad_id: int = 0) -> GenerateOut:
    """Sample continuations of right-padded ``prompts`` [R, P] with the compiled decode loop.

    ``max_new`` (scalar or [R]) caps each row (<= ``max_new_tokens``, 0 = skip the row);
    a row stops after emitting any of ``stop_ids`` (the stop token is kept and counted).
    ``sample_index`` [R] (default ``arange(R)``) selects each row's random stream.
    """
    g, s, p, lens, keys, mx, sp, stops = _prepare(model, prompts, prompt_lens, max_new_tokens, sample_index,
                                                  seed, sampling, max_new, stop_ids)
    return _generate_jit(g, s, p, lens, keys, mx, sp, stops, jnp.int32(pad_id), max_new_tokens=max_new_tokens)


def generate_host_loop(model, prompts, prompt_lens, *, max_new_tokens: int, sampling: SamplingParams | None = None,
                       seed=0, sample_index=None, max_new=None, stop_ids=(), pad_id: int = 0) -> GenerateOut:
    """Same results as :func:`generate`, but the decode loop runs in Python (one jitted step per token)."""
    g, s, p, lens, keys, mx, sp, stops = _prepare(model, prompts, prompt_lens, max_new_tokens, sample_index,
                                                  seed, sampling, max_new, stop_ids)
    pad = jnp.int32(pad_id)
    c = _prefill_jit(g, s, p, lens, mx, pad, max_new_tokens=max_new_tokens)
    for _ in range(max_new_tokens):
        if bool(jnp.all(c.done)):
            break
        c = _step_jit(g, s, c, keys, lens, mx, sp, stops, pad)
    return GenerateOut(c.tokens, c.lengths)
