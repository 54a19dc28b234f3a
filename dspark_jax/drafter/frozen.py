"""Frozen target weights held by the drafter (embedding [V,H], LM head kernel [H,V]).

They are an `nnx.Variable` subtype that is *not* `nnx.Param`, so `nnx.state(d, nnx.Param)`,
`nnx.grad(..., wrt=nnx.Param)` and `nnx.Optimizer(d, tx, wrt=nnx.Param)` never see them:
no gradients, no Adam moments, and no copy in drafter checkpoints (they are re-attached
from the target at load time, which the recorded target fingerprint checks).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from dspark_jax.parallel.sharding import host_arrays

# Rows of the embedding hashed into the fingerprint (evenly spaced): cheap at 152k x 5k,
# and any other target differs in them.
_FINGERPRINT_ROWS = 1024


# one program for the sampled rows (indexing eagerly would compile one per primitive, each process)
_take_rows = jax.jit(lambda embed, rows: embed[rows])


class Frozen(nnx.Variable):
    """A weight copied from the frozen target; never trained, never checkpointed with the drafter."""


class TargetMismatchError(ValueError):
    pass


def _unwrap_target(target):
    """Accept a TargetModel or anything with a `.model` TargetModel (hf_import.LoadedTarget)."""
    return target if hasattr(target, "lm_head_weight") else target.model


def target_fingerprint(target) -> str:
    """Hash of the target's architecture and a sample of its embedding rows.

    The embedding is hashed as bfloat16, so the same checkpoint loaded in float32 or
    bfloat16 gives the same fingerprint.
    """
    target = _unwrap_target(target)
    cfg = dataclasses.asdict(target.cfg)
    for k in ("max_position_embeddings", "bos_token_id", "eos_token_id"):
        cfg.pop(k, None)
    embed = target.embed[...]
    rows = np.unique(np.linspace(0, embed.shape[0] - 1, min(embed.shape[0], _FINGERPRINT_ROWS)).astype(np.int64))

    sample = host_arrays(_take_rows(embed, rows)).astype(np.float32).astype(ml_dtypes.bfloat16)
    h = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode())
    h.update(np.ascontiguousarray(sample).tobytes())
    return h.hexdigest()[:16]


def attach_target(drafter, target) -> None:
    """Copy the target's embedding and LM head into the drafter's Frozen variables.

    Shapes are checked; the arrays are shared with the target, in its dtype. Also records
    `drafter.target_fingerprint`, which checkpoints carry so a drafter is never silently
    paired with another target.
    """
    target = _unwrap_target(target)
    want_e, want_h = drafter.embed.shape, drafter.lm_head.shape
    embed, head = target.embed[...], target.lm_head_weight()
    if tuple(embed.shape) != tuple(want_e) or tuple(head.shape) != tuple(want_h):
        raise TargetMismatchError(
            f"target embedding {tuple(embed.shape)} / LM head {tuple(head.shape)} do not fit the drafter's "
            f"{tuple(want_e)} / {tuple(want_h)}: build the drafter from this target's ModelConfig"
        )
    # the target's own arrays, in its dtype and layout: no second copy of the two largest weights
    # (the drafter casts them to its compute dtype inside its step, an exact widening from bf16)
    drafter.embed.set_value(embed)
    drafter.lm_head.set_value(head)
    drafter.target_fingerprint = target_fingerprint(target)


def check_target(fingerprint: str | None, target, what: str = "drafter") -> None:
    """Raise if `fingerprint` (recorded with a drafter) does not belong to `target`."""
    if fingerprint is None:
        return
    have = target_fingerprint(target)
    if have != fingerprint:
        raise TargetMismatchError(
            f"{what} was trained for a different target (fingerprint {fingerprint}, this target {have}): "
            "load it with the target checkpoint it was trained for"
        )


def trainable_state(drafter) -> nnx.State:
    """The drafter's trainable parameters only (nnx.Param): what gradients and optimisers see."""
    return nnx.state(drafter, nnx.Param)


def drafter_checkpoint_state(drafter) -> dict:
    """What a drafter checkpoint holds: Params (pure dict, no Frozen leaves) + the target fingerprint."""
    return {
        "params": nnx.to_pure_dict(trainable_state(drafter)),
        "target_fingerprint": getattr(drafter, "target_fingerprint", None),
    }
