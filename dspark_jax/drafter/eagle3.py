"""Eagle3 baseline in the DeepSpec reference's variant (docs/method.md §6).

Architecture: the m fused target layers `fc: mH -> H` (columns in layer-id order, no
norm after it), ONE Qwen3 decoder layer whose q/k/v read
`[input_norm(embed(x_{t+1})); hidden_norm(f_t)]` (2H wide), the residual on f_t,
q/k RMSNorm, RoPE, SwiGLU MLP, a final norm and the target's frozen full-vocabulary LM
head. The target feature at position t together with token x_{t+1} predicts x_{t+2}.

Training-time test (TTT) over `ttt_steps` (reference 7): step s feeds the layer's own
pre-norm output of step s-1 in place of f_t, at RoPE positions t+s, with tokens shifted
by s more; a query of step s sees the step-0 keys at indices <= its own (causal) plus
the keys of its own index from steps 1..s (`ttt_mask`), which is exactly what the
inference step s sees in a KV cache holding positions 0..t+s. Loss: soft cross-entropy
against the target distribution (fp32), step weights `decay**s`, each step normalised
on its own.

Inference keeps its own one-layer KV cache (`KVCache`, static shapes). Cache convention
shared with `mtp.py`: `cache.lengths` = number of positions whose keys come from real
target features and committed tokens. A draft anchored at p (x_p committed) needs
`lengths == p - 1`, runs step s at position p-1+s, and returns the cache with
`lengths = p`; keys it wrote beyond p-1 are dropped by that pointer (the rollback).
After verification, `eagle3_update` writes the features of positions p..p' - 2 for the
next anchor p'.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.decoding.sampling import SamplingParams, probs_from_params, sample
from dspark_jax.drafter.frozen import Frozen, attach_target  # noqa: F401  (re-exported)
from dspark_jax.target.config import ModelConfig
from dspark_jax.target.kv_cache import KVCache
from dspark_jax.target.layers import (
    apply_rope,
    attention,
    finish_layer,
    lm_head_logits,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
)
from dspark_jax.target.own_keys import OwnKeys
from dspark_jax.target.transformer import INIT_STD, layer_param_shapes

__all__ = [
    "Eagle3Drafter", "attach_target", "eagle3_layer_shapes", "ttt_mask", "eagle3_train_hidden",
    "eagle3_logits", "eagle3_train_logits", "eagle3_step_masks", "eagle3_loss", "eagle3_update",
    "eagle3_prefill", "eagle3_draft_logits", "eagle3_draft", "create_cache", "cached_attention",
]

DEFAULT_TTT_STEPS = 7
DEFAULT_STEP_DECAY = 0.8


def _layer_cfg(cfg: ModelConfig) -> ModelConfig:
    """The reference's Eagle3 layer is a Qwen3 layer (q/k norm) whatever the target family."""
    return cfg.replace(arch="qwen3")


def eagle3_layer_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """The Qwen3 layer of `layer_param_shapes` with 2H-wide q/k/v kernels and a `hidden_norm`."""
    shapes = dict(layer_param_shapes(_layer_cfg(cfg)))
    h = cfg.hidden_size
    for name in ("q_proj", "k_proj", "v_proj"):
        (_, out), axes = shapes[name]
        shapes[name] = ((2 * h, out), axes)
    shapes["hidden_norm"] = ((h,), ("norm",))
    return shapes


