"""Request bodies: JSON only (a browser can post text/plain or a form cross-site without a CORS
preflight), a size bound enforced while reading (413 before the rest arrives), and a strict
parse: no NaN / Infinity (nor numbers that overflow to them), bounded nesting, no lone
surrogates in any string.

The one rule for what a body is (docs/serving.md, "What a request may carry"):

- its media type names JSON: `application/json`, a structured-syntax `application/<name>+json`
  (RFC 6839, e.g. `application/vnd.api+json`) or `text/json`, in any case, with no `charset`
  parameter or `charset=utf-8`; anything else is 415 (no other type is CORS-safelisted either, so
  a web page on another origin still cannot post one without a preflight);
- its bytes are UTF-8 without a byte order mark (RFC 8259 section 8.1): UTF-16, UTF-32, and a BOM
  are a 400 saying so (the JSON parser would take all three; this server takes one encoding);
- every string in it (a value or a field name) is valid Unicode: a lone surrogate, which JSON can
  escape ("\\ud800") but no text holds, is a 400 naming the field, in whichever field it is."""

from __future__ import annotations

import json
import math
import re

import numpy as np

from dspark_jax.serve.errors import ApiError, BadRequest

JSON_MEDIA_TYPES = ("application/json", "text/json")  # and application/<name>+json
CHARSETS = ("utf-8", "utf8")  # the one `charset` parameter accepted (absent is the same)

# strings (with escapes) removed before counting brackets: the unrolled form stays linear
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_OPEN, _CLOSE = np.frombuffer(b"[{", np.uint8), np.frombuffer(b"]}", np.uint8)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")  # where a lone one may come from
_BOM = b"\xef\xbb\xbf"
_CLOSE_CONNECTION = {"Connection": "close"}  # a refused body is not read: the server closes after the answer


def _media_type(value: str) -> tuple[str, dict[str, str]]:
    """A Content-Type header -> (type/subtype lowercased, parameters with lowercased names)."""
    kind, *params = value.split(";")
    out = {}
    for p in params:
        name, _, v = p.partition("=")
        out[name.strip().lower()] = v.strip().strip('"').strip()
    return kind.strip().lower(), out


def is_json_media_type(kind: str) -> bool:
    return kind in JSON_MEDIA_TYPES or (kind.startswith("application/") and kind.endswith("+json")
                                        and len(kind) > len("application/+json"))


def check_content_type(headers) -> None:
    """415 unless the body's media type is JSON by the rule above."""
    kind, params = _media_type(headers.get("content-type", ""))
    if not is_json_media_type(kind):
        raise ApiError(f"the request body must be JSON sent with 'Content-Type: application/json' "
                       f"(or text/json, application/*+json; got {kind[:80] or 'no content type'})", status=415)
    charset = params.get("charset")
    if charset is not None and charset.lower() not in CHARSETS:
        raise ApiError(f"the request body must be UTF-8 JSON: 'Content-Type: {kind}; charset={charset[:40]}' is not "
                       "taken (leave out the charset, or send charset=utf-8)", status=415)


async def read_body(http, max_bytes: int) -> bytes:
    """The whole body, or 413 as soon as it is known to exceed `max_bytes` (from Content-Length
    before reading anything, else while reading). A 413 closes the connection after it: the
    rest of the body is not read (serve/connection.py drops it without resetting the answer)."""
    check_content_type(http.headers)
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(f"the request body has {int(declared)} bytes; this server takes at most {max_bytes} "
                       "(--max-body-bytes)", status=413, headers=_CLOSE_CONNECTION)
    chunks, n = [], 0
    async for chunk in http.stream():
        n += len(chunk)
        if n > max_bytes:
            raise ApiError(f"the request body exceeds {max_bytes} bytes (--max-body-bytes)", status=413,
                           headers=_CLOSE_CONNECTION)
        chunks.append(chunk)
    return b"".join(chunks)


def json_depth(raw: bytes) -> int:
    """Deepest nesting of arrays / objects in `raw` (strings skipped), without parsing it."""
    a = np.frombuffer(_STRING.sub(b'""', raw), np.uint8)
    if not a.size:
        return 0
    step = np.isin(a, _OPEN).astype(np.int32) - np.isin(a, _CLOSE).astype(np.int32)
    return int(np.cumsum(step).max())


def _finite(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"the number {text[:40]} is out of range")
    return v


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _text(raw: bytes) -> str:
    """`raw` as text by the rule above, or BadRequest saying which encoding it is not."""
    if raw.startswith(_BOM):
        raise BadRequest("the request body starts with a byte order mark: send UTF-8 JSON without one (RFC 8259 "
                         "section 8.1)")
    if b"\x00" in raw:  # no JSON text holds a NUL byte; UTF-16 and UTF-32 hold many
        raise BadRequest("the request body holds NUL bytes: it must be UTF-8 JSON (this looks like UTF-16 or UTF-32)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"the request body is not UTF-8 (byte {e.start}: {e.reason}): send UTF-8 JSON") from None


def _has_lone_surrogate(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _escaped(path: str) -> str:
    """`path` with its lone surrogates written as escapes (the error body is JSON either way)."""
    return path.encode("utf-8", "backslashreplace").decode("utf-8")


def lone_surrogate(obj) -> str | None:
    """The path (`messages[0].content`, `stop[1]`; a field name: its own path) of the first string
    in `obj` that holds a lone surrogate, "" for `obj` itself, or None."""
    todo = [(obj, "")]
    while todo:
        v, path = todo.pop()
        if isinstance(v, str):
            if _has_lone_surrogate(v):
                return path
        elif isinstance(v, dict):
            items = []
            for k, x in v.items():
                where = f"{path}.{k}" if path else k
                if _has_lone_surrogate(k):
                    return where
                items.append((x, where))
            todo.extend(reversed(items))
        elif isinstance(v, list):
            todo.extend((x, f"{path}[{i}]") for i, x in reversed(list(enumerate(v))))
    return None


def parse_json(raw: bytes, max_depth: int):
    """Strict JSON -> Python objects, or BadRequest saying what is wrong (naming the field for a
    lone surrogate)."""
    depth = json_depth(raw)
    if depth > max_depth:
        raise BadRequest(f"the request body nests {depth} levels deep; at most {max_depth} are accepted")
    text = _text(raw)
    try:
        obj = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, huge integers
        raise BadRequest(f"the request body is not valid JSON ({str(e)[:200]})") from None
    if _SURROGATE_ESCAPE.search(raw) and (where := lone_surrogate(obj)) is not None:
        shown = _escaped(where)
        what = f"'{shown}'" if shown else "the request body"
        raise BadRequest(f"{what} is not valid Unicode: it holds a lone surrogate (an unpaired \\ud800-\\udfff "
                         "escape)", shown or None)
    return obj
