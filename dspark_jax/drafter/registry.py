"""The drafter kinds, registered once: name -> adapter (drafter/kinds/).

Everything that depends on the kind (building, the training loss, the engine's prefill /
draft / update, memory planning) goes through the adapter found here; adding a kind is a
new file under `drafter/kinds/` and one entry in `KINDS` (plus its name in `names.KIND_NAMES`, which
the config schema and the commands read without importing jax).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from dspark_jax.drafter.kinds.base import DrafterKind
from dspark_jax.drafter.kinds.block import DFLASH, DSPARK
from dspark_jax.drafter.kinds.eagle3 import EAGLE3
from dspark_jax.drafter.kinds.mtp1 import MTP1
from dspark_jax.drafter.model import DrafterConfigError

__all__ = ["KINDS", "DrafterConfigError", "get_kind", "kind_of", "resolve", "build"]

KINDS: dict[str, DrafterKind] = {k.name: k for k in (DSPARK, DFLASH, EAGLE3, MTP1)}


def get_kind(name: str) -> DrafterKind:
    if name not in KINDS:
        raise DrafterConfigError(f"unknown drafter.kind '{name}'; choose one of: {', '.join(KINDS)}")
    return KINDS[name]


def kind_of(drafter) -> DrafterKind:
    """The adapter of a drafter module."""
    for kind in KINDS.values():
        if kind.owns(drafter):
            return kind
    raise DrafterConfigError(f"unknown drafter type {type(drafter).__name__}: build drafters with "
                             "dspark_jax.drafter.registry.build")


def resolve(target_cfg, dcfg):
    """The fully resolved drafter config of any kind (what checkpoints record)."""
    return get_kind(dcfg.kind).resolve(target_cfg, dcfg)


def build(target_cfg, dcfg, *, rngs: nnx.Rngs, param_dtype=jnp.float32, dtype=None, ttt_steps: int = 7):
    """A freshly initialised drafter of `dcfg.kind`; `.dcfg` holds the resolved config."""
    kind = get_kind(dcfg.kind)
    d = kind.resolve(target_cfg, dcfg)
    m = kind.build(target_cfg, d, rngs=rngs, param_dtype=param_dtype, dtype=dtype, ttt_steps=ttt_steps)
    m.dcfg = d
    if not hasattr(m, "target_fingerprint"):
        m.target_fingerprint = None
    return m
