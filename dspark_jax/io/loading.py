"""A target checkpoint and a drafter trained for it, loaded together as the inference commands and
the server use them: the drafter in the target's dtype, both on the same mesh, and the decoding
mode checked against the drafter's kind (a mismatch is a user error, not a shape error later)."""

from __future__ import annotations

import jax.numpy as jnp

from dspark_jax.io.drafter_dir import load as load_drafter
from dspark_jax.io.hf import load_target

__all__ = ["load_models", "load_drafter_like"]


def load_drafter_like(drafter_dir, target, mesh=None):
    """The drafter in `drafter_dir`, computing in `target`'s dtype (its parameters as stored)."""
    tdt = target.model.embed[...].dtype
    return load_drafter(drafter_dir, target, dtype=None if tdt == jnp.float32 else tdt, mesh=mesh)


def load_models(target_dir, drafter_dir=None, mode=None, dtype: str = "float32", mesh=None):
    """(LoadedTarget, drafter or None, mode) for any drafter kind saved by the trainer.
    `dtype` is the target's ("auto": as stored); the drafter computes in the same dtype. With a
    `mesh` the target is read straight onto it and the drafter laid out by the rules table.
    `target_dir` is a checkpoint directory (the commands resolve the embedded default:
    `embedded.resolve_target_dir`)."""
    if target_dir is None:
        raise ValueError("load_models needs a target directory (embedded.resolve_target_dir gives the default)")
    target = load_target(target_dir, dtype=dtype, mesh=mesh)
    drafter = load_drafter_like(drafter_dir, target, mesh) if drafter_dir else None
    kind = drafter.dcfg.kind if drafter is not None else "ar"
    mode = mode or kind
    if mode == "ar":
        drafter = None
    elif drafter is None:
        raise ValueError(f"--mode {mode} needs --drafter DIR (a drafter trained with python -m dspark_jax.train)")
    elif kind != mode:
        raise ValueError(f"--mode {mode} but the drafter in {drafter_dir} is a {kind} drafter")
    return target, drafter, mode
