"""The sampling settings type, importable without jax (commands build their defaults and
`--help` from it)."""

from __future__ import annotations

from typing import Any, NamedTuple


class SamplingParams(NamedTuple):
    """Sampling settings (a pytree: every field is a leaf, traced under jit)."""

    temperature: Any = 1.0
    top_k: Any = 0
    top_p: Any = 1.0
