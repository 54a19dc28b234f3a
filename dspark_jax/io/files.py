"""Small file helpers: JSON with named errors, file hashes, directories written all-or-nothing."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path


def read_json(path, error: type[Exception] = ValueError):
    """The JSON value in `path`; invalid JSON raises `error` naming the file (never a bare JSONDecodeError)."""
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise error(f"{path} is not valid JSON ({e})") from None


def sha256_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@contextlib.contextmanager
def atomic_dir(out):
    """Yield a fresh temporary sibling of `out` to write into; when the block completes it replaces
    `out`, when it raises (or is interrupted) it is removed and `out` is left as it was."""
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
