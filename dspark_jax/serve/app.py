"""The OpenAI-compatible HTTP surface: /v1/completions, /v1/chat/completions (serve/handler.py),
/v1/models, /health, /metrics, with CORS, the API key and one error body for every refusal
(serve/errors.py). A request becomes a `loop.Request` only after it is authorised, read within
its size bound and parsed; the engine never sees HTTP."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark_jax.serve import auth
from dspark_jax.serve.connection import RefuseAmbiguousFraming
from dspark_jax.serve.errors import ApiError, error
from dspark_jax.serve.handler import Handler
from dspark_jax.serve.served import Access, Served

log = logging.getLogger(__name__)


def make_app(served: Served, access: Access | None = None, owns_loop: bool = True) -> FastAPI:
    """The ASGI app over `served`. `owns_loop`: stop the engine loop when the app shuts down."""
    access = access or Access()

    @asynccontextmanager
    async def lifespan(app):
        yield
        if owns_loop:
            served.loop.stop()

    # redirect_slashes off: Starlette's redirect of "/v1/models/" is an absolute URL built from the
    # client's Host header; such a path is a 404 naming the route instead (`_answer_errors`)
    app = FastAPI(title="dspark_jax", lifespan=lifespan, docs_url="/docs" if access.docs else None,
                  redoc_url="/redoc" if access.docs else None, openapi_url="/openapi.json" if access.docs else None,
                  redirect_slashes=False)
    if access.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        # any request header: the official clients send their own (the OpenAI JS client x-stainless-*)
        app.add_middleware(CORSMiddleware, allow_origins=list(access.cors_origins),
                           allow_methods=["GET", "HEAD", "POST"], allow_headers=["*"], max_age=600)
    app.add_middleware(RefuseAmbiguousFraming)  # added last: outermost, before CORS or any route
    app.state.limits = served.limits  # the read timeouts, for the server that runs the app
    _answer_errors(app)
    key = access.api_key.encode() if access.api_key else None

    def authorize(http: HTTPRequest) -> None:
        auth.authorize(http.headers, key)

    _add_info_routes(app, served, authorize)
    handler = Handler(served, authorize)

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        return await handler(http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        return await handler(http, chat=True)

    return app


def _answer_errors(app: FastAPI) -> None:
    """Unknown routes and methods, and errors nothing else caught: the same error body as every
    other refusal."""

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):
        if exc.status_code == 404 and exc.detail == "Not Found":
            return error(404, _not_found(app, request.scope.get("path", "")))
        return error(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request, exc):
        log.exception("unhandled error on %s", request.url.path)
        return error(500, f"internal error: {type(exc).__name__}")


def _not_found(app: FastAPI, path: str) -> str:
    """The 404 message for `path`: the route it names without its trailing slashes, if served."""
    shown = path if len(path) <= 200 else path[:197] + "..."
    message = f"no route at {shown}"
    bare = path.rstrip("/")
    if bare != path and any(getattr(r, "path", None) == bare for r in app.routes):
        message += f": the route is '{bare}' (without a trailing slash)"
    return message


def _add_info_routes(app: FastAPI, served: Served, authorize) -> None:
    """/health, /metrics and /v1/models, each on GET and HEAD."""
    metrics = served.metrics

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
