"""Confidence head (docs/method.md §2.3): z_j = Dense([h_j; W1[x_{p+j}]]) -> 1 (its soft label: drafter/losses.py).

`c_j = sigmoid(z_j)` estimates P(draft token j accepted | slots < j accepted). Without a
Markov head (markov_rank 0) the input is h_j alone. At inference x_{p+j} is the sampled
previous draft token (see heads.sample_block).
"""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["prev_embed", "confidence_logits"]


def prev_embed(params: dict, tokens, dtype=None):
    """W1[x]: the Markov embedding of previous tokens, [...] -> [..., r]."""
    e = jnp.take(params["markov_w1"], tokens, axis=0, mode="clip")  # token ids are in range: no fill mask
    return e if dtype is None else e.astype(dtype)


def confidence_logits(params: dict, h, prev_tokens):
    """z [...] float32 from h [..., H] and previous tokens [...]; zeros without a confidence head."""
    if "conf_kernel" not in params:
        return jnp.zeros(h.shape[:-1], jnp.float32)
    kernel = params["conf_kernel"]
    x = h
    if kernel.shape[0] != h.shape[-1]:  # [h; W1[x]]
        x = jnp.concatenate([h, prev_embed(params, prev_tokens, h.dtype)], axis=-1)
    z = jnp.einsum("...i,io->...o", x, kernel.astype(x.dtype), preferred_element_type=jnp.float32)
    return z[..., 0] + params["conf_bias"][0].astype(jnp.float32)
