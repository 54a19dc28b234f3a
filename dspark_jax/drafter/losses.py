"""DSpark training losses as pure functions (docs/method.md §4).

Per block slot j (weight w_j = exp(-j / decay) times the valid prefix mask, one shared
denominator sum(w)):  coef_ce * CE(q_j, label) + coef_l1 * ||q_j - p_j||_1
+ coef_conf * BCE(z_j, c*_j), with c*_j = clip(1 - 0.5 ||q_j - p_j||_1, 0, 1) detached.
All softmaxes in float32. Two switches for ablations: `conf_detach` feeds the confidence head
stop_gradient(h_j), so the BCE trains the head (and the Markov embedding it reads) but not the
backbone; `kind_weights` False makes a kind that fixes its own weighting (DFlash: CE only) train
with these coefficients instead.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax.drafter import confidence, heads
from dspark_jax.target.layers import lm_head_logits


class LossCoefs(NamedTuple):
    ce: float = 0.1
    l1: float = 0.9
    conf: float = 1.0
    decay: float = 4.0
    conf_detach: bool = False  # the confidence head reads stop_gradient(h): no BCE gradient into the backbone
    kind_weights: bool = True  # False: every kind trains with these coefficients (DFlash too)

    @classmethod
    def from_train(cls, tc, gamma: int) -> "LossCoefs":
        """The coefficients a TrainSection asks for; `gamma` (the drafter's block size) is the decay
        constant where the section asks for the paper's weighting (`loss_decay: gamma`)."""
        decay = float(gamma) if tc.loss_decay == "gamma" else float(tc.loss_decay)
        return cls(tc.loss_ce, tc.loss_l1, tc.loss_conf, decay, conf_detach=tc.loss_conf_detach,
                   kind_weights=tc.loss_weights == "kind")


def slot_weights(gamma: int, decay: float = 4.0):
    return jnp.exp(-jnp.arange(gamma, dtype=jnp.float32) / decay)


def soft_label(q, p):
    """Analytic acceptance rate of rejection sampling: clip(1 - 0.5 * ||q - p||_1, 0, 1), detached."""
    return jax.lax.stop_gradient(jnp.clip(1.0 - 0.5 * jnp.sum(jnp.abs(q - p), axis=-1), 0.0, 1.0))


def bce_with_logits(z, target):
    """Numerically stable binary cross-entropy on logits against soft targets."""
    return jnp.maximum(z, 0.0) - z * target + jnp.log1p(jnp.exp(-jnp.abs(z)))


class LossSums(NamedTuple):
    """Weighted sums (not yet divided by the shared denominator) and acceptance statistics."""

    ce: jnp.ndarray
    l1: jnp.ndarray
    conf: jnp.ndarray
    weight: jnp.ndarray
    accept: jnp.ndarray  # sum over valid slots of c*_j, per slot [G]
    count: jnp.ndarray  # valid slots per position [G]
    correct: jnp.ndarray  # argmax q == label, per slot [G]
    tau: jnp.ndarray  # sum over fully valid blocks of 1 + sum_j prod_{i<=j} c*_i
    blocks: jnp.ndarray  # number of fully valid blocks


def dspark_loss_sums(logits, target_logits, labels, valid, conf_logits=None, decay: float = 4.0) -> LossSums:
    """Sums over a chunk of blocks.

    logits: corrected draft logits U + B [..., G, V]; target_logits [..., G, V] (row p+j);
    labels [..., G] (x_{p+j+1}); valid [..., G] bool; conf_logits [..., G] or None.
    """
    g = logits.shape[-2]
    w = slot_weights(g, decay) * valid.astype(jnp.float32)
    logq = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    q = jnp.exp(logq)
    p = jax.lax.stop_gradient(jax.nn.softmax(target_logits.astype(jnp.float32), axis=-1))
    ce = -jnp.take_along_axis(logq, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    l1 = jnp.sum(jnp.abs(q - p), axis=-1)
    c_star = soft_label(q, p)
    conf = bce_with_logits(conf_logits.astype(jnp.float32), c_star) if conf_logits is not None else jnp.zeros_like(ce)
    vf = valid.astype(jnp.float32)
    red = tuple(range(vf.ndim - 1))
    full = vf[..., -1]  # valid is a prefix: the last slot valid <=> the whole block
    tau = 1.0 + jnp.sum(jnp.cumprod(c_star, axis=-1), axis=-1)
    return LossSums(
        ce=jnp.sum(w * ce), l1=jnp.sum(w * l1), conf=jnp.sum(w * conf), weight=jnp.sum(w),
        accept=jnp.sum(vf * c_star, axis=red), count=jnp.sum(vf, axis=red),
        correct=jnp.sum(vf * label_is_argmax(logq, labels), axis=red),
        tau=jnp.sum(full * tau), blocks=jnp.sum(full),
    )


def label_is_argmax(logq, labels):
    """Whether the label holds the largest log-probability (a tie for the max counts): a gather and a
    plain max over V instead of an index-tracking argmax reduction (19 ms of a bench_cpu step)."""
    at_label = jnp.take_along_axis(logq, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return at_label >= jnp.max(logq, axis=-1)


def combine(sums: LossSums, coefs: LossCoefs) -> tuple[jnp.ndarray, dict]:
    den = jnp.maximum(sums.weight, 1e-6)
    ce, l1, conf = sums.ce / den, sums.l1 / den, sums.conf / den
    total = coefs.ce * ce + coefs.l1 * l1 + coefs.conf * conf
    return total, {"loss": total, "ce": ce, "l1": l1, "conf_bce": conf}


def _gather_rows(x, idx):
    """x [B,S,...], idx [B,...] (positions) -> x at those positions, idx clipped into range."""
    s = x.shape[1]
    flat = jnp.clip(idx, 0, s - 1).reshape(idx.shape[0], -1)
    out = jnp.take_along_axis(x, flat.reshape(*flat.shape, *([1] * (x.ndim - 2))), axis=1)
    return out.reshape(*idx.shape, *x.shape[2:])


def dspark_chunked_sums(p: dict, h, tokens, target_hidden, lm_head,
                        anchors, block_valid, chunk: int, decay: float, conf_detach: bool = False) -> LossSums:
    """Loss sums over anchor chunks. h [B,A,G,H]; target_hidden [B,S,H]. `conf_detach`: the
    confidence head reads stop_gradient(h), so its loss does not reach the backbone.

    With several chunks each is rematerialised in the backward (one chunk's vocabulary-sized
    activations live at a time); a single chunk is not: recomputing it costs a second
    vocabulary-wide forward and saved no memory (the compiled bench_cpu step on CPU needs 114.6 MiB
    of temporaries without, 144.0 MiB with the rematerialisation)."""
    b, a, g, _ = h.shape
    chunk = min(chunk, a)
    if a % chunk:
        raise ValueError(f"train.anchor_chunk ({chunk}) must divide data.num_anchors ({a})")
    n = a // chunk
    j = jnp.arange(g, dtype=jnp.int32)
    split = lambda x: jnp.moveaxis(x.reshape(b, n, chunk, *x.shape[2:]), 1, 0)

    def one(xs):
        h_c, anc_c, val_c = xs
        pos = anc_c[..., None] + j  # [B,c,G]: slot j's previous token / target row
        prev = _gather_rows(tokens, pos)
        labels = _gather_rows(tokens, pos + 1)
        t_rows = _gather_rows(target_hidden, pos)
        t_logits = lm_head_logits(t_rows, lm_head)
        logits = heads.base_logits(p, h_c) + heads.head_bias_train(p, h_c, prev)
        h_conf = jax.lax.stop_gradient(h_c) if conf_detach else h_c
        z = confidence.confidence_logits(p, h_conf, prev) if "conf_kernel" in p else None
        return dspark_loss_sums(logits, t_logits, labels, val_c, z, decay)

    if n > 1:
        one = jax.checkpoint(one)

    def body(acc, xs):
        return jax.tree.map(jnp.add, acc, one(xs)), None

    zeros = jax.eval_shape(one, jax.tree.map(lambda x: x[0], (split(h), split(anchors), split(block_valid))))
    acc0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), zeros)
    acc, _ = jax.lax.scan(body, acc0, (split(h), split(anchors), split(block_valid)))
    return acc
