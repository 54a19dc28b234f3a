"""Reading a JSON file so that a malformed one is named in a clear error of the caller's kind."""

from __future__ import annotations

import json
from pathlib import Path


def read_json(path, error: type[Exception] = ValueError):
    """The JSON value in `path`; invalid JSON raises `error` naming the file (never a bare JSONDecodeError)."""
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise error(f"{path} is not valid JSON ({e})") from None
