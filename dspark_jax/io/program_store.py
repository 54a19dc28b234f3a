"""Compiled programs kept on disk under our own key, so a process that runs a program it ran before
neither traces nor lowers it.

JAX's persistent compilation cache (io/compile_cache.py) is keyed by the lowered program: asking it
costs a trace and a lowering first, seconds for an engine's round, every process. A `StoredProgram`
keys a jitted function's executable by what determines the program without tracing it: the
function's name and static settings (an engine's `Spec`), the arguments' tree, shapes, dtypes and
shardings, this package's source, the JAX / jaxlib / backend versions, the devices, JAX's settings
and the compiler's environment variables. A hit reads the executable back
(`jax.experimental.serialize_executable`); a miss compiles through the jitted function and writes
it. Anything that cannot be keyed stably (a lambda in a spec, a policy object without a stable
description) is compiled as plain `jax.jit` does: the store only skips work, it never changes what
runs. The store lives beside JAX's cache and follows its switch (`--no-compile-cache`,
`$DSPARK_JAX_COMPILE_CACHE=off`); it is used in single-process runs only (JAX's own cache serves
multi-host programs, whose processes must compile together).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import logging
import os
import pickle
import time
import types
from pathlib import Path

import jax
import jaxlib
import numpy as np
from jax.experimental import serialize_executable

from dspark_jax.io.compile_cache import STORE_LOAD_EVENT, compiled_programs_dir

try:
    from jax._src.config import trace_context as _jax_trace_context
except ImportError:
    _jax_trace_context = None

__all__ = ["StoredProgram", "stored_jit", "stable_key", "Unkeyable", "store_stats", "evict", "MAX_STORE_BYTES"]

log = logging.getLogger(__name__)

# JAX settings that say where or whether programs are cached or logged, not what they compute
_SETTINGS_IGNORED = ("cache", "log", "explain", "persistent")
# environment variables that change what a compiler makes of the same program
_ENV_KEPT = ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "TPU_ACCELERATOR_TYPE", "CUDA_VISIBLE_DEVICES")
_stats = {"hits": 0, "misses": 0, "unkeyable": 0, "errors": 0}
# the store's size: beyond it the least recently used programs are removed after a write
MAX_STORE_BYTES = 8 << 30


class Unkeyable(TypeError):
    """A static setting without a description that is the same in every process."""


def store_stats() -> dict:
    """Counts since the process started: programs read back, compiled and written, compiled
    without the store (unkeyable settings), failed reads or writes."""
    return dict(_stats)


def stable_key(obj) -> str:
    """A description of `obj` that is equal in every process exactly when the programs it
    configures are: values, dataclasses, named tuples, functions defined at module level (their
    code is in the source digest), partials of them, enums, dtypes, meshes, shardings, and objects
    whose class has `__stable_key__()` (what they are equal by, described in turn).
    Raises `Unkeyable` for anything else (lambdas, closures, objects known only by address)."""
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return repr(obj)
    if isinstance(obj, enum.Enum):
        return f"{_qualname(type(obj))}.{obj.name}"
    if isinstance(obj, np.dtype) or (isinstance(obj, type) and (
            issubclass(obj, np.generic) or isinstance(getattr(obj, "dtype", None), np.dtype))):
        return f"dtype:{np.dtype(obj).name}"  # a dtype, or a scalar type standing for one (np.float32, jnp.bfloat16)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return f"{_qualname(type(obj))}({','.join(stable_key(v) for v in obj)})"
    if isinstance(obj, (tuple, list)):
        return f"{type(obj).__name__}({','.join(stable_key(v) for v in obj)})"
    if isinstance(obj, dict):
        return "{" + ",".join(f"{stable_key(k)}:{stable_key(v)}" for k, v in sorted(obj.items(), key=repr)) + "}"
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = ",".join(f"{f.name}={stable_key(getattr(obj, f.name))}" for f in dataclasses.fields(obj))
        return f"{_qualname(type(obj))}({fields})"
    if isinstance(obj, functools.partial):
        return f"partial({stable_key(obj.func)},{stable_key(obj.args)},{stable_key(obj.keywords)})"
    if isinstance(obj, (types.FunctionType, types.BuiltinFunctionType, type)):
        return _qualname(obj)
    if isinstance(obj, jax.sharding.PartitionSpec):
        return repr(obj)
    if isinstance(obj, jax.sharding.Mesh):
        return f"Mesh({obj.axis_names},{obj.devices.shape},{tuple(int(i) for i in obj.device_ids.flat)})"
    if isinstance(obj, jax.sharding.NamedSharding):
        return f"NamedSharding({stable_key(obj.mesh)},{obj.spec!r},{obj.memory_kind})"
    if isinstance(obj, jax.sharding.SingleDeviceSharding):
        (device,) = obj.device_set
        return f"SingleDevice({device.id},{obj.memory_kind})"
    if hasattr(type(obj), "__stable_key__"):  # an object that says what it is equal by (a drafter kind)
        return stable_key(obj.__stable_key__())
    raise Unkeyable(f"{type(obj).__qualname__} has no stable description")


def _qualname(obj) -> str:
    name = f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', '?')}"
    if "<lambda>" in name or "<locals>" in name:
        raise Unkeyable(f"{name} is defined inside a function: its captured values are not known")
    return name


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 of the package's source (every .py file, with its path): what decides the programs
    it traces (the program store's key; a cost table's, engine/own_costs.py)."""
    h = hashlib.sha256()
    pkg = Path(__file__).resolve().parents[1]
    for path in sorted(pkg.rglob("*.py")):
        h.update(str(path.relative_to(pkg)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def _environment() -> str:
    """What every stored program of this process depends on besides its own key: the package's
    source, the JAX stack's versions, the devices, JAX's settings, the compiler's environment."""
    h = hashlib.sha256(source_digest().encode())
    backend = jax.devices()[0].client
    h.update(repr((jax.__version__, jaxlib.__version__, backend.platform, backend.platform_version)).encode())
    h.update(repr([(d.id, d.platform, d.device_kind, d.process_index) for d in jax.devices()]).encode())
    settings = sorted((k, repr(v)) for k, v in jax.config.values.items()
                      if not any(s in k for s in _SETTINGS_IGNORED))
    h.update(repr(settings).encode())
    h.update(repr([(k, os.environ.get(k)) for k in _ENV_KEPT]).encode())
    return h.hexdigest()


def _trace_context() -> str:
    """The context a program is traced in besides its arguments (the mesh `jax.set_mesh` set, which
    `parallel.sharding.constrain` reads; matmul precision, x64 and the like): what `jax.jit` keys its
    own cache on. It is JAX's internal `trace_context()` where that exists (its parts that are
    described only by address left out), else the abstract mesh."""
    if _jax_trace_context is None:  # a JAX without it: the mesh, the part our programs read
        return repr(jax.sharding.get_abstract_mesh())
    return repr(tuple(v for v in _jax_trace_context() if " at 0x" not in repr(v)))


def _leaf_signature(x):
    """What a compiled executable needs of one argument (hashable; cheap: asked every call)."""
    if isinstance(x, jax.Array):
        return (x.shape, x.dtype, getattr(x, "weak_type", False), x.sharding)  # key arrays have none
    if isinstance(x, np.ndarray) or isinstance(x, np.generic):
        return (x.shape, x.dtype, False, None)
    return (type(x),)  # a Python scalar: a weakly typed scalar argument


def _leaf_key(sig) -> str:
    if len(sig) == 1:
        return sig[0].__name__
    shape, dtype, weak, sharding = sig
    return f"{shape}:{dtype}:{int(weak)}:{'host' if sharding is None else stable_key(sharding)}"


# how an executable refuses arguments it was not compiled for (jax.stages.Compiled.__call__)
_REFUSALS = ("Argument types differ", "input pytree does not match", "Computation was compiled for")


def _refused_arguments(e: Exception) -> bool:
    """Whether `e` is an executable refusing its arguments (not an error of the program itself)."""
    return any(r in str(e) for r in _REFUSALS)


class StoredProgram:
    """`jitted` (a `jax.jit` function) whose executables are read from and written to the program
    store. Called like `jitted`; other attributes (`lower`, `trace`) are `jitted`'s own. Whether the
    store is on is decided at the first call (commands turn the cache on after import)."""

    def __init__(self, jitted, name: str, static=None, static_argnums: tuple[int, ...] = ()):
        self.jitted, self.name, self.static_argnums = jitted, name, tuple(static_argnums)
        self._static = static  # the settings the function closes over, described by `stable_key`
        self._executables = {}  # signature -> executable
        self._last = None  # (static arguments, executable) of the last call: tried first
        self._directory: Path | None | bool = False  # False: not decided yet

    def __getattr__(self, attr):
        return getattr(self.jitted, attr)

    def _cache_size(self) -> int:
        """Executables this program holds: its own where the store is on, else jit's."""
        return len(self._executables) if self._directory else self.jitted._cache_size()

    def __call__(self, *args):
        if self._directory is False:
            self._directory = compiled_programs_dir() if jax.process_count() == 1 else None
        if self._directory is None:
            return self.jitted(*args)
        fixed = tuple(args[i] for i in self.static_argnums)
        dynamic = tuple(a for i, a in enumerate(args) if i not in self.static_argnums) if fixed else args
        if self._last is not None and self._last[0] == fixed:
            # the last call's executable checks the arguments' tree, types and shardings itself and
            # refuses a mismatch before it runs (nothing donated), so a round's arguments are not
            # described in Python every call (a millisecond a round: docs/performance.md)
            try:
                return self._last[1](*dynamic)
            except (TypeError, ValueError) as e:
                if not _refused_arguments(e):
                    raise
        leaves, treedef = jax.tree.flatten(dynamic)
        sig = (fixed, treedef, tuple(_leaf_signature(x) for x in leaves))
        exe = self._executables.get(sig)
        if exe is None:  # compiled (lowered with every argument) or read back
            exe = self._executables[sig] = self._executable(sig, args)
        self._last = (fixed, exe)
        return exe(*dynamic)  # an executable takes the non-static arguments only

    def _path(self, sig) -> Path | None:
        fixed, treedef, leaves = sig
        try:
            text = "|".join([self.name, stable_key(self._static), stable_key(fixed), _trace_context(), str(treedef),
                             *map(_leaf_key, leaves)])
        except Unkeyable as e:
            log.debug("%s compiled without the program store: %s", self.name, e)
            _stats["unkeyable"] += 1
            return None
        if " at 0x" in text:  # a tree node's data described by its address
            _stats["unkeyable"] += 1
            return None
        digest = hashlib.sha256((_environment() + text).encode()).hexdigest()[:32]
        return self._directory / f"{self.name}-{digest}.jaxexe"

    def _executable(self, sig, args):
        path = self._path(sig)
        if path is not None and path.exists():
            t0 = time.perf_counter()
            try:
                payload, in_tree, out_tree = pickle.loads(path.read_bytes())
                exe = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
            except Exception as e:  # a truncated or foreign file: compile and write it again
                log.warning("could not read the stored program %s (%s: %s); compiling it", path.name,
                            type(e).__name__, e)
                _stats["errors"] += 1
            else:
                jax.monitoring.record_event_duration_secs(STORE_LOAD_EVENT, time.perf_counter() - t0)
                _stats["hits"] += 1
                _touch(path)
                return exe
        if path is None:  # JAX's cache serves it as it serves any jitted function
            return self.jitted.lower(*args).compile()
        exe, from_jax_cache = _compile(self.jitted, args)
        _stats["misses"] += 1
        if from_jax_cache:  # re-serialising what JAX's cache read back makes a broken file on XLA:CPU
            log.info("%s came from JAX's compilation cache (an entry from before the program store); not stored",
                     self.name)
        else:
            self._write(path, exe)
        return exe

    def _write(self, path: Path, exe) -> None:
        try:
            blob = pickle.dumps(serialize_executable.serialize(exe))
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(blob)
            os.replace(tmp, path)  # a reader sees the whole file or none
            evict(path.parent, keep=path)
        except Exception as e:  # a backend that cannot serialize, a full disk: the program still runs
            log.warning("could not store the compiled program %s (%s: %s)", self.name, type(e).__name__, e)
            _stats["errors"] += 1


def _touch(path: Path) -> None:
    try:
        os.utime(path)  # the eviction order: least recently read or written first
    except OSError:
        pass


def evict(directory: Path, keep: Path | None = None, max_bytes: int | None = None) -> list[Path]:
    """Remove the least recently used programs until the store holds at most `max_bytes`
    (`MAX_STORE_BYTES`): each source edit keys programs anew, so old ones are never read again.
    -> the removed files."""
    limit = MAX_STORE_BYTES if max_bytes is None else max_bytes
    files = []
    for f in directory.glob("*.jaxexe"):
        try:
            st = f.stat()
        except OSError:  # removed by another process meanwhile
            continue
        files.append((st.st_mtime, st.st_size, f))
    total, removed = sum(size for _, size, _ in files), []
    for _, size, f in sorted(files, key=lambda x: x[0]):
        if total <= limit:
            break
        if f == keep:
            continue
        try:
            f.unlink()
        except OSError:
            continue
        total -= size
        removed.append(f)
    return removed


_JAX_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_jax_cache_hits = [0, False]  # hits so far, listener registered


def _on_event(event: str, **_) -> None:
    if event == _JAX_CACHE_HIT:
        _jax_cache_hits[0] += 1


def _compile(jitted, args):
    """-> (executable, whether JAX's persistent cache served it). JAX's cache does not write the
    program (the store keeps it): an executable that JAX's cache read back and the store wrote
    again fails when run in the next process on XLA:CPU (a kernel "not found")."""
    if not _jax_cache_hits[1]:
        jax.monitoring.register_event_listener(_on_event)
        _jax_cache_hits[1] = True
    hits, min_seconds = _jax_cache_hits[0], jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
    try:
        exe = jitted.lower(*args).compile()
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_seconds)
    return exe, _jax_cache_hits[0] > hits


def stored_jit(fun, name: str, static=None, **jit_kwargs) -> StoredProgram:
    """`jax.jit(fun, **jit_kwargs)` with its executables kept in the program store under `name`,
    `static` (what `fun` closes over, described by `stable_key`) and the arguments (static ones
    by value). Where the store is off (the compilation cache is off, or several processes run the
    program) it is `jax.jit(fun)` as is."""
    static_argnums = jit_kwargs.get("static_argnums", ())
    static_argnums = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    return StoredProgram(jax.jit(fun, **jit_kwargs), name, static, static_argnums)
