"""One training step: frozen target features online -> drafter -> chunked loss -> AdamW.

The target runs inside the step on the same devices, so no offline feature cache is
needed. The loss is computed over chunks of anchors under `jax.checkpoint`, so the
vocabulary-sized tensors (q, p: [B, chunk, G, V]) exist for one chunk at a time, also in
the backward pass.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dspark_jax.drafter import backbone, confidence, heads
from dspark_jax.train.optim import adamw, warmup_cosine_schedule
from dspark_jax.losses.dspark import LossCoefs, LossSums, combine, dspark_loss_sums


class TrainState(NamedTuple):
    step: jnp.ndarray
    params: Any  # nnx.State of the drafter's nnx.Param leaves (float32 master weights)
    opt_state: Any


def make_optimizer(lr: float, total_steps: int, warmup_frac: float = 0.04, b1: float = 0.9, b2: float = 0.999,
                   weight_decay: float = 0.0, clip_norm: float = 1.0):
    """The drafter's optimiser: warm-up over round(`warmup_frac` * steps) (at least 1 when the
    fraction is positive), cosine to 0, AdamW after global-norm clipping."""
    warmup = max(1, int(round(warmup_frac * total_steps))) if warmup_frac > 0 else 0
    sched = warmup_cosine_schedule(lr, max(total_steps, 1), min(warmup, max(total_steps, 1)))
    return adamw(sched, b1=b1, b2=b2, weight_decay=weight_decay, clip_norm=clip_norm), sched


def _gather_rows(x, idx):
    """x [B,S,...], idx [B,...] (positions) -> x at those positions, idx clipped into range."""
    s = x.shape[1]
    flat = jnp.clip(idx, 0, s - 1).reshape(idx.shape[0], -1)
    out = jnp.take_along_axis(x, flat.reshape(*flat.shape, *([1] * (x.ndim - 2))), axis=1)
    return out.reshape(*idx.shape, *x.shape[2:])


def dspark_chunked_sums(p: dict, h, tokens, target_hidden, lm_head, anchors, block_valid, chunk: int, decay: float) -> LossSums:
    """Loss sums over anchor chunks (rematerialised). h [B,A,G,H]; target_hidden [B,S,H]."""
    b, a, g, _ = h.shape
    chunk = min(chunk, a)
    if a % chunk:
        raise ValueError(f"train.anchor_chunk ({chunk}) must divide data.num_anchors ({a})")
    n = a // chunk
    j = jnp.arange(g, dtype=jnp.int32)
    split = lambda x: jnp.moveaxis(x.reshape(b, n, chunk, *x.shape[2:]), 1, 0)

    @jax.checkpoint
    def one(xs):
        h_c, anc_c, val_c = xs
        pos = anc_c[..., None] + j  # [B,c,G]: slot j's previous token / target row
        prev = _gather_rows(tokens, pos)
        labels = _gather_rows(tokens, pos + 1)
        t_rows = _gather_rows(target_hidden, pos)
        t_logits = jnp.einsum("...h,hv->...v", t_rows, lm_head.astype(t_rows.dtype), preferred_element_type=jnp.float32)
        logits = heads.base_logits(p, h_c) + heads.head_bias_train(p, h_c, prev)
        z = confidence.confidence_logits(p, h_c, prev) if "conf_kernel" in p else None
        return dspark_loss_sums(logits, t_logits, labels, val_c, z, decay)

    def body(acc, xs):
        return jax.tree.map(jnp.add, acc, one(xs)), None

    zeros = jax.eval_shape(one, jax.tree.map(lambda x: x[0], (split(h), split(anchors), split(block_valid))))
    acc0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), zeros)
    acc, _ = jax.lax.scan(body, acc0, (split(h), split(anchors), split(block_valid)))
    return acc


def make_loss_fn(d_graphdef, t_graphdef, kind: str, coefs: LossCoefs, chunk: int, compute_dtype=None,
                 eagle3_steps: int = 7):
    """(params, frozen, target_state, batch) -> (loss, (metrics, sums)) for any drafter kind.

    dspark: CE + L1 + BCE (section 4); dflash: CE only; eagle3: the training-time test's
    soft CE (section 6); mtp1: CE on x_{t+2}. `sums` is a LossSums for dspark/dflash
    (held-out acceptance statistics) and None for the baselines.
    """

    def loss_fn(params, frozen, target_state, batch):
        drafter = nnx.merge(d_graphdef, params, frozen)
        target = nnx.merge(t_graphdef, target_state)
        tokens = batch["tokens"]
        ids = tuple(drafter.dcfg.target_layer_ids)
        want_logits = kind == "eagle3"
        out = target(tokens, valid=batch["seq_valid"], feature_layers=ids, return_logits=want_logits)
        hidden = jax.lax.stop_gradient(out.hidden)
        feats = None if out.features is None else jax.lax.stop_gradient(out.features)
        p = drafter.arrays(compute_dtype)
        if kind == "eagle3":
            from dspark_jax.drafter.eagle3 import eagle3_logits, eagle3_loss, eagle3_train_hidden

            h = eagle3_train_hidden(p, tokens, feats, batch["seq_valid"], cfg=drafter.cfg, ttt_steps=eagle3_steps)
            loss, per_step = eagle3_loss(h, jax.lax.stop_gradient(out.logits), batch["loss_mask"],
                                         logits_fn=lambda x: eagle3_logits(p, x))
            metrics = {"loss": loss, **{f"step{i}": per_step[i] for i in range(min(3, per_step.shape[0]))}}
            return loss, (metrics, None)
        if kind == "mtp1":
            from dspark_jax.drafter.mtp import mtp_loss, mtp_train_logits

            logits = mtp_train_logits(p, tokens, hidden, batch["seq_valid"], cfg=drafter.cfg)
            loss = mtp_loss(logits, tokens, batch["loss_mask"])
            return loss, ({"loss": loss}, None)
        ctx = backbone.fuse_context(p, feats, drafter.cfg)
        h = backbone.backbone_train(p, drafter.cfg, tokens, ctx, batch["anchors"], batch["keep"], gamma=drafter.gamma,
                                    mask_id=drafter.mask_token_id, window=drafter.dcfg.sliding_window)
        sums = dspark_chunked_sums(p, h, tokens, hidden, p["lm_head"], batch["anchors"], batch["block_valid"], chunk, coefs.decay)
        coefs_k = LossCoefs(ce=1.0, l1=0.0, conf=0.0, decay=coefs.decay) if kind == "dflash" else coefs
        loss, metrics = combine(sums, coefs_k)
        return loss, (metrics, sums)

    return loss_fn


def make_train_step(loss_fn: Callable, tx, grad_accum: int = 1):
    """One optimiser update. With `grad_accum` > 1 the batch is split into that many
    micro-batches whose gradients are summed in a `lax.scan`, so activations exist for one
    micro-batch at a time (the loss is a per-micro-batch mean, averaged)."""

    def grads_of(params, frozen, target_state, batch):
        return jax.value_and_grad(loss_fn, has_aux=True)(params, frozen, target_state, batch)

    def train_step(state: TrainState, frozen, target_state, batch):
        if grad_accum == 1:
            (loss, (metrics, sums)), grads = grads_of(state.params, frozen, target_state, batch)
        else:
            micro = jax.tree.map(lambda x: x.reshape(grad_accum, x.shape[0] // grad_accum, *x.shape[1:]), batch)

            def body(acc, mb):
                (loss, (metrics, sums)), g = grads_of(state.params, frozen, target_state, mb)
                return jax.tree.map(jnp.add, acc, (g, metrics, sums)), None

            first = jax.tree.map(lambda x: x[0], micro)
            shapes = jax.eval_shape(lambda b: (lambda r: (r[1], r[0][1][0], r[0][1][1]))(grads_of(state.params, frozen, target_state, b)), first)
            acc0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
            (grads, metrics, sums), _ = jax.lax.scan(body, acc0, micro)
            grads = jax.tree.map(lambda g: g / grad_accum, grads)
            metrics = jax.tree.map(lambda m: m / grad_accum, metrics)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(metrics, grad_norm=optax.tree.norm(grads))
        return TrainState(state.step + 1, params, opt_state), metrics, sums

    return train_step


def make_eval_step(loss_fn: Callable):
    def eval_step(params, frozen, target_state, batch):
        _, (metrics, sums) = loss_fn(params, frozen, target_state, batch)
        return metrics, sums

    return eval_step
