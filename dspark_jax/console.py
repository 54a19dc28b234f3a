"""What a person sees of long work: progress bars and library log lines at a terminal, and, for
output that is stored (a notebook's cells), the same lines made plain: machine paths made
portable and progress bars dropped (`plain_output`)."""

from __future__ import annotations

import contextlib
import io
import logging
import re
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Iterable

from tqdm.auto import tqdm

__all__ = ["is_progress_bar", "plain_output", "progress_bar", "scrub_paths", "show_logs"]


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


_BAR = re.compile(r"\d+%\|.*\|\s*\d+/\d+|\d+/\d+ \[\d+:\d+(?:<|,)|\|[\u2588-\u258f ]{3,}\|")


def is_progress_bar(line: str) -> bool:
    """A tqdm bar ("train:  40%|####      | 4/10 [00:02<00:03, 2.0step/s]") or any
    carriage-return refresh."""
    return "\r" in line or bool(_BAR.search(line))


def _roots() -> list[tuple[str, str]]:
    out = []
    for root, name in ((Path.cwd(), ""), (Path.home(), "~"), (Path(sys.prefix), "<python>"),
                       (Path(tempfile.gettempdir()), "<tmp>")):
        for r in {str(root), str(root.resolve())}:
            if len(r) > 1:
                out.append((r, name))
    return sorted(out, key=lambda x: -len(x[0]))  # the longest (most specific) first


def scrub_paths(text) -> str:
    """Machine paths made portable: the working directory's prefix removed (relative paths), the
    home directory as ~, the Python installation as <python>, the temp directory as <tmp>."""
    text = str(text)
    for root, name in _roots():
        if name == "":
            text = re.sub(re.escape(root) + r"(?:/|(?=[\s'\"`,)\]]|$))", "", text)
        else:
            text = text.replace(root, name)
    return text


class _Lines(io.TextIOBase):
    """A write-through stream: complete lines go to `out` scrubbed, progress-bar refreshes are dropped."""
    def __init__(self, out):
        self.out, self.buf = out, ""

    def writable(self) -> bool:
        return True

    def write(self, s) -> int:
        self.buf += s
        *lines, self.buf = self.buf.split("\n")
        for line in lines:
            self._emit(line)
        return len(s)

    def _emit(self, line: str) -> None:
        shown = line.rsplit("\r", 1)[-1]  # what a terminal shows after the refreshes
        if "\r" in line or is_progress_bar(shown):
            return
        self.out.write(scrub_paths(shown) + "\n")

    def flush(self) -> None:
        self.out.flush()

    def close_buffer(self) -> None:
        if self.buf:
            self._emit(self.buf)
            self.buf = ""
        self.out.flush()


@contextlib.contextmanager
def plain_output():
    """Inside: printed lines (stdout and stderr) pass through with machine paths scrubbed and
    progress bars (anything refreshed with a carriage return) dropped; tqdm's "IProgress not
    found" notebook warning and tensorboardX's NaN warnings (a held-out interval from one batch)
    are not shown. Pair with `run(cfg, progress=False)`; the run's summary table gives one line
    per phase."""
    out, err = _Lines(sys.stdout), _Lines(sys.stderr)
    tb = logging.getLogger("tensorboardX.x2num")
    level = tb.level
    tb.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            warnings.filterwarnings("ignore", message=".*IProgress not found.*")
            yield
    finally:
        tb.setLevel(level)
        out.close_buffer()
        err.close_buffer()
