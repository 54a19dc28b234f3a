"""The OpenAI-compatible HTTP surface: /v1/completions, /v1/chat/completions (streaming as
server-sent events), /v1/models, /health, /metrics. A request is authorised, read within the
size bound, parsed and tokenized on a worker thread (serve/convert.py), and only then turned
into a `loop.Request`; the engine never sees HTTP. Every refusal is an OpenAI-style error body
and is counted in /metrics by endpoint and status; a client that goes away, streamed or not,
has its request cancelled at once (counted as 499)."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from dspark_jax.serve.body import read_body
from dspark_jax.serve.convert import prepare
from dspark_jax.serve.errors import ApiError, BadRequest, error  # noqa: F401  (BadRequest: re-exported)
from dspark_jax.serve.loop import EngineLoop, InvalidRequest, QueueFull, Request

log = logging.getLogger(__name__)


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


# ---------------------------------------------------------------------- text

class TextStream:
    """Token ids -> text deltas: holds back an incomplete UTF-8 tail and anything that may still
    become a stop string; `cut` is where a stop string begins (then the request ends)."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tok, self.stops = tokenizer, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.sent = 0
        self.cut: int | None = None

    def text(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def find_stop(self, ids) -> int | None:
        """How many of `ids` to keep when a stop string appeared in their text, else None."""
        text = self.text(ids)
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if not hits:
            return None
        self.cut = min(hits)
        keep = len(ids)
        while keep > 0 and len(self.text(ids[: keep - 1])) >= self.cut:
            keep -= 1
        return keep

    def delta(self, ids, final: bool) -> str:
        text = self.text(ids)
        if self.cut is not None:
            text = text[: self.cut]
        end = len(text) if final else len(text.rstrip("\ufffd")) - self.hold
        out = text[self.sent: max(end, self.sent)]
        self.sent += len(out)
        return out


# ---------------------------------------------------------------------- client presence

async def _disconnected(receive) -> None:
    """Returns when the client has gone (the body is already read: the next message is the end)."""
    while True:
        if (await receive())["type"] == "http.disconnect":
            return


class EventStream(Response):
    """Server-sent events from `chunks` (an async iterator of ready lines), watching the client:
    when it goes away the stream stops at once and `on_gone` runs (the request is cancelled)."""

    media_type = "text/event-stream"

    def __init__(self, chunks, on_gone):
        super().__init__(status_code=200)
        self.chunks, self.on_gone = chunks, on_gone

    async def __call__(self, scope, receive, send):
        gone = asyncio.ensure_future(_disconnected(receive))
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


# ---------------------------------------------------------------------- app

def make_app(served: Served, access: Access | None = None, owns_loop: bool = True) -> FastAPI:
    """The ASGI app over `served`. `owns_loop`: stop the engine loop when the app shuts down."""
    access = access or Access()
    # parsing and tokenizing, off the event loop; two at a time bound their CPU. Not shut down with
    # the app: more than one server may serve it, and its idle threads cost nothing
    pool = ThreadPoolExecutor(2, thread_name_prefix="dspark-parse")

    @asynccontextmanager
    async def lifespan(app):
        yield
        if owns_loop:
            served.loop.stop()

    app = FastAPI(title="dspark_jax", lifespan=lifespan, docs_url="/docs" if access.docs else None,
                  redoc_url="/redoc" if access.docs else None, openapi_url="/openapi.json" if access.docs else None)
    if access.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        # any request header: the official clients send their own (the OpenAI JS client x-stainless-*)
        app.add_middleware(CORSMiddleware, allow_origins=list(access.cors_origins),
                           allow_methods=["GET", "HEAD", "POST"], allow_headers=["*"], max_age=600)
    app.state.limits = served.limits  # the read timeouts, for the server that runs the app
    metrics = served.metrics
    key = access.api_key.encode() if access.api_key else None

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):  # unknown routes and methods: the same error body as everything else
        return error(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request, exc):
        log.exception("unhandled error on %s", request.url.path)
        return error(500, f"internal error: {type(exc).__name__}")

    def count(endpoint, status):
        if metrics is not None:
            metrics.requests.labels(endpoint, str(status)).inc()

    def authorize(http: HTTPRequest) -> None:
        if key is None:
            return
        scheme, _, token = http.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key):
            raise ApiError("a valid API key is required: send 'Authorization: Bearer <key>'", status=401,
                           headers={"WWW-Authenticate": "Bearer"})

    def get(path):  # GET, and HEAD (the same answer without its body) kept out of the API docs
        def register(fn):
            app.add_api_route(path, fn, methods=["HEAD"], include_in_schema=False)
            return app.get(path)(fn)

        return register

    @get("/health")
    async def health():
        loop = served.loop
        if loop.error is not None:
            return JSONResponse({"status": "error", "error": repr(loop.error)}, status_code=500)
        if not loop.ready.is_set():
            return JSONResponse({"status": "starting", "detail": "compiling the engine's programs"}, status_code=503,
                                headers={"Retry-After": "1"})
        return {"status": "ok", "slots_in_use": loop.slots_in_use, "queue_depth": loop.queue_depth}

    @get("/metrics")
    async def get_metrics():
        body = metrics.render(served.loop.queue_depth, served.loop.slots_in_use) if metrics else b""
        return Response(body, media_type="text/plain; version=0.0.4")

    @get("/v1/models")
    async def models(http: HTTPRequest):
        try:
            authorize(http)
        except ApiError as e:
            return e.response()
        return {"object": "list",
                "data": [{"id": served.model, "object": "model", "created": 0, "owned_by": "dspark_jax"}]}

    async def admit(http: HTTPRequest, chat: bool):
        """-> (Request, its event queue, its TextStream, Prepared), or raises ApiError."""
        authorize(http)
        raw = await read_body(http, served.limits.max_body_bytes)
        aio = asyncio.get_running_loop()
        prep = await aio.run_in_executor(pool, prepare, served, raw, chat)
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
        req = Request(prep.ids, prep.max_new, prep.sampling, tuple(served.tokenizer.stop_ids),
                      seed=prep.seed or 0, key_data=prep.key, stop_text=text.find_stop if prep.stop else None,
                      on_tokens=lambda new: post(("tokens", new)), on_finish=lambda reason: post(("finish", reason)))
        try:
            served.loop.submit(req)
        except QueueFull as e:
            raise ApiError(f"the server is busy: {e}; retry", status=429, headers={"Retry-After": "1"}) from None
        except InvalidRequest as e:
            raise ApiError(str(e), param=e.param) from None
        except RuntimeError as e:
            raise ApiError(str(e), status=503) from None
        if metrics is not None:
            metrics.tokens_in.inc(len(prep.ids))
        return req, events, text, prep

    async def generate(http: HTTPRequest, chat: bool):
        endpoint = "chat" if chat else "completions"
        try:
            req, events, text, prep = await admit(http, chat)
        except ApiError as e:
            count(endpoint, e.status)
            return e.response()
        except ClientDisconnect:
            count(endpoint, 499)
            return Response(status_code=499)
        except Exception as e:
            log.exception("preparing a request failed")
            count(endpoint, 500)
            return error(500, f"internal error while reading the request: {type(e).__name__}")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"  # unique across restarts, as vLLM's
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        n_prompt = len(prep.ids)

        def usage():
            return {"prompt_tokens": n_prompt, "completion_tokens": len(req.tokens),
                    "total_tokens": n_prompt + len(req.tokens)}

        def finish_reason(reason):
            return "length" if reason in ("length", "context") else reason

        def choice(delta_text, reason, stream):
            if chat:
                key_ = "delta" if stream else "message"
                return {"index": 0, key_: {"role": "assistant", "content": delta_text}, "finish_reason": reason,
                        **({} if stream else {"logprobs": None})}
            return {"index": 0, "text": delta_text, "logprobs": None, "finish_reason": reason}

        def failed(reason) -> tuple[int, str] | None:
            if reason == "cancelled":
                return 503, "the request was cancelled: the server is shutting down"
            if reason == "error":
                return 500, f"the request failed in the engine: {req.error}"
            return None

        if not prep.stream:
            async def finished():
                while True:
                    kind, val = await events.get()
                    if kind == "finish":
                        return val

            fin = asyncio.ensure_future(finished())
            gone = asyncio.ensure_future(_disconnected(http.receive))
            try:
                await asyncio.wait({fin, gone}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                served.loop.cancel(req)
                raise
            finally:
                for t in (fin, gone):
                    if not t.done():
                        t.cancel()
            if not fin.done():
                served.loop.cancel(req)
                count(endpoint, 499)
                return Response(status_code=499)
            reason = fin.result()
            if (bad := failed(reason)) is not None:
                count(endpoint, bad[0])
                return error(bad[0], bad[1])
            try:
                body = {"id": rid, "object": obj, "created": created, "model": served.model,
                        "choices": [choice(text.delta(req.tokens, final=True), finish_reason(reason), False)],
                        "usage": usage()}
            except Exception as e:
                log.exception("request %s: building the answer failed", req.id)
                count(endpoint, 500)
                return error(500, f"the answer could not be built: {type(e).__name__}")
            if metrics is not None:
                metrics.tokens_out.inc(len(req.tokens))
            count(endpoint, 200)
            return body

        async def sse():
            # with include_usage (OpenAI's semantics): "usage" null on every chunk, then one last chunk with
            # no choices carrying it; without: no "usage" at all
            chunk = {"id": rid, "object": obj + ".chunk" if chat else obj, "created": created, "model": served.model,
                     **({"usage": None} if prep.include_usage else {})}
            try:
                while True:
                    kind, val = await events.get()
                    if kind == "tokens":
                        d = text.delta(req.tokens, final=False)
                        if d:
                            yield f"data: {json.dumps({**chunk, 'choices': [choice(d, None, True)]})}\n\n"
                        continue
                    if (bad := failed(val)) is not None:
                        count(endpoint, bad[0])
                        yield f"data: {json.dumps({'error': {'message': bad[1], 'type': 'server_error'}})}\n\n"
                        break
                    d = text.delta(req.tokens, final=True)
                    yield f"data: {json.dumps({**chunk, 'choices': [choice(d, finish_reason(val), True)]})}\n\n"
                    if prep.include_usage:
                        yield f"data: {json.dumps({**chunk, 'choices': [], 'usage': usage()})}\n\n"
                    if metrics is not None:
                        metrics.tokens_out.inc(len(req.tokens))
                    count(endpoint, 200)
                    break
            except Exception as e:  # decoding this request's text: it alone ends
                log.exception("request %s: streaming failed", req.id)
                served.loop.cancel(req)
                count(endpoint, 500)
                error_body = {'error': {'message': f'internal error: {type(e).__name__}', 'type': 'server_error'}}
                yield f"data: {json.dumps(error_body)}\n\n"
            yield "data: [DONE]\n\n"

        def on_gone():
            served.loop.cancel(req)
            count(endpoint, 499)

        return EventStream(sse(), on_gone)

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        return await generate(http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        return await generate(http, chat=True)

    return app
