"""The OpenAI-compatible HTTP surface: /v1/completions, /v1/chat/completions (streaming as
server-sent events), /v1/models, /health, /metrics. Requests are validated here (400 with an
OpenAI-style error naming the field), turned into `loop.Request`s and answered from the loop's
callbacks; the engine never sees HTTP."""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.serve.loop import EngineLoop, QueueFull, Request

MAX_STOP_STRINGS = 4


@dataclass
class Served:
    loop: EngineLoop
    tokenizer: object
    chat_template: str | None
    model: str
    metrics: object = None


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def error(status: int, message: str, kind: str = "invalid_request_error", param=None, headers=None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}},
                        status_code=status, headers=headers)


# ---------------------------------------------------------------------- validation

def _number(body, name, default, lo=None, hi=None, integer=False):
    v = body.get(name, default)
    if v is None:
        return default
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if not ok or isinstance(v, bool):
        raise BadRequest(f"'{name}' must be {'an integer' if integer else 'a number'}, got {json.dumps(v)}", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise BadRequest(f"'{name}' must be {rng}, got {v}", name)
    return v


def _stops(body) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    v = [v] if isinstance(v, str) else v
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v) or len(v) > MAX_STOP_STRINGS:
        raise BadRequest(f"'stop' must be a non-empty string or a list of up to {MAX_STOP_STRINGS} of them", "stop")
    return v


