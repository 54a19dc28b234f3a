"""The engine's errors: all of them ValueErrors a caller can show as they are."""

from __future__ import annotations

from dspark_jax.engine.page_alloc import OutOfPagesError

__all__ = ["EngineError", "EngineConfigError", "InvalidRequest", "PoolTooSmall"]


class EngineError(ValueError):
    """A setting or a request this engine cannot run; the message says what to change."""


class EngineConfigError(EngineError):
    """An `EngineConfig` field out of range (the message names the field)."""


class InvalidRequest(EngineError):
    """A request outside the engine's ranges; `param` names the field as the caller calls it."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class PoolTooSmall(InvalidRequest, OutOfPagesError):
    """A request whose reach exceeds the whole KV page pool: it could never run."""
