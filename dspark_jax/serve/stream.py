"""Streaming answers: the server-sent events of a generation (`sse_events`) and the response
that sends them while watching the client (`EventStream`): a client that goes away has its
request cancelled at once instead of decoding on for nobody."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from fastapi.responses import Response

from dspark_jax.serve.generation import Generation
from dspark_jax.serve.protocol import DONE, event, failure, finish_reason

log = logging.getLogger(__name__)


async def client_gone(receive) -> None:
    """Returns when the client has gone (the body is already read: the next message is the end)."""
    while True:
        if (await receive())["type"] == "http.disconnect":
            return


async def sse_events(gen: Generation, ended: Callable[[int], None], cancel: Callable[[object], None]):
    """The events of `gen` as they come: a chunk per text delta, the finish chunk (and the usage
    chunk when asked for), an error event when it failed, then [DONE]. `ended(status)` is called
    once with how it ended; `cancel(req)` when its text cannot be decoded (it alone ends)."""
    req, text, answer = gen.req, gen.text, gen.answer
    chunk = answer.chunk_base(gen.prep.include_usage)
    try:
        while True:
            kind, val = await gen.events.get()
            if kind == "tokens":
                d = text.delta(req.tokens, final=False)
                if d:
                    yield event({**chunk, "choices": [answer.choice(d, None, True)]})
                continue
            if (bad := failure(val, req.error)) is not None:
                ended(bad[0])
                yield event({"error": {"message": bad[1], "type": "server_error"}})
                break
            d = text.delta(req.tokens, final=True)
            yield event({**chunk, "choices": [answer.choice(d, finish_reason(val), True)]})
            if gen.prep.include_usage:
                yield event({**chunk, "choices": [], "usage": answer.usage(len(req.tokens))})
            ended(200)
            break
    except Exception as e:  # decoding this request's text: it alone ends
        log.exception("request %s: streaming failed", req.id)
        cancel(req)
        ended(500)
        yield event({"error": {"message": f"internal error: {type(e).__name__}", "type": "server_error"}})
    yield DONE


class EventStream(Response):
    """Server-sent events from `chunks` (an async iterator of ready lines), watching the client:
    when it goes away the stream stops at once and `on_gone` runs (the request is cancelled)."""

    media_type = "text/event-stream"

    def __init__(self, chunks, on_gone):
        super().__init__(status_code=200)
        self.chunks, self.on_gone = chunks, on_gone

    async def __call__(self, scope, receive, send):
        gone = asyncio.ensure_future(client_gone(receive))
        it = self.chunks.__aiter__()
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                    (b"cache-control", b"no-cache")]})
            while True:
                nxt = asyncio.ensure_future(it.__anext__())
                await asyncio.wait({nxt, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():
                    nxt.cancel()
                    self.on_gone()
                    return
                try:
                    chunk = nxt.result()
                except StopAsyncIteration:
                    break
                await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # servers of ASGI spec 2.4 raise on a send to a client that left
            self.on_gone()
        finally:
            gone.cancel()
