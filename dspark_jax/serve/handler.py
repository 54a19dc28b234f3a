"""The generation handler behind /v1/completions and /v1/chat/completions: authorise, read the
body within its bound, parse and tokenize it on a worker thread (serve/convert.py), submit it to
the engine loop, then answer: one JSON object when it finishes, or server-sent events as it goes
(serve/stream.py). Every outcome is counted in /metrics by endpoint and status; a client that
goes away, streamed or not, has its request cancelled at once (counted as 499)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request as HTTPRequest
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from dspark_jax.serve.body import read_body
from dspark_jax.serve.convert import Prepared, prepare
from dspark_jax.serve.errors import ApiError, error
from dspark_jax.serve.generation import Generation
from dspark_jax.serve.loop import InvalidRequest, QueueFull, Request
from dspark_jax.serve.protocol import Answer, failure
from dspark_jax.serve.served import Served
from dspark_jax.serve.stream import EventStream, client_gone, sse_events
from dspark_jax.serve.textstream import TextStream

log = logging.getLogger(__name__)


class Handler:
    """Answers generation requests for `served`; `authorize(http)` raises ApiError for a caller
    without access."""

    def __init__(self, served: Served, authorize: Callable[[HTTPRequest], None]):
        self.served, self.authorize, self.metrics = served, authorize, served.metrics
        # parsing and tokenizing, off the event loop; two at a time bound their CPU. Not shut down with
        # the app: more than one server may serve it, and its idle threads cost nothing
        self.pool = ThreadPoolExecutor(2, thread_name_prefix="dspark-parse")

    def count(self, endpoint: str, status: int) -> None:
        if self.metrics is not None:
            self.metrics.requests.labels(endpoint, str(status)).inc()

    def ended(self, endpoint: str, status: int, req: Request) -> None:
        """A request answered with `status` (its tokens count as output when it succeeded)."""
        if status == 200 and self.metrics is not None:
            self.metrics.tokens_out.inc(len(req.tokens))
        self.count(endpoint, status)

    async def __call__(self, http: HTTPRequest, chat: bool):
        endpoint = "chat" if chat else "completions"
        try:
            gen = await self.admit(http, chat)
        except ApiError as e:
            self.count(endpoint, e.status)
            return e.response()
        except ClientDisconnect:
            self.count(endpoint, 499)
            return Response(status_code=499)
        except Exception as e:
            log.exception("preparing a request failed")
            self.count(endpoint, 500)
            return error(500, f"internal error while reading the request: {type(e).__name__}")
        if gen.prep.stream:
            return self.stream(gen, endpoint)
        return await self.complete(gen, endpoint, http)

    # ------------------------------------------------------------------ admitting
    async def admit(self, http: HTTPRequest, chat: bool) -> Generation:
        """The request read, prepared and queued in the engine loop, or ApiError."""
        self.authorize(http)
        served = self.served
        raw = await read_body(http, served.limits.max_body_bytes)
        aio = asyncio.get_running_loop()
        prep = await aio.run_in_executor(self.pool, prepare, served, raw, chat)
        del raw
        if served.loop.error is not None:
            raise ApiError(f"the engine stopped: {served.loop.error!r}", status=503)
        events: asyncio.Queue = asyncio.Queue()

        def post(item):
            try:
                aio.call_soon_threadsafe(events.put_nowait, item)
            except RuntimeError:  # the event loop closed (shutdown): nobody is waiting
                pass

        text = TextStream(served.tokenizer, prep.stop)
        req = self.request(prep, text, post)
        self.submit(req)
        if self.metrics is not None:
            self.metrics.tokens_in.inc(len(prep.ids))
        return Generation(req, events, text, prep, Answer(chat, served.model, len(prep.ids)))

    def request(self, prep: Prepared, text: TextStream, post: Callable[[tuple], None]) -> Request:
        """The engine loop's request for `prep`: its callbacks post to the event loop."""
        return Request(prep.ids, prep.max_new, prep.sampling, tuple(self.served.tokenizer.stop_ids),
                       seed=prep.seed or 0, key_data=prep.key, stop_text=text.find_stop if prep.stop else None,
                       on_tokens=lambda new: post(("tokens", new)), on_finish=lambda reason: post(("finish", reason)))

    def submit(self, req: Request) -> None:
        """Queue `req`; the loop's refusals as the API's statuses."""
        try:
            self.served.loop.submit(req)
        except QueueFull as e:
            raise ApiError(f"the server is busy: {e}; retry", status=429, headers={"Retry-After": "1"}) from None
        except InvalidRequest as e:
            raise ApiError(str(e), param=e.param) from None
        except RuntimeError as e:
            raise ApiError(str(e), status=503) from None

    # ------------------------------------------------------------------ answering
    async def complete(self, gen: Generation, endpoint: str, http: HTTPRequest):
        """The whole answer once the request finishes; 499 (and the request cancelled) when the
        client goes first."""
        loop, req = self.served.loop, gen.req
        fin = asyncio.ensure_future(gen.finished())
        gone = asyncio.ensure_future(client_gone(http.receive))
        try:
            await asyncio.wait({fin, gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            loop.cancel(req)
            raise
        finally:
            for t in (fin, gone):
                if not t.done():
                    t.cancel()
        if not fin.done():
            loop.cancel(req)
            self.count(endpoint, 499)
            return Response(status_code=499)
        reason = fin.result()
        if (bad := failure(reason, req.error)) is not None:
            self.count(endpoint, bad[0])
            return error(bad[0], bad[1])
        try:
            body = gen.answer.completion(gen.text.delta(req.tokens, final=True), reason, len(req.tokens))
        except Exception as e:
            log.exception("request %s: building the answer failed", req.id)
            self.count(endpoint, 500)
            return error(500, f"the answer could not be built: {type(e).__name__}")
        self.ended(endpoint, 200, req)
        return body

    def stream(self, gen: Generation, endpoint: str) -> EventStream:
        loop, req = self.served.loop, gen.req

        def on_gone():
            loop.cancel(req)
            self.count(endpoint, 499)

        events = sse_events(gen, lambda status: self.ended(endpoint, status, req), loop.cancel)
        return EventStream(events, on_gone)
