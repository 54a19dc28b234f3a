"""The console: library log lines shown once, where stderr is at the time."""

from __future__ import annotations

import io
import logging
import subprocess
import sys

from dspark_jax.console import show_logs

ONE_LINE = """
import logging
import dspark_jax.data.pipeline  # imports grain and orbax, whose absl logging configures the root logger
from dspark_jax.console import show_logs
show_logs()
show_logs()  # a second call adds nothing
print("root handlers", len(logging.getLogger().handlers), flush=True)
logging.getLogger("dspark_jax.data.regenerate").info("hello from the library")
"""


def test_a_log_line_prints_once_although_the_root_logger_has_a_handler():
    r = subprocess.run([sys.executable, "-c", ONE_LINE], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "root handlers 1" in r.stdout  # the situation: absl put a handler on the root logger
    assert r.stderr.count("hello from the library") == 1, r.stderr[-2000:]
    assert "[<string>] hello from the library" in r.stderr  # [module] message


def test_lines_go_to_the_current_stderr(capsys):
    """The handler is made once per process (by the first command, an earlier test, a notebook
    cell) and must write where stderr is now, not where it was then."""
    lg = logging.getLogger("dspark_jax")
    saved, captured = lg.handlers[:], sys.stderr
    lg.handlers = [h for h in saved if not getattr(h, "_dspark_console", False)]
    try:
        sys.stderr = io.StringIO()  # where stderr was when the handler was made
        show_logs()
        sys.stderr = captured
        logging.getLogger("dspark_jax.console").info("now")
        assert "[test_console] now" in capsys.readouterr().err
    finally:
        sys.stderr = captured
        lg.handlers = saved