def _normal(rngs, shape, dtype):
    return (INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class _Layer(nnx.Module):
    """One unstacked decoder layer's weights, named as in `shapes`."""

    def __init__(self, shapes, *, rngs: nnx.Rngs, param_dtype):
        self.names = tuple(shapes)
        for name, (shape, axes) in shapes.items():
            value = jnp.ones(shape, param_dtype) if name.endswith("norm") else _normal(rngs, shape, param_dtype)
            setattr(self, name, nnx.Param(value, out_sharding=axes))

    def arrays(self) -> dict:
        return {n: getattr(self, n)[...] for n in self.names}


def _frozen_head(cfg: ModelConfig, rngs: nnx.Rngs, param_dtype):
    """Placeholders for the target's embedding / LM head; `attach_target` overwrites them."""
    embed = Frozen(_normal(rngs, (cfg.vocab_size, cfg.hidden_size), param_dtype), out_sharding=("vocab", "embed"))
    head = Frozen(_normal(rngs, (cfg.hidden_size, cfg.vocab_size), param_dtype), out_sharding=("embed", "vocab"))
    return embed, head


def _cast(tree, dtype):
    return tree if dtype is None else jax.tree.map(lambda a: a.astype(dtype), tree)


class Eagle3Drafter(nnx.Module):
    """Eagle3 drafter for a target with config `target_cfg`, fusing `m` target layers.

    `arrays()` gives the pure array dict the functions of this module take.
    """

    def __init__(self, target_cfg: ModelConfig, m: int, *, rngs: nnx.Rngs, ttt_steps: int = DEFAULT_TTT_STEPS,
                 step_decay: float = DEFAULT_STEP_DECAY, param_dtype=jnp.float32, dtype=None):
        if m < 1:
            raise ValueError(f"Eagle3 needs at least one fused target layer, got m={m}")
        if ttt_steps < 1:
            raise ValueError(f"ttt_steps must be >= 1, got {ttt_steps}")
        self.cfg = target_cfg
        self.m = m
        self.ttt_steps = ttt_steps
        self.step_decay = step_decay
        self.dtype = dtype
        h = target_cfg.hidden_size
        self.fc = nnx.Param(_normal(rngs, (m * h, h), param_dtype), out_sharding=("fused", "embed"))
        self.layer = _Layer(eagle3_layer_shapes(target_cfg), rngs=rngs, param_dtype=param_dtype)
        self.final_norm = nnx.Param(jnp.ones((h,), param_dtype), out_sharding=("norm",))
        self.embed, self.lm_head = _frozen_head(target_cfg, rngs, param_dtype)

    def arrays(self, dtype=None) -> dict:
        """Pure arrays (trainable and frozen) in the compute dtype (`dtype`, else the module's)."""
        out = {"fc": self.fc[...], "layer": self.layer.arrays(), "final_norm": self.final_norm[...],
               "embed": self.embed[...], "lm_head": self.lm_head[...]}
        return _cast(out, dtype or self.dtype)


# ----------------------------------------------------------------------------- core


def _check_feats(params, feats, cfg: ModelConfig):
    m = params["fc"].shape[0] // cfg.hidden_size
    if feats.shape[-2:] != (m, cfg.hidden_size):
        raise ValueError(
            f"target features have trailing shape {tuple(feats.shape[-2:])}, the drafter fuses "
            f"(m={m}, H={cfg.hidden_size}): pass the target's features of the drafter's layer ids"
        )


def _fuse(params, feats, cfg: ModelConfig):
    """[..., m, H] raw target features -> fc -> [..., H] (layer-id order = column-block order)."""
    _check_feats(params, feats, cfg)
    w = params["fc"]
    return feats.reshape(*feats.shape[:-2], -1).astype(w.dtype) @ w


def _embed(params, tokens):
    return jnp.take(params["embed"], tokens, axis=0)


def _qkv(p, emb, h, cos, sin, cfg: ModelConfig):
    """q/k/v from [input_norm(emb); hidden_norm(h)] (2H), q/k norm and RoPE."""
    b, t, _ = h.shape
    eps = cfg.rms_norm_eps
    e = rms_norm(emb.astype(h.dtype), p["input_norm"], eps)
    x = jnp.concatenate([e, rms_norm(h, p["hidden_norm"], eps)], axis=-1)
    q = (x @ p["q_proj"]).reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = (x @ p["k_proj"]).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = (x @ p["v_proj"]).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    q = rms_norm(q, p["q_norm"], eps)
    k = rms_norm(k, p["k_norm"], eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _rope(positions, cfg: ModelConfig):
    return rope_cos_sin(positions, rope_inv_freq(cfg.head_dim, cfg.rope))


def eagle3_logits(params, hidden):
    """Post-final-norm hidden [..., H] -> fp32 logits [..., V] through the frozen LM head."""
    return lm_head_logits(hidden, params["lm_head"])


def _final(params, h, cfg: ModelConfig):
    return rms_norm(h, params["final_norm"], cfg.rms_norm_eps)


# ----------------------------------------------------------------------------- training


def ttt_mask(valid, step: int):
    """[B, S, (step+1)*S] bool: which of the concatenated keys [step 0 | ... | step] a step-`step` query sees.

    Query i sees the step-0 keys j <= i and, from each step 1..step, only the key of its
    own index i; padded keys (valid False) never.
    """
    s = valid.shape[-1]
    idx = jnp.arange(s)
    causal = idx[None, :] <= idx[:, None]
    diag = idx[None, :] == idx[:, None]
    blocks = [causal] + [diag] * step
    return jnp.concatenate(blocks, axis=-1)[None] & jnp.tile(valid, (1, step + 1))[:, None, :]


def _shift_tokens(tokens, k: int):
    """tokens[:, i + k] at index i, zero beyond the end (those positions are never in the loss)."""
    b, s = tokens.shape
    k = min(k, s)
    return jnp.concatenate([tokens[:, k:], jnp.zeros((b, k), tokens.dtype)], axis=1)


def eagle3_train_hidden(params, tokens, feats, valid=None, *, cfg: ModelConfig, ttt_steps: int = DEFAULT_TTT_STEPS):
    """Post-final-norm hidden states [steps, B, S, H] of the training-time test.

    tokens [B, S] = x_0..x_{S-1}; feats [B, S, m, H] raw target features f_t; valid [B, S]
    marks real tokens. Row (s, b, i) predicts x_{i+s+2}.
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    b, s = tokens.shape
    if feats.shape[:2] != (b, s):
        raise ValueError(f"feats {tuple(feats.shape)} must start with the tokens' shape {(b, s)}")
    if valid is None:
        valid = jnp.ones((b, s), bool)
    p = params["layer"]
    h = _fuse(params, feats, cfg)
    base = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    ks, vs, outs = [], [], []
    for step in range(ttt_steps):
        cos, sin = _rope(base + step, cfg)
        emb = _embed(params, _shift_tokens(tokens, step + 1))
        q, k, v = _qkv(p, emb, h, cos, sin, cfg)
        ks.append(k)
        vs.append(v)
        out = attention(q, jnp.concatenate(ks, axis=1), jnp.concatenate(vs, axis=1), ttt_mask(valid, step))
        h = finish_layer(p, h, out, cfg)  # residual on the step's input state; pre-norm output feeds step+1
        outs.append(_final(params, h, cfg))
    return jnp.stack(outs)


def eagle3_train_logits(params, tokens, feats, valid=None, *, cfg: ModelConfig, ttt_steps: int = DEFAULT_TTT_STEPS):
    """fp32 logits [steps, B, S, V]; row (s, b, i) predicts x_{i+s+2}."""
    return eagle3_logits(params, eagle3_train_hidden(params, tokens, feats, valid, cfg=cfg, ttt_steps=ttt_steps))


def eagle3_step_masks(loss_mask, ttt_steps: int):
    """[steps, B, S] float: row (s, i) counts iff its label x_{i+s+2} exists and is a loss token."""
    lm = loss_mask.astype(jnp.float32)
    return jnp.stack([_shift_tokens(lm, s + 2) for s in range(ttt_steps)])


def eagle3_loss(step_logits, target_logits, loss_mask, *, decay: float = DEFAULT_STEP_DECAY,
                normalizer: str = "valid", logits_fn=None):
    """Soft CE of the TTT against the target distribution; returns (loss, per-step losses [steps]).

    step_logits [steps, B, S, V] (`eagle3_train_logits`); target_logits [B, S, V] the
    target's next-token logits (row t predicts x_{t+1}), so step s at index i is scored
    against row i+s+1; loss_mask [B, S] marks label tokens (assistant tokens inside the
    sequence). Step s weighs `decay**s`; each step is normalised on its own: by its own
    count of valid rows (`normalizer="valid"`, our default) or by B*S (`"tokens"`, the
    reference's `local_mean`). The reference masks a row by the loss mask of its input
    token i+s rather than of its label i+s+2; the two differ only at span edges.

    With `logits_fn` (e.g. `partial(eagle3_logits, params)`), `step_logits` are the hidden
    states of `eagle3_train_hidden` and each step's [B, S, V] logits are made inside a
    rematerialised step, so only one step's logits are alive at a time.
    """
    if normalizer not in ("valid", "tokens"):
        raise ValueError(f"normalizer must be 'valid' or 'tokens', got {normalizer!r}")
    steps, b, s = step_logits.shape[:3]
    masks = eagle3_step_masks(loss_mask, steps)
    logp_t = jax.lax.stop_gradient(jax.nn.log_softmax(target_logits.astype(jnp.float32), axis=-1))
    idx = jnp.arange(s)
    per_step = []

    def step_ce(x, tp):
        lg = x if logits_fn is None else logits_fn(x)
        return -jnp.sum(tp * jax.nn.log_softmax(lg.astype(jnp.float32), axis=-1), axis=-1)

    if logits_fn is not None:
        step_ce = jax.checkpoint(step_ce)
    for step in range(steps):
        rows = jnp.minimum(idx + step + 1, s - 1)
        ce = step_ce(step_logits[step], jnp.exp(logp_t[:, rows]))
        den = jnp.maximum(jnp.sum(masks[step]), 1.0) if normalizer == "valid" else float(b * s)
        per_step.append(jnp.sum(masks[step] * ce) / den)
    per_step = jnp.stack(per_step)
    weights = decay ** jnp.arange(steps, dtype=jnp.float32)
    return jnp.sum(weights * per_step), per_step


# ----------------------------------------------------------------------------- inference


def create_cache(cfg: ModelConfig, num_slots: int, max_len: int, dtype=jnp.float32) -> KVCache:
    """The drafter's own one-layer KV cache."""
    return KVCache.create(cfg, num_slots, max_len, dtype, num_layers=1)


def cached_attention(cache, q, k, v, positions, valid, rows=None):
    """Write k/v [R,T,Nkv,D] of valid tokens at `positions` into the one-layer cache (a dense
    `KVCache` or a `PagedKVCache`), attend causally.

    Keys at cache index <= the query's position are seen (committed ones and those written
    in this call); what lies beyond `lengths` from earlier calls is never read before being
    overwritten, as long as writes start at `lengths`. `rows` [K]: the inputs' rows are those
    slots (a prefill chunk; rows >= R write nothing).
    """
    r, t = q.shape[:2]
    # the new keys are written first and the attention then reads the written cache, masked to the
    # keys before this call's first position (what was written there is masked out), beside the new
    # keys themselves: read before the write, the cache was copied whole around the scatter (XLA
    # kept the original buffer alive for the read)
    dt = cache.k.dtype
    own = OwnKeys.of_prefix(k.astype(dt).astype(q.dtype), v.astype(dt).astype(q.dtype), valid)
    write = jnp.where(valid, positions, cache.max_len)  # out of range: dropped
    slots = jnp.arange(r)[:, None] if rows is None else jnp.asarray(rows, jnp.int32)[:, None]
    k_all, v_all = cache.write_layer_at(cache.k, cache.v, 0, slots, write, k, v)
    # dense, paged or kernel
    out = cache.attend_committed(q, k_all, v_all, 0, positions[:, 0], own, q.dtype, rows=rows)
    return out, cache._replace(k=k_all, v=v_all)


def _layer_step(params, cache, h, tokens, positions, valid, cfg: ModelConfig, rows=None):
    """One pass of the layer over [R, T] inputs with the cache -> (pre-norm output, cache)."""
    p = params["layer"]
    cos, sin = _rope(positions, cfg)
    q, k, v = _qkv(p, _embed(params, tokens), h, cos, sin, cfg)
    out, cache = cached_attention(cache, q, k, v, positions, valid, rows)
    return finish_layer(p, h, out, cfg), cache


def commit_positions(cache: KVCache, t: int, at=None, rows=None):
    """Where a commit of T entries per row writes: positions [R, T] from `at` [R] (default the
    rows' `lengths`; required with `rows`, a chunk of some slots, whose lengths are not theirs)."""
    if rows is not None and at is None:
        raise ValueError("a commit of some slots (rows=...) needs at= (their start positions): the cache's "
                         "lengths belong to other rows")
    at = cache.lengths if at is None else at
    return at[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]


def committed(cache: KVCache, positions, valid, rows=None) -> KVCache:
    """The cache with `lengths` one past each row's commit (positions [R, T], valid a prefix);
    with `rows` [K] only those slots move (rows >= R: none)."""
    end = positions[:, 0] + jnp.sum(valid, axis=1, dtype=jnp.int32)
    if rows is None:
        return cache.with_lengths(end)
    return cache.with_lengths(cache.lengths.at[jnp.asarray(rows, jnp.int32)].set(end, mode="drop"))


def eagle3_update(params, cache: KVCache, feats, tokens, valid=None, *, cfg: ModelConfig, rows=None,
                  at=None) -> KVCache:
    """Commit target features of new positions: feats [R, T, m, H] at positions lengths..,
    tokens [R, T] the token after each feature's position; valid [R, T] a prefix per row.
    Returns the cache with `lengths` advanced by the valid count. `rows` [K]: the inputs are
    those slots' (rows >= R: unused), written from `at` [K] (required with `rows`)."""
    r, t = tokens.shape
    if valid is None:
        valid = jnp.ones((r, t), bool)
    positions = commit_positions(cache, t, at, rows)
    _, cache = _layer_step(params, cache, _fuse(params, feats, cfg), tokens, positions, valid, cfg, rows)
    return committed(cache, positions, valid, rows)


def eagle3_prefill(params, cache: KVCache, feats, tokens, valid=None, *, cfg: ModelConfig) -> KVCache:
    """`eagle3_update` from an empty cache: a prompt x_0..x_{p} gives feats f_0..f_{p-2}, tokens x_1..x_{p-1}."""
    return eagle3_update(params, cache.with_lengths(jnp.zeros_like(cache.lengths)), feats, tokens, valid, cfg=cfg)


def _draft_scan(params, cache, last_feature, anchor_tok, anchor_pos, xs, pick, cfg: ModelConfig):
    """Shared scan over the draft steps; `pick(x, logits) -> (next token, extra output)`."""
    r = anchor_tok.shape[0]
    h0 = _fuse(params, last_feature[:, None], cfg)  # [R, 1, H]
    ones = jnp.ones((r, 1), bool)
    pos0 = anchor_pos.astype(jnp.int32) - 1

    def body(carry, x):
        h, tok, pos, c = carry
        h, c = _layer_step(params, c, h, tok[:, None], pos[:, None], ones, cfg)
        logits = eagle3_logits(params, _final(params, h, cfg))[:, 0]
        nxt, out = pick(x, logits)
        return (h, nxt, pos + 1, c), out

    (_, _, _, cache), outs = jax.lax.scan(body, (h0, anchor_tok.astype(jnp.int32), pos0, cache), xs)
    return outs, cache.with_lengths(anchor_pos.astype(jnp.int32))


def eagle3_draft_logits(params, cache: KVCache, last_feature, step_tokens, anchor_pos, *, cfg: ModelConfig):
    """Teacher-forced draft steps: step_tokens [R, G] (the anchor, then the tokens to feed)
    -> fp32 logits [R, G, V] (step s predicts x_{p+s+1}) and the rolled-back cache."""
    xs = jnp.moveaxis(step_tokens.astype(jnp.int32), 1, 0)
    nxt = jnp.concatenate([xs[1:], xs[:1]])  # the token fed at step s+1 (last one unused)
    logits, cache = _draft_scan(params, cache, last_feature, xs[0], anchor_pos, nxt,
                                lambda x, lg: (x, lg), cfg)
    return jnp.moveaxis(logits, 0, 1), cache


def eagle3_draft(key, params, cache: KVCache, last_feature, anchor_tok, anchor_pos, gamma: int,
                 sampling: SamplingParams = SamplingParams(), *, cfg: ModelConfig, path=None):
    """Sample gamma draft tokens with a `lax.scan` (`path`: see `sampling.sampling_path`).

    last_feature [R, m, H] = target features at anchor_pos - 1; anchor_tok [R] = x_p;
    anchor_pos [R] = p >= 1 with `cache.lengths == p - 1`. Returns tokens [R, G], the exact
    distributions q [R, G, V] they were sampled from, and the cache with `lengths = p`.
    """
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1 (draft tokens per round), got {gamma}")

    def pick(k, logits):
        q = probs_from_params(logits, sampling, path)
        tok = sample(k, q)
        return tok, (tok, q)

    (toks, qs), cache = _draft_scan(params, cache, last_feature, anchor_tok, anchor_pos,
                                    jax.random.split(key, gamma), pick, cfg)
    return jnp.moveaxis(toks, 0, 1), jnp.moveaxis(qs, 0, 1), cache
