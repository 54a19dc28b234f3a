"""Plain next-token cross entropy (the embedded target's pretraining loss)."""

from __future__ import annotations

import jax.numpy as jnp
import optax


def lm_loss(logits, targets, weights):
    """Mean next-token cross entropy over positions with `weights` > 0 (fp32)."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    w = weights.astype(jnp.float32)
    return (ce * w).sum() / jnp.maximum(w.sum(), 1.0)
