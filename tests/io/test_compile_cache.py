"""The persistent compilation cache: where it lives, how it is turned off, and that a command's
compiles land in it (in a subprocess: the suite keeps the cache off in its own processes)."""

import os
import subprocess
import sys

import pytest

from dspark_jax import __main__ as dispatcher
from dspark_jax.io import compile_cache
from dspark_jax.io.cache import CACHE_ENV


@pytest.mark.parametrize("value", ["off", "0", "false", "NO", " off "])
def test_off_values(monkeypatch, value):
    monkeypatch.setenv(compile_cache.COMPILE_CACHE_ENV, value)
    assert compile_cache.compile_cache_dir() is None
    assert compile_cache.enable_compile_cache() is None


def test_default_under_the_user_cache_and_explicit_dir(monkeypatch, tmp_path):
    monkeypatch.delenv(compile_cache.COMPILE_CACHE_ENV, raising=False)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "user"))
    assert compile_cache.compile_cache_dir() == tmp_path / "user" / "xla"
    monkeypatch.setenv(compile_cache.COMPILE_CACHE_ENV, str(tmp_path / "mine"))
    assert compile_cache.compile_cache_dir() == tmp_path / "mine"


def test_unwritable_dir_leaves_the_cache_off(monkeypatch, tmp_path, dspark_caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(compile_cache.COMPILE_CACHE_ENV, str(blocker / "xla"))
    assert compile_cache.enable_compile_cache() is None
    assert "compilation cache off" in dspark_caplog.text and compile_cache.COMPILE_CACHE_ENV in dspark_caplog.text


def test_no_compile_cache_flag(monkeypatch, capsys):
    monkeypatch.delenv(compile_cache.COMPILE_CACHE_ENV, raising=False)
    assert dispatcher.main(["--no-compile-cache"]) == 0
    assert os.environ[compile_cache.COMPILE_CACHE_ENV] == "off"
    assert "--no-compile-cache" in capsys.readouterr().out


def _run_with_cache(code: str, cache) -> str:
    """stdout of `code` in a fresh interpreter whose compilation cache is `cache`."""
    env = {**os.environ, compile_cache.COMPILE_CACHE_ENV: str(cache), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_compiles_are_written_to_the_cache(tmp_path):
    code = ("import jax, jax.numpy as jnp\n"
            "from dspark_jax.io.compile_cache import enable_compile_cache\n"
            "path = enable_compile_cache()\n"
            "jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)\n"
            "jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((64, 64))).block_until_ready()\n"
            "print(path)\n")
    assert _run_with_cache(code, tmp_path / "xla").strip() == str(tmp_path / "xla")
    assert any((tmp_path / "xla").iterdir()), "no compiled program was written to the cache"


def test_compile_seconds_counts_compiles_not_cached_calls():
    """A new program adds its tracing and compile time; calling it again (compiled, in memory)
    adds nothing: what the main job's phase table reports as compiling."""
    import jax
    import jax.numpy as jnp

    before = compile_cache.compile_seconds()
    f = jax.jit(lambda x: jnp.sin(x) * 3 + x.sum())
    f(jnp.ones(7)).block_until_ready()
    after_compile = compile_cache.compile_seconds()
    assert after_compile > before
    f(jnp.ones(7)).block_until_ready()
    assert compile_cache.compile_seconds() == after_compile


def test_programs_compiled_for_a_tpu_slice_are_not_written(tmp_path):
    """Compiled for devices that run nothing, a program could not be read back from JAX's cache (a
    warning, then a compile again): a process that compiles for a slice writes none."""
    pytest.importorskip("libtpu")
    code = ("import jax, jax.numpy as jnp\n"
            "from dspark_jax.io.compile_cache import enable_compile_cache\n"
            "from dspark_jax.parallel.topology import slice_devices\n"
            "path = enable_compile_cache()\n"
            "jax.jit(lambda x: x @ x.T)(jnp.ones((64, 64))).block_until_ready()  # a CPU program: written\n"
            "written = len(list(path.iterdir()))\n"
            "dev = slice_devices('v6e-1')[0]\n"
            "s = jax.sharding.SingleDeviceSharding(dev)\n"
            "x = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16, sharding=s)\n"
            "jax.jit(lambda x: jnp.sin(x) @ x.T).lower(x).compile()\n"
            "print(written, len(list(path.iterdir())))\n")
    before, after = map(int, _run_with_cache(code, tmp_path / "xla").split()[-2:])
    assert before >= 1 and after == before
