"""What a person at a terminal sees of long work: progress bars, and library log lines."""

from __future__ import annotations

import logging
import sys
from typing import Iterable

from tqdm.auto import tqdm

__all__ = ["progress_bar", "show_logs"]


def show_logs(level: int = logging.INFO) -> None:
    """Library code logs (`logging.getLogger(__name__)`); a command shows those lines on stderr as
    `[module] message`, once however often it is called, and only there: they do not also reach
    the root logger, where absl (imported by orbax and grain) installs a handler of its own."""
    root = logging.getLogger("dspark_jax")
    root.setLevel(level)
    root.propagate = False
    if not any(getattr(h, "_dspark_console", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[%(module)s] %(message)s"))
        handler._dspark_console = True
        root.addHandler(handler)


def progress_bar(iterable: Iterable | None = None, *, total: int | None = None, desc: str = "", enabled: bool = True,
                 unit: str = "it", initial: int = 0):
    """A tqdm bar, or a silent stand-in with the same `update` / `set_postfix` / `close` API."""
    if enabled:
        return tqdm(iterable, total=total, desc=desc, unit=unit, initial=initial, dynamic_ncols=True, mininterval=1.0)
    return _Silent(iterable)


class _Silent:
    def __init__(self, iterable=None):
        self._it = iterable

    def __iter__(self):
        return iter(self._it if self._it is not None else ())

    def update(self, n=1):
        pass

    def set_postfix(self, *a, **k):
        pass

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
