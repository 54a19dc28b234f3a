"""JAX's persistent compilation cache in the user cache, on for every command by default.

An engine compiles a prefill per prompt bucket, its round and its loop; on a TPU one Qwen3-8B round
compiles in 40-45 s, so without a cache every start of a server or an evaluation pays minutes for
programs it compiled yesterday. With the cache on, a program compiled once is read back from disk
on the next start (keyed by JAX on the program, the compiler version and the devices). The
engine's programs go to io/program_store.py's store beside it (`compiled_programs_dir`), keyed
without tracing them.

`$DSPARK_JAX_COMPILE_CACHE`: a directory to use instead of ``<user cache>/xla``, or ``off`` (also
``0``, ``false``, ``no``) to keep every compile in memory; `python -m dspark_jax --no-compile-cache
<command>` sets it off for one run. The tests keep it off (tests/conftest.py says why).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import jax

from dspark_jax.io.cache import cache_root

__all__ = ["COMPILE_CACHE_ENV", "compile_cache_dir", "enable_compile_cache", "compiled_programs_dir",
           "compile_seconds", "COMPILE_EVENTS", "STORE_LOAD_EVENT"]

COMPILE_CACHE_ENV = "DSPARK_JAX_COMPILE_CACHE"
_OFF = ("off", "0", "false", "no")
# every program is written: reading a small one back (a few ms on XLA:CPU) costs less than
# compiling it again (20-120 ms each for the eager operations of loading a model)
MIN_COMPILE_SECONDS = 0.0

log = logging.getLogger(__name__)
_enabled = [None]  # the directory `enable_compile_cache` turned on in this process


def compile_cache_dir() -> Path | None:
    """Where compiled programs are kept (None: the cache is off)."""
    env = os.environ.get(COMPILE_CACHE_ENV, "").strip()
    if env.lower() in _OFF:
        return None
    return Path(env).expanduser() if env else cache_root() / "xla"


def enable_compile_cache() -> Path | None:
    """Point JAX's persistent compilation cache at `compile_cache_dir()` (before the first compile)
    -> the directory, or None when it is off or cannot be created (then a log line says why and
    compiles stay in memory: a read-only home must not stop a command)."""
    path = compile_cache_dir()
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.warning("compilation cache off: cannot create %s (%s); set %s to a writable directory",
                    path, e.strerror or e, COMPILE_CACHE_ENV)
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    _enabled[0] = path
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def compiled_programs_dir() -> Path | None:
    """Where io/program_store.py keeps executables under its own key: beside JAX's cache, once
    `enable_compile_cache` has turned that on in this process (None otherwise)."""
    if _enabled[0] is None or compile_cache_dir() != _enabled[0]:
        return None
    return _enabled[0] / "programs"


# the duration events of a program's way to an executable: JAX's tracing, lowering and backend
# compile (which includes reading a program back from the persistent cache), and our program
# store's reading back (io/program_store.py)
STORE_LOAD_EVENT = "/dspark_jax/program_store/load_duration"
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration", STORE_LOAD_EVENT)
_spent = {event: 0.0 for event in COMPILE_EVENTS}
_listening = [False]


def _on_duration(event: str, seconds: float, **_) -> None:
    if event in _spent:
        _spent[event] += seconds


def compile_seconds(stored_reads: bool = True) -> float:
    """Seconds this process has spent turning programs into executables (tracing, lowering,
    compiling or reading back from JAX's cache, and with `stored_reads` reading back from the
    program store) since the first call: a phase's compile share is the difference of two calls
    around it over its wall time."""
    if not _listening[0]:
        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        _listening[0] = True
    return sum(s for e, s in _spent.items() if stored_reads or e != STORE_LOAD_EVENT)