def parse_request(served: Served, body, chat: bool) -> tuple[list[int], dict]:
    """-> (prompt ids, settings); raises BadRequest naming the field."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if body.get("model") != served.model:
        raise BadRequest(f"model {json.dumps(body.get('model'))} is not served here; this server serves "
                         f"'{served.model}' (GET /v1/models)", "model")
    tok = served.tokenizer
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise BadRequest("'messages' must be a non-empty list of {role, content} objects", "messages")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise BadRequest(f"messages[{i}] must be an object with string 'role' and 'content'", "messages")
        from dspark_jax.data.chat import render_prompt

        kwargs = body.get("chat_template_kwargs") or {}  # as vLLM / SGLang, e.g. {"enable_thinking": false}
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs) \
                or {"messages", "add_generation_prompt", "tokenizer", "template"} & set(kwargs):
            raise BadRequest("'chat_template_kwargs' must be an object of template variables", "chat_template_kwargs")
        ids = render_prompt(tok, [{"role": m["role"], "content": m["content"]} for m in msgs], served.chat_template,
                            **kwargs)
        field_name = "messages"
    else:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            p = p[0]
        if isinstance(p, str) and p:
            ids = tok.encode(p)
        elif isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            if min(p) < 0 or max(p) >= tok.vocab_size:
                raise BadRequest(f"'prompt' token ids must be in 0..{tok.vocab_size - 1}", "prompt")
            ids = list(p)
        else:
            raise BadRequest("'prompt' must be a non-empty string (or a list of token ids)", "prompt")
        field_name = "prompt"
    eng = served.loop.engine
    room = eng.S - eng.G - 2
    min_len = 1 if eng.kind is None else eng.kind.min_prompt_len
    if len(ids) > room - 1:
        raise BadRequest(f"the {field_name} has {len(ids)} tokens; this server's context holds {room} "
                         f"(prompt + at least one new token): shorten it", field_name)
    if len(ids) < min_len:
        raise BadRequest(f"the {field_name} has {len(ids)} tokens; the drafter needs at least {min_len}", field_name)
    _number(body, "n", 1, 1, 1, integer=True)  # one choice per request
    max_tokens = _number(body, "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens",
                         16 if not chat else min(512, room - len(ids)), 1, integer=True)
    if len(ids) + max_tokens > room:
        raise BadRequest(f"max_tokens {max_tokens} + the {len(ids)} prompt tokens exceed this server's context of "
                         f"{room} tokens: ask for at most {room - len(ids)}", "max_tokens")
    if eng.pages is not None and eng.pages_to_reserve(len(ids), max_tokens) > eng.pages.num_pages:
        fit = eng.pages.num_pages * eng.pages.page_size - len(ids) - eng.G
        raise BadRequest(f"max_tokens {max_tokens} + the {len(ids)} prompt tokens need more KV cache than this server's "
                         f"whole page pool ({eng.pages.num_pages} pages of {eng.pages.page_size} tokens): ask for at "
                         f"most {max(fit, 0)}", "max_tokens")
    settings = {
        "max_new": int(max_tokens),
        "sampling": SamplingParams(float(_number(body, "temperature", 1.0, 0.0)),
                                   max(0, int(_number(body, "top_k", 0, -1, integer=True))),  # -1 = off, as vLLM
                                   float(_number(body, "top_p", 1.0, 0.0, 1.0))),
        "stop": _stops(body),
        "seed": _number(body, "seed", None, integer=True),
        "stream": bool(body.get("stream", False)),
        "include_usage": bool((body.get("stream_options") or {}).get("include_usage", False)),
    }
    if settings["sampling"].top_p <= 0:
        raise BadRequest("'top_p' must be > 0", "top_p")
    return ids, settings


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


# ---------------------------------------------------------------------- app

def make_app(served: Served) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        yield
        served.loop.stop()

    app = FastAPI(title="dspark_jax", lifespan=lifespan)
    metrics = served.metrics

    def count(endpoint, status):
        if metrics is not None:
            metrics.requests.labels(endpoint, str(status)).inc()

    @app.get("/health")
    async def health():
        if served.loop.error is not None:
            return JSONResponse({"status": "error", "error": repr(served.loop.error)}, status_code=500)
        return {"status": "ok", "slots_in_use": served.loop.slots_in_use, "queue_depth": served.loop.queue_depth}

    @app.get("/metrics")
    async def get_metrics():
        body = metrics.render(served.loop.queue_depth, served.loop.slots_in_use) if metrics else b""
        return Response(body, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.model, "object": "model", "created": 0, "owned_by": "dspark_jax"}]}

    async def generate(http: HTTPRequest, chat: bool):
        endpoint = "chat" if chat else "completions"
        try:
            body = json.loads(await http.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            count(endpoint, 400)
            return error(400, f"the request body is not valid JSON ({e})")
        try:
            ids, st = parse_request(served, body, chat)
        except BadRequest as e:
            count(endpoint, 400)
            return error(400, str(e), param=e.param)
        if served.loop.error is not None:
            count(endpoint, 503)
            return error(503, f"the engine stopped: {served.loop.error!r}", "server_error")
        aio = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        text = TextStream(served.tokenizer, st["stop"])
        req = Request(ids, st["max_new"], st["sampling"], tuple(served.tokenizer.stop_ids),
                      seed=st["seed"] if st["seed"] is not None else 0,
                      stop_text=text.find_stop if st["stop"] else None,
                      on_tokens=lambda new: aio.call_soon_threadsafe(events.put_nowait, ("tokens", new)),
                      on_finish=lambda reason: aio.call_soon_threadsafe(events.put_nowait, ("finish", reason)))
        if st["seed"] is None:
            req.seed = req.id
        try:
            served.loop.submit(req)
        except QueueFull as e:
            count(endpoint, 429)
            return error(429, f"the server is busy: {e}; retry", "rate_limit_error", headers={"Retry-After": "1"})
        if metrics is not None:
            metrics.tokens_in.inc(len(ids))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{req.id}"
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"

        def usage():
            return {"prompt_tokens": len(ids), "completion_tokens": len(req.tokens),
                    "total_tokens": len(ids) + len(req.tokens)}

        def finish_reason(reason):
            return "length" if reason in ("length", "context") else reason

        def choice(delta_text, reason, stream):
            if chat:
                key = "delta" if stream else "message"
                return {"index": 0, key: {"role": "assistant", "content": delta_text}, "finish_reason": reason,
                        **({} if stream else {"logprobs": None})}
            return {"index": 0, "text": delta_text, "logprobs": None, "finish_reason": reason}

        if not st["stream"]:
            try:
                while True:
                    try:
                        kind, val = await asyncio.wait_for(events.get(), 0.5)
                    except asyncio.TimeoutError:
                        if await http.is_disconnected():
                            served.loop.cancel(req)
                            count(endpoint, 499)
                            return Response(status_code=499)
                        continue
                    if kind == "finish":
                        break
            except asyncio.CancelledError:
                served.loop.cancel(req)
                raise
            if val == "cancelled":
                count(endpoint, 503)
                return error(503, "the request was cancelled: the server is shutting down", "server_error")
            if metrics is not None:
                metrics.tokens_out.inc(len(req.tokens))
            count(endpoint, 200)
            return {"id": rid, "object": obj, "created": created, "model": served.model,
                    "choices": [choice(text.delta(req.tokens, final=True), finish_reason(val), False)],
                    "usage": usage()}

        async def sse():
            chunk = {"id": rid, "object": obj + ".chunk" if chat else obj, "created": created, "model": served.model}
            done = False
            try:
                while True:
                    kind, val = await events.get()
                    if kind == "tokens":
                        d = text.delta(req.tokens, final=False)
                        if d:
                            yield f"data: {json.dumps({**chunk, 'choices': [choice(d, None, True)]})}\n\n"
                        continue
                    done = True
                    if val == "cancelled":
                        yield f"data: {json.dumps({'error': {'message': 'cancelled: the server is shutting down', 'type': 'server_error'}})}\n\n"
                        break
                    d = text.delta(req.tokens, final=True)
                    last = {**chunk, "choices": [choice(d, finish_reason(val), True)], "usage": usage()}
                    yield f"data: {json.dumps(last)}\n\n"
                    if st["include_usage"]:
                        yield f"data: {json.dumps({**chunk, 'choices': [], 'usage': usage()})}\n\n"
                    if metrics is not None:
                        metrics.tokens_out.inc(len(req.tokens))
                    break
                yield "data: [DONE]\n\n"
            finally:
                if not done:  # the client went away mid-stream: free the slot
                    served.loop.cancel(req)

        count(endpoint, 200)
        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        return await generate(http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        return await generate(http, chat=True)

    return app
