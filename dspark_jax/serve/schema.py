"""The request bodies of /v1/completions and /v1/chat/completions as strict pydantic models.

Strict: no coercion (`"stream": "false"` is not a boolean, `5.0` is not a token count), unknown
fields refused by name, numbers bounded to what the engine takes. Fields of the OpenAI API this
server cannot honour (penalties, logit bias, logprobs, tools, ...) are accepted only at their
neutral value (the one that changes nothing) and otherwise refused by name, so no setting is
silently ignored. `validate` turns pydantic's errors into one 400 naming the field."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    model_validator,
)

from dspark_jax.serve.errors import BadRequest

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 63 - 1  # the OpenAI API's seed: a signed 64-bit integer

# field -> the values that change nothing (accepted; anything else is refused by name)
NEUTRAL: dict[str, tuple] = {
    "frequency_penalty": (0,), "presence_penalty": (0,), "repetition_penalty": (1,), "logit_bias": ({},),
    "min_p": (0,), "min_tokens": (0,), "ignore_eos": (False,), "best_of": (1,), "echo": (False,), "suffix": ("",),
    "logprobs": (False,), "top_logprobs": (0,), "tools": ([],), "tool_choice": ("none",), "functions": ([],),
    "function_call": ("none",), "response_format": ({"type": "text"},), "reasoning_effort": (),
    "modalities": (["text"],), "prediction": (), "audio": (), "web_search_options": (),
}
COMPLETION_ONLY = ("best_of", "echo", "suffix")
CHAT_ONLY = ("top_logprobs", "tools", "tool_choice", "functions", "function_call", "response_format",
             "reasoning_effort", "modalities", "prediction", "audio", "web_search_options")
ROLES = ("system", "developer", "user", "assistant")


def _same(v, n) -> bool:
    """JSON equality without Python's bool == int."""
    if isinstance(v, bool) or isinstance(n, bool):
        return v is n
    return v == n


def _stop(v) -> list[str]:
    if v is None or v == []:
        return []
    v = [v] if isinstance(v, str) else v
    if not isinstance(v, list) or not v or len(v) > MAX_STOP_STRINGS \
            or not all(isinstance(x, str) and 0 < len(x) <= MAX_STOP_CHARS for x in v):
        raise ValueError(f"must be a non-empty string or a list of up to {MAX_STOP_STRINGS} of them "
                         f"(each at most {MAX_STOP_CHARS} characters)")
    return v


def _prompt(v) -> str | list[int]:
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]  # a batch of one
    if isinstance(v, str) and v:
        return v
    if isinstance(v, list) and v and all(type(x) is int for x in v):
        return v
    raise ValueError("must be a non-empty string or a non-empty list of token ids (one prompt per request)")


def _seed(v) -> int | None:
    if v is None:
        return None
    if type(v) is not int:
        raise ValueError(f"must be an integer, got {_shown(v)}")
    if not SEED_MIN <= v <= SEED_MAX:
        raise ValueError(f"must be a signed 64-bit integer, {SEED_MIN} ... {SEED_MAX}; got {_shown(v)}")
    return v


def _content(v) -> str | None:
    """A string, null, or a list of text parts (joined with newlines); other part types are refused
    by name."""
    if v is None or isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise ValueError("must be a string, a list of text parts, or null (assistant messages)")  # noqa: TRY004
    texts = []
    for i, p in enumerate(v):
        kind = p.get("type") if isinstance(p, dict) else None
        if not isinstance(kind, str):
            raise ValueError(f"part {i} must be an object with a string 'type'")  # noqa: TRY004
        if kind != "text":
            raise ValueError(f"part {i} has type '{kind[:40]}': this server takes text parts only")
        if not isinstance(p.get("text"), str) or set(p) != {"type", "text"}:
            raise ValueError(f'part {i} must be {{"type": "text", "text": a string}}')
        texts.append(p["text"])
    return "\n".join(texts)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool | None = None


class Message(_Strict):
    role: Literal[ROLES]
    content: Annotated[Any, PlainValidator(_content)] = None
    name: str | None = None  # a participant name: the chat templates do not use it
    tool_calls: list | None = None

    @model_validator(mode="after")
    def _supported(self):
        if self.tool_calls:
            raise ValueError("has tool calls: tools are not supported by this server")
        if self.content is None and self.role != "assistant":
            raise ValueError(f"is a {self.role} message without 'content' (only assistant content may be null)")
        return self


class _Common(_Strict):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # extension (vLLM's): -1 or 0 = off; beyond the vocabulary = off
    stop: Annotated[list[str], PlainValidator(_stop)] = []
    seed: Annotated[int | None, PlainValidator(_seed)] = None  # every bit of it is used
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=1)  # one choice per request
    user: str | None = None  # an end-user id for the provider's abuse monitoring: nothing to do here
    # below and in the subclasses: accepted only at a value in NEUTRAL (checked by `validate`)
    frequency_penalty: Any = None
    presence_penalty: Any = None
    repetition_penalty: Any = None
    logit_bias: Any = None
    min_p: Any = None
    min_tokens: Any = None
    ignore_eos: Any = None
    logprobs: Any = None


class CompletionRequest(_Common):
    prompt: Annotated[str | list[int], PlainValidator(_prompt)]
    best_of: Any = None
    echo: Any = None
    suffix: Any = None


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    chat_template_kwargs: dict[str, Any] | None = None  # as vLLM / SGLang, e.g. {"enable_thinking": false}
    parallel_tool_calls: bool | None = None  # meaningless without tools
    top_logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    reasoning_effort: Any = None
    modalities: Any = None
    prediction: Any = None
    audio: Any = None
    web_search_options: Any = None


_OBJECT = re.compile(r"a valid dictionary or instance of \w+|a valid dictionary")


def _path(loc) -> str:
    out = ""
    for x in loc:
        out += f"[{x}]" if isinstance(x, int) else (f".{x}" if out else str(x))
    return out


def _shown(v) -> str:
    try:
        s = json.dumps(v)
    except (TypeError, ValueError):
        s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _message(err) -> tuple[str, str | None]:
    loc = [x for x in err["loc"] if not (isinstance(x, str) and ("[" in x or x in ("str", "int", "list")))]
    path, kind = _path(loc), err["type"]
    msg = _OBJECT.sub("an object", err["msg"])
    if not path:
        return "the request body must be a JSON object", None
    if kind == "extra_forbidden":
        return f"unknown field '{path}': this server does not support it", path
    if kind == "too_short":
        return f"'{path}' must not be empty", path
    if kind == "missing":
        return f"'{path}' is required", path
    if msg.startswith("Value error, "):
        return f"'{path}' {msg[len('Value error, '):]}", path
    if msg.startswith("Input should be "):
        return f"'{path}' should be {msg[len('Input should be '):]}, got {_shown(err.get('input'))}", path
    return f"'{path}': {msg}", path


def validate(body, chat: bool) -> CompletionRequest | ChatRequest:
    """The typed request, or BadRequest naming the first offending field."""
    cls = ChatRequest if chat else CompletionRequest
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    try:
        req = cls.model_validate(body)
    except ValidationError as e:
        raise BadRequest(*_message(e.errors(include_url=False)[0])) from None
    for name, neutral in NEUTRAL.items():
        if name in (CHAT_ONLY if not chat else COMPLETION_ONLY):
            continue
        v = getattr(req, name, None)
        if v is not None and not any(_same(v, n) for n in neutral):
            what = "logprobs are not returned" if "logprobs" in name else "it is not supported"
            raise BadRequest(f"'{name}' {_shown(v)} is refused: {what} by this server (leave it out)", name)
    return req
