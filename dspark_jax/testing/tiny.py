"""Tiny random targets and drafters of every kind for the engine tests and smoke benchmarks: the
library's random models (drafter/random_models.py) under the names the tests use, and the kinds
to parametrize over."""

from __future__ import annotations

from dspark_jax.drafter import registry
from dspark_jax.drafter.random_models import random_drafter as tiny_drafter
from dspark_jax.drafter.random_models import random_target as tiny_target
from dspark_jax.drafter.random_models import tiny_config

__all__ = ["tiny_config", "tiny_target", "tiny_drafter", "KINDS"]

KINDS = tuple(registry.KINDS)
