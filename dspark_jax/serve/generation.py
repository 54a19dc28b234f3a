"""One admitted request as the HTTP side follows it: the engine loop's `Request`, the queue its
callbacks post to (they run on the loop thread; the queue lives on the event loop), the text it
has produced so far and the envelope of its answer."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from dspark_jax.serve.convert import Prepared
from dspark_jax.serve.loop import Request
from dspark_jax.serve.protocol import Answer
from dspark_jax.serve.textstream import TextStream


@dataclass
class Generation:
    req: Request
    events: asyncio.Queue  # ("tokens", new ids) ... then ("finish", reason)
    text: TextStream
    prep: Prepared
    answer: Answer

    async def finished(self) -> str:
        """Waits for the request to end -> its reason (the token events are skipped)."""
        while True:
            kind, val = await self.events.get()
            if kind == "finish":
                return val
