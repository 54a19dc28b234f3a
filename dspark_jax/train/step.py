"""One training step: frozen target features -> drafter -> chunked loss -> AdamW.

The target runs inside the step on the same devices (`data.features: online`), or its outputs
come with the batch from the feature cache (`data.features: cache`, data/features.py). The
loss is computed over chunks of anchors under `jax.checkpoint`, so the vocabulary-sized
tensors (q, p: [B, chunk, G, V]) exist for one chunk at a time, also in the backward pass.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dspark_jax.config.loader import ConfigError
from dspark_jax.drafter.losses import LossCoefs
from dspark_jax.target.forward import ForwardOut
from dspark_jax.toolkit.optim import adamw, warmup_cosine_schedule


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


def require_cacheable(kind) -> None:
    """The cache holds features and the last hidden, not logits (a vocabulary-sized row per token,
    far larger than the rest): kinds whose loss reads the target's logits train online."""
    if kind.needs_target_logits:
        raise ConfigError(f"data.features=cache is not available for {kind.name} drafters: their loss reads the "
                          "target's logits, which the feature cache does not hold; set data.features=online")


def cached_target_out(target, batch, kind) -> ForwardOut:
    """The target's outputs a kind's loss reads, from a batch that carries the feature cache's
    `features` [B, S, m, H] and `hidden` [B, S, H] (bfloat16), in the dtype the online forward
    gives them."""
    require_cacheable(kind)
    dtype = target.dtype or target.embed[...].dtype
    return ForwardOut(logits=None, hidden=batch["hidden"].astype(dtype), features=batch["features"].astype(dtype),
                      cache=None)


def make_loss_fn(d_graphdef, t_graphdef, kind, coefs: LossCoefs, chunk: int, compute_dtype=None,
                 eagle3_steps: int = 7, remat: str = "none"):
    """(params, frozen, target_state, batch) -> (loss, (metrics, sums)) for any drafter kind: the
    frozen target runs once, then the kind's adapter (drafter/kinds/) computes its loss; `sums`
    are held-out acceptance statistics (LossSums) for the block drafters and None otherwise."""

    if remat != "none" and not kind.supports_remat:
        raise ConfigError(f"train.remat={remat} is not available for {kind.name} drafters (only for block drafters: "
                          "dspark, dflash); set train.remat=none")

    def loss_fn(params, frozen, target_state, batch):
        drafter = nnx.merge(d_graphdef, params, frozen)
        target = nnx.merge(t_graphdef, target_state)
        if "features" in batch:  # the feature cache's rows: no target forward
            out = cached_target_out(target, batch, kind)
        else:
            with jax.named_scope("target_forward"):  # profiles read by stage
                out = target(batch["tokens"], valid=batch["seq_valid"],
                             feature_layers=tuple(drafter.dcfg.target_layer_ids),
                             return_logits=kind.needs_target_logits)
        out = jax.tree.map(jax.lax.stop_gradient, out)
        with jax.named_scope(f"drafter_{kind.name}_loss"):
            return kind.loss(drafter.arrays(compute_dtype), drafter, out, batch, coefs=coefs, chunk=chunk,
                             ttt_steps=eagle3_steps, remat=remat == "drafter_layers")

    return loss_fn


def loss_weight(metrics: dict, sums):
    """The denominator of a micro-batch's mean loss: the block kinds' summed position weights, the
    `loss_weight` a kind reports (MTP-1: its label count), else 1 (Eagle3 normalises each of its
    steps on its own, so its micro-batch losses are averaged)."""
    if sums is not None:
        return sums.weight
    return metrics.get("loss_weight", jnp.float32(1.0))


def without_weight(metrics: dict) -> dict:
    """The metrics to log: `loss_weight` only weighs micro-batches."""
    return {k: v for k, v in metrics.items() if k != "loss_weight"}


def split_micro(batch, n: int, sharding=None):
    """[B, ...] -> [n, B / n, ...], micro-batch k = rows k, k + n, k + 2n, ...

    Strided, as MaxText's gradient accumulation does: a batch is sharded over chips in contiguous
    blocks of rows, so each chip holds the same number of every micro-batch's rows and no
    micro-step waits on a few chips (contiguous slices would put each micro-batch on 1 / n of them).
    `sharding` (e.g. P(None, batch axes)) pins that layout."""
    out = jax.tree.map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 0, 1), batch)
    return out if sharding is None else jax.lax.with_sharding_constraint(out, sharding)


def _accumulate(value_and_grad, n: int, batch, micro_sharding):
    """`value_and_grad(micro_batch)` -> (grads or (), metrics, sums). Sums over `n` strided
    micro-batches (grad of loss * w, metrics * w, sums, w) and divides by the total w: one
    denominator for the whole batch, as if it had been one micro-batch."""

    micro = split_micro(batch, n, micro_sharding)

    def body(acc, mb):
        g, metrics, sums = value_and_grad(mb)
        w = jax.lax.stop_gradient(loss_weight(metrics, sums))
        g = jax.tree.map(lambda x: x * w, g)
        metrics = jax.tree.map(lambda m: m * w, metrics)
        return jax.tree.map(jnp.add, acc, (g, metrics, sums, w)), None

    first = jax.tree.map(lambda x: x[0], micro)
    shapes = jax.eval_shape(lambda b: (*value_and_grad(b), jnp.float32(0)), first)
    acc0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    (g, metrics, sums, w), _ = jax.lax.scan(body, acc0, micro)
    w = jnp.maximum(w, 1e-6)
    return jax.tree.map(lambda x: x / w, g), jax.tree.map(lambda m: m / w, metrics), sums


def make_train_step(loss_fn: Callable, tx, grad_accum: int = 1, micro_sharding=None):
    """One optimiser update. With `grad_accum` > 1 the batch is split into that many strided
    micro-batches (`split_micro`) whose weighted gradients are summed in a `lax.scan`, so
    activations exist for one micro-batch at a time; the loss keeps one denominator over the
    whole batch (`loss_weight`), so the update equals the one-micro-batch update."""

    def train_step(state: TrainState, frozen, target_state, batch):
        if grad_accum == 1:
            (loss, (metrics, sums)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                state.params, frozen, target_state, batch)
        else:
            def grads_of(mb):
                (_, (metrics, sums)), g = jax.value_and_grad(loss_fn, has_aux=True)(state.params, frozen,
                                                                                    target_state, mb)
                return g, metrics, sums

            grads, metrics, sums = _accumulate(grads_of, grad_accum, batch, micro_sharding)
        with jax.named_scope("optimizer"):
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
        metrics = dict(without_weight(metrics), grad_norm=optax.tree.norm(grads))
        return TrainState(state.step + 1, params, opt_state), metrics, sums

    return train_step


def make_eval_step(loss_fn: Callable, micro_batches: int = 1, micro_sharding=None):
    """Held-out (metrics, sums) of a batch, in `micro_batches` strided micro-batches (as training
    does, so evaluation needs no more activation memory than a training micro-step)."""

    def eval_step(params, frozen, target_state, batch):
        if micro_batches == 1:
            _, (metrics, sums) = loss_fn(params, frozen, target_state, batch)
            return without_weight(metrics), sums

        def of(mb):
            _, (metrics, sums) = loss_fn(params, frozen, target_state, mb)
            return (), metrics, sums  # no gradient

        _, metrics, sums = _accumulate(of, micro_batches, batch, micro_sharding)
        return without_weight(metrics), sums

    return eval_step
