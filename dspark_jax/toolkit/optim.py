"""The one optimiser recipe: AdamW after global-norm clipping, linear warm-up then cosine to zero.

Warm-up steps are passed explicitly: the drafter trainer rounds `warmup_frac * steps`, the
embedded target build rounds up, and each keeps its own numerics.
"""

from __future__ import annotations

import optax

__all__ = ["warmup_cosine_schedule", "adamw"]


def warmup_cosine_schedule(peak_lr: float, total_steps: int, warmup_steps: int, end_lr: float = 0.0) -> optax.Schedule:
    """0 -> `peak_lr` linearly over `warmup_steps`, then cosine to `end_lr` at `total_steps`
    (no warm-up: cosine from `peak_lr`)."""
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"warmup_steps ({warmup_steps}) must be in [0, total_steps={total_steps}]")
    if warmup_steps == 0:
        return optax.cosine_decay_schedule(peak_lr, total_steps, alpha=end_lr / peak_lr if peak_lr else 0.0)
    return optax.warmup_cosine_decay_schedule(0.0, peak_lr, warmup_steps, max(total_steps, warmup_steps + 1),
                                              end_value=end_lr)


def adamw(schedule, *, b1: float = 0.9, b2: float = 0.999, weight_decay: float = 0.0, clip_norm: float | None = 1.0,
          mask=None) -> optax.GradientTransformation:
    """AdamW (fp32 moments) after global-norm clipping; `schedule` may be a float or a schedule."""
    parts = [optax.clip_by_global_norm(clip_norm)] if clip_norm else []
    parts.append(optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay, mask=mask))
    return optax.chain(*parts)
