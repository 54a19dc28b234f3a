"""The console: library log lines shown once."""

from __future__ import annotations

import subprocess
import sys

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
