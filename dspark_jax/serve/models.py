"""Which models the server serves: the target (the embedded one unless named) and a drafter:
the one named, none ("none"), or, when none is named, one trained for this very target (its
recorded fingerprint matches) found where training puts it. A drafter trained for another
target is never picked up silently: it would draft garbage at full cost."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from dspark_jax.drafter.frozen import target_fingerprint
from dspark_jax.embedded.target import resolve_target_dir
from dspark_jax.io.drafter_dir import read_config
from dspark_jax.io.loading import load_drafter_like, load_models
from dspark_jax.serve import defaults

log = logging.getLogger(__name__)


@dataclass
class ServedModels:
    target: object  # LoadedTarget
    drafter: object | None
    drafter_dir: str | None
    why: str  # how the drafter was chosen, for the startup line


def find_drafter(target, lt) -> tuple[str | None, str]:
    """The drafter to serve when none is named: one trained for this very target (its recorded
    fingerprint matches), from where training puts it -> (directory or None, why)."""
    if target is None:
        candidates, where = [defaults.DEFAULT_DRAFTER], f"{defaults.DEFAULT_DRAFTER}"
    else:
        candidates, where = [Path(target) / "drafter", Path(target).parent / "drafter"], "in or beside the target"
    have = None
    for c in candidates:
        if not c.is_dir():
            continue
        try:
            _, fp = read_config(c)
        except (OSError, ValueError) as e:
            log.warning("not using %s as the drafter: %s", c, e)
            continue
        have = have or target_fingerprint(lt.model)
        if fp == have:
            return str(c), f"found {where}"
        log.warning("not using %s as the drafter: it was trained for another target (or records none)", c)
    return None, f"target-only: no drafter for this target {where}"


def load_served_models(target=None, drafter=None, dtype: str = "float32", mesh=None) -> ServedModels:
    """`target`: a checkpoint directory or None (the embedded target). `drafter`: a directory,
    "none", or None (find_drafter: one trained for this target, else none)."""
    find = drafter is None
    drafter = None if drafter == "none" else drafter
    why = "named" if drafter else "target-only (--drafter none)"
    lt, d, _ = load_models(resolve_target_dir(target), drafter, None, dtype, mesh)
    if find:
        drafter, why = find_drafter(target, lt)
        if drafter is not None:
            d = load_drafter_like(drafter, lt, mesh)
    return ServedModels(lt, d, drafter, why)
