"""The API key check of every /v1 route: `Authorization: Bearer <key>`, compared in constant time
(a timing difference would tell an attacker how much of a guessed key is right)."""

from __future__ import annotations

import hmac

from dspark_jax.serve.errors import ApiError


def authorize(headers, key: bytes | None) -> None:
    """Nothing when no key is set or `headers` carry it; else a 401 ApiError."""
    if key is None:
        return
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key):
        raise ApiError("a valid API key is required: send 'Authorization: Bearer <key>'", status=401,
                       headers={"WWW-Authenticate": "Bearer"})
