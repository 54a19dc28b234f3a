"""What the GPU cache kernels (target/gpu_kernel.py on Triton, target/gpu_mosaic.py on Mosaic GPU)
share: how many programs a row's keys are split among, and the merge of the splits' parts.

Few rows leave most of a GPU's multiprocessors idle (one row of Qwen3-8B: 8 KV heads, 8
programs), so each (row, KV head, query block) is split into programs until the grid reaches
`MIN_PROGRAMS` (about two per multiprocessor of an H100 / H200, 132), at most one a key block
(flash decoding). Each split returns its part's output and log-sum-exp; `merge_splits` makes
them one softmax.
"""

from __future__ import annotations

import jax.numpy as jnp

from dspark_jax.target.layers import MASK_VALUE

__all__ = ["NO_KEYS", "MIN_PROGRAMS", "splits", "merge_splits"]

NO_KEYS = MASK_VALUE  # the log-sum-exp of a query that sees no key (as target/paged_kernel.py)
MIN_PROGRAMS = 256  # about two programs per multiprocessor of an H100 / H200 (132)


def splits(programs: int, blocks: int) -> int:
    """Key splits per (row, head, query block): enough to bring `programs` to MIN_PROGRAMS, at
    most the row's `blocks` key blocks (a split of none would only add a part to merge)."""
    return max(1, min(-(-MIN_PROGRAMS // programs), blocks))


def merge_splits(out, lse):
    """The splits' parts (out [R, Nkv, splits, rows, D], lse [R, Nkv, splits, rows]) as one softmax
    over all of them; a query no split saw keeps out 0 and lse NO_KEYS."""
    if out.shape[2] == 1:
        return out[:, :, 0], lse[:, :, 0]
    top = jnp.max(lse, axis=2)
    seen = top > NO_KEYS
    w = jnp.where(seen[:, :, None], jnp.exp(lse - top[:, :, None]), 0.0)
    den = jnp.sum(w, axis=2)
    merged = jnp.sum(w[..., None] * out, axis=2) / jnp.where(seen, den, 1.0)[..., None]
    return merged, jnp.where(seen, top + jnp.log(jnp.where(seen, den, 1.0)), NO_KEYS)
