"""Minimal training utilities shared by the embedded-target pretraining and the drafter trainer.

Small on purpose: an optax AdamW with the DSpark schedule (linear warm-up, cosine to 0,
global-norm clipping), an orbax checkpoint helper that stores plain (pure-dict) pytrees
so checkpoints do not depend on NNX object layout, a tqdm progress bar that is a no-op
when disabled (tests, non-interactive logs), and an append-only JSONL metrics logger.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Iterable

import jax.numpy as jnp
import numpy as np
import optax

__all__ = ["warmup_cosine_schedule", "adamw", "Checkpointer", "progress_bar", "JsonlLogger",
           "lm_loss"]


def warmup_cosine_schedule(peak_lr: float, total_steps: int, warmup_steps: int | None = None,
                           warmup_frac: float = 0.04, end_lr: float = 0.0) -> optax.Schedule:
    """0 -> ``peak_lr`` linearly over the warm-up, then cosine to ``end_lr`` at ``total_steps``.

    Warm-up defaults to 4 % of the steps (the DSpark reference recipe), at least 1 step.
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if warmup_steps is None:
        warmup_steps = max(1, int(math.ceil(warmup_frac * total_steps)))
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"warmup_steps ({warmup_steps}) must be in [0, total_steps={total_steps}]")
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=peak_lr, warmup_steps=warmup_steps,
        decay_steps=total_steps, end_value=end_lr)


def adamw(schedule, *, b1: float = 0.9, b2: float = 0.999, weight_decay: float = 0.0,
          clip_norm: float | None = 1.0, mask=None) -> optax.GradientTransformation:
    """AdamW (fp32 moments) after global-norm clipping; ``schedule`` may be a float or a schedule."""
    parts = [optax.clip_by_global_norm(clip_norm)] if clip_norm else []
    parts.append(optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay, mask=mask))
    return optax.chain(*parts)


def lm_loss(logits, targets, weights):
    """Mean next-token cross entropy over positions with ``weights`` > 0 (fp32)."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    w = weights.astype(jnp.float32)
    return (ce * w).sum() / jnp.maximum(w.sum(), 1.0)


class Checkpointer:
    """Orbax checkpoints of plain pytrees (dicts of arrays) keyed by step.

    Store ``nnx.to_pure_dict(nnx.state(...))`` and optimizer states as pure dicts plus a
    small JSON-able ``meta``; restore gives the same structure back (as numpy/jax arrays).
    """

    def __init__(self, directory, max_to_keep: int = 2):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, tree: dict, meta: dict | None = None, wait: bool = True) -> None:
        ocp = self._ocp
        args = {"tree": ocp.args.StandardSave(tree)}
        if meta is not None:
            args["meta"] = ocp.args.JsonSave(meta)
        self.manager.save(step, args=ocp.args.Composite(**args))
        if wait:
            self.manager.wait_until_finished()

    def restore(self, step: int | None = None, target: dict | None = None) -> tuple[int, dict, dict | None]:
        """(step, tree, meta) of ``step`` (default: latest). ``target`` gives the abstract structure."""
        ocp = self._ocp
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        std = ocp.args.StandardRestore(target) if target is not None else ocp.args.StandardRestore()
        args = {"tree": std}
        if (self.directory / str(step) / "meta").exists():
            args["meta"] = ocp.args.JsonRestore()
        out = self.manager.restore(step, args=ocp.args.Composite(**args))
        return step, out["tree"], out.get("meta") if "meta" in args else None

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def progress_bar(iterable: Iterable | None = None, *, total: int | None = None, desc: str = "",
                 enabled: bool = True, unit: str = "it", initial: int = 0):
    """A tqdm bar, or a silent stand-in with the same ``update``/``set_postfix``/``close`` API."""
    if enabled:
        from tqdm.auto import tqdm

        return tqdm(iterable, total=total, desc=desc, unit=unit, initial=initial, dynamic_ncols=True)
    return _Silent(iterable)


class _Silent:
    def __init__(self, iterable=None):
        self._it = iterable

    def __iter__(self):
        return iter(self._it if self._it is not None else ())

    def update(self, n=1):
        pass

    def set_postfix(self, *a, **k):
        pass

    def set_description(self, *a, **k):
        pass

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class JsonlLogger:
    """Append one JSON object per line (with wall time); ``path=None`` logs nowhere."""

    def __init__(self, path=None):
        self.path = None if path is None else Path(path)
        self._fh = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a", encoding="utf-8")
        self._t0 = time.time()

    def log(self, record: dict[str, Any]) -> None:
        if self._fh is None:
            return
        rec = {"time": round(time.time() - self._t0, 3), **{k: _plain(v) for k, v in record.items()}}
        self._fh.write(json.dumps(rec) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _plain(v):
    if isinstance(v, (np.generic, np.ndarray)) or hasattr(v, "dtype"):
        a = np.asarray(v)
        return a.item() if a.ndim == 0 else a.tolist()
    return v


def read_jsonl(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
