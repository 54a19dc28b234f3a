"""What the HTTP layer serves and under which rules: the engine loop with its tokenizer and model
name (`Served`), the bounds on one request (`Limits`) and who may call (`Access`). Plain data,
built by serve/server.py and read by the app, the handler and the startup line."""

from __future__ import annotations

from dataclasses import dataclass, field

from dspark_jax.serve.loop import EngineLoop


@dataclass
class Limits:
    """Bounds on one request, checked before any work that grows with it, and how long its
    client may take to send it (the connection is closed after that: serve/timeouts.py)."""

    max_body_bytes: int = 4 << 20
    max_prompt_chars: int = 65536  # checked before tokenizing (an estimate of the conversation: before rendering)
    max_messages: int = 2048  # chat messages, counted before they are validated (the OpenAI API's bound)
    max_json_depth: int = 32
    header_timeout: float = 30.0  # seconds from a request's first byte (or the connection) to its last header
    body_timeout: float = 60.0  # seconds from the last header to the last byte of the body


@dataclass
class Access:
    """Who may call: an API key for every /v1 route, browser origins allowed by CORS (none: no CORS
    headers at all), and whether the generated API docs are served."""

    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    docs: bool = False


@dataclass
class Served:
    loop: EngineLoop
    tokenizer: object
    chat_template: str | None
    model: str
    metrics: object = None
    limits: Limits = field(default_factory=Limits)
    about: dict = field(default_factory=dict)  # drafter, why that one, policy, cost table: for the startup line
