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

from dspark_jax.train.optim import adamw, warmup_cosine_schedule
from dspark_jax.losses.dspark import LossCoefs


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


def make_loss_fn(d_graphdef, t_graphdef, kind, coefs: LossCoefs, chunk: int, compute_dtype=None,
                 eagle3_steps: int = 7):
    """(params, frozen, target_state, batch) -> (loss, (metrics, sums)) for any drafter kind: the
    frozen target runs once, then the kind's adapter (drafter/kinds/) computes its loss; `sums`
    are held-out acceptance statistics (LossSums) for the block drafters and None otherwise."""

    def loss_fn(params, frozen, target_state, batch):
        drafter = nnx.merge(d_graphdef, params, frozen)
        target = nnx.merge(t_graphdef, target_state)
        out = target(batch["tokens"], valid=batch["seq_valid"], feature_layers=tuple(drafter.dcfg.target_layer_ids),
                     return_logits=kind.needs_target_logits)
        out = jax.tree.map(jax.lax.stop_gradient, out)
        return kind.loss(drafter.arrays(compute_dtype), drafter, out, batch, coefs=coefs, chunk=chunk,
                         ttt_steps=eagle3_steps)

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
