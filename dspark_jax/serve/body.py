"""Request bodies: JSON only (a browser can post text/plain or a form cross-site without a CORS
preflight), a size bound enforced while reading (413 before the rest arrives), and a strict
parse: no NaN / Infinity (nor numbers that overflow to them), bounded nesting."""

from __future__ import annotations

import json
import math
import re

import numpy as np

from dspark_jax.serve.errors import ApiError, BadRequest

# strings (with escapes) removed before counting brackets: the unrolled form stays linear
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_OPEN, _CLOSE = np.frombuffer(b"[{", np.uint8), np.frombuffer(b"]}", np.uint8)


def check_content_type(headers) -> None:
    ctype = headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json" and not (ctype.startswith("application/") and ctype.endswith("+json")):
        raise ApiError(f"the request body must be JSON sent with 'Content-Type: application/json' "
                       f"(got {ctype or 'no content type'})", status=415)


async def read_body(http, max_bytes: int) -> bytes:
    """The whole body, or 413 as soon as it is known to exceed `max_bytes` (from Content-Length
    before reading anything, else while reading)."""
    check_content_type(http.headers)
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(f"the request body has {int(declared)} bytes; this server takes at most {max_bytes} "
                       "(--max-body-bytes)", status=413)
    chunks, n = [], 0
    async for chunk in http.stream():
        n += len(chunk)
        if n > max_bytes:
            raise ApiError(f"the request body exceeds {max_bytes} bytes (--max-body-bytes)", status=413)
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


def parse_json(raw: bytes, max_depth: int):
    """Strict JSON -> Python objects, or BadRequest saying what is wrong."""
    depth = json_depth(raw)
    if depth > max_depth:
        raise BadRequest(f"the request body nests {depth} levels deep; at most {max_depth} are accepted")
    try:
        return json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, huge integers
        raise BadRequest(f"the request body is not valid JSON ({str(e)[:200]})") from None
