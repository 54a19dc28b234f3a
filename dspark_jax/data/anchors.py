"""Anchor sampling for DSpark training blocks (docs/method.md §4).

An anchor p is a committed token whose block predicts p+1 ... p+gamma. It is valid when
both x_p and x_{p+1} are assistant tokens. Per sequence we draw up to `num_anchors`
distinct valid anchors uniformly, sort them, and pad with dummy blocks (keep = False).
The randomness comes from (seed, record index) only, so a resumed run samples the same.
"""

from __future__ import annotations

import numpy as np


def valid_anchor_positions(loss_mask: np.ndarray) -> np.ndarray:
    m = np.asarray(loss_mask, bool)
    if m.size < 2:
        return np.zeros((0,), np.int64)
    return np.flatnonzero(m[:-1] & m[1:])


def sample_anchors(loss_mask: np.ndarray, num_anchors: int, seed: int, index: int) -> tuple[np.ndarray, np.ndarray]:
    """-> (anchors int32 [num_anchors], keep bool [num_anchors]); dummies sit at position 0."""
    cand = valid_anchor_positions(loss_mask)
    rng = np.random.default_rng([seed, index])
    n = min(num_anchors, cand.size)
    chosen = np.sort(rng.choice(cand, size=n, replace=False)) if n else np.zeros((0,), np.int64)
    anchors = np.zeros((num_anchors,), np.int32)
    keep = np.zeros((num_anchors,), bool)
    anchors[:n] = chosen
    keep[:n] = True
    return anchors, keep


def block_valid_mask(loss_mask: np.ndarray, anchors: np.ndarray, keep: np.ndarray, gamma: int) -> np.ndarray:
    """[A, G] bool for one sequence: slot j is valid when its label x_{p+j+1} lies inside the
    sequence and is an assistant token, and every earlier slot of the block is valid."""
    loss_mask = np.asarray(loss_mask, bool)
    s = loss_mask.shape[0]
    pos = anchors[:, None].astype(np.int64) + 1 + np.arange(gamma)[None, :]
    ok = (pos < s) & loss_mask[np.minimum(pos, s - 1)] & keep[:, None]
    return np.cumprod(ok, axis=-1).astype(bool)
