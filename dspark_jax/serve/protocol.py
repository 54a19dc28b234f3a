"""The OpenAI API's answers: the completion object, its stream chunks, choices, usage and finish
reasons, for /v1/completions ("text_completion") and /v1/chat/completions ("chat.completion").
The request side of the protocol is serve/schema.py (what a body may hold) and serve/convert.py
(a body -> what the engine takes); this module only shapes what goes back."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

DONE = "data: [DONE]\n\n"  # the last server-sent event of every stream


def event(obj) -> str:
    """One server-sent event carrying `obj` as JSON."""
    return f"data: {json.dumps(obj)}\n\n"


def finish_reason(reason: str) -> str:
    """The engine's reason as the API names it (running out of context is "length" there too)."""
    return "length" if reason in ("length", "context") else reason


def failure(reason: str, error: str | None) -> tuple[int, str] | None:
    """(status, message) when a request ended without an answer (shutdown, engine error), else None."""
    if reason == "cancelled":
        return 503, "the request was cancelled: the server is shutting down"
    if reason == "error":
        return 500, f"the request failed in the engine: {error}"
    return None


@dataclass
class Answer:
    """The envelope of one generation's answer: its id (unique across restarts, as vLLM's), object
    kind, creation time and model, and the usage of a prompt of `n_prompt` tokens."""

    chat: bool
    model: str
    n_prompt: int
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = ""

    def __post_init__(self):
        self.id = self.id or f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def usage(self, n_out: int) -> dict:
        return {"prompt_tokens": self.n_prompt, "completion_tokens": n_out, "total_tokens": self.n_prompt + n_out}

    def choice(self, text: str, reason: str | None, stream: bool) -> dict:
        if self.chat:
            key = "delta" if stream else "message"
            return {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": reason,
                    **({} if stream else {"logprobs": None})}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}

    def completion(self, text: str, reason: str, n_out: int) -> dict:
        """The whole answer of a request that did not stream."""
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [self.choice(text, finish_reason(reason), False)], "usage": self.usage(n_out)}

    def chunk_base(self, include_usage: bool) -> dict:
        """The fields every stream chunk carries. With include_usage (OpenAI's semantics): "usage"
        null on every chunk, then one last chunk with no choices carrying it; without: no "usage"."""
        return {"id": self.id, "object": self.object + ".chunk" if self.chat else self.object,
                "created": self.created, "model": self.model, **({"usage": None} if include_usage else {})}
