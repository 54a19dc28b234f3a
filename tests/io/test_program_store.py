"""The program store: a process that runs an engine it ran before neither traces nor compiles its
programs (it reads them back), gets the same tokens, and never reads a program under another's key
(static settings, shapes, static arguments); bad files are replaced, unkeyable settings compile as
plain jit, and what JAX's own cache read back is not written again. Processes with the store on are
subprocesses: the suite keeps the compilation cache off in its own (tests/conftest.py)."""

import dataclasses
import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.engine.spec import Spec
from dspark_jax.io import compile_cache
from dspark_jax.io.program_store import Unkeyable, evict, stable_key, stored_jit
from dspark_jax.target.kv_cache import KVCache
from dspark_jax.testing.tiny import tiny_config

ENGINE_RUN = """
import json, jax
from dspark_jax.io.compile_cache import COMPILE_EVENTS, enable_compile_cache
traced = []
jax.monitoring.register_event_duration_secs_listener(
    lambda e, s, fun_name=None, **_: traced.append(fun_name) if e == COMPILE_EVENTS[0] else None)
enable_compile_cache()
from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.io.program_store import store_stats
from dspark_jax.testing.tiny import tiny_config, tiny_drafter, tiny_target
target = tiny_target(tiny_config(vocab_size=16, hidden_size=32, num_layers=2), logit_scale=1.0)
drafter = tiny_drafter("dspark", target, gamma=3)
engine = Engine(target, drafter, EngineConfig(policy="fixed",
                                              num_slots=2, max_len=32, buckets=(8,), prefill_buckets=(16,)))
res = engine.generate([[1, 2, 3], [4, 5], [6, 7, 8, 9]], max_new_tokens=6, sampling=SamplingParams(1.0, 0, 1.0),
                      seed=3)
print(json.dumps({"tokens": [r.tokens for r in res.results], "stats": store_stats(), "traced": traced,
                  "rounds": engine.compiled_rounds()}))
"""

PROGRAMS_RUN = """
import json, sys, jax, jax.numpy as jnp
from dspark_jax.io.compile_cache import enable_compile_cache
enable_compile_cache()
from dspark_jax.io.program_store import store_stats, stored_jit

def product(x):
    return jnp.sin(x) @ x.T

def scaled(x, n):
    return x * n

x = jnp.arange(16.0).reshape(4, 4)
out = {}
if sys.argv[1] == "jax":  # JAX's own cache compiles and keeps `product`
    out["product"] = float(jax.jit(product)(x).sum())
else:
    out["product"] = float(stored_jit(product, "product")(x).sum())
    out["product8"] = float(stored_jit(product, "product")(jnp.ones((8, 8))).sum())
    s = stored_jit(scaled, "scaled", static_argnums=(1,))
    out["scaled"] = [float(s(x, 2).sum()), float(s(x, 3).sum())]
    out["unkeyable"] = float(stored_jit(product, "closure", static=(lambda: 0,))(x).sum())
out["stats"] = store_stats()
print(json.dumps(out))
"""


def _run(code: str, cache, *args) -> dict:
    env = {**os.environ, compile_cache.COMPILE_CACHE_ENV: str(cache), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _stored(cache) -> list:
    return sorted((cache / "programs").glob("*.jaxexe")) if (cache / "programs").exists() else []


ENGINE_PROGRAMS = {"round_step", "_prefill", "_request_key_data"}


def test_an_engine_run_again_reads_its_programs_back(tmp_path):
    cache = tmp_path / "xla"
    first = _run(ENGINE_RUN, cache)
    assert first["stats"]["hits"] == 0 and first["stats"]["misses"] >= 3, first["stats"]
    assert ENGINE_PROGRAMS <= set(first["traced"])
    files = _stored(cache)
    assert len(files) == first["stats"]["misses"]

    second = _run(ENGINE_RUN, cache)
    assert first["rounds"] == second["rounds"] == 1  # read back or compiled, the engine holds one round
    assert second["tokens"] == first["tokens"]
    assert second["stats"] == {**first["stats"], "hits": first["stats"]["misses"], "misses": 0}
    assert not ENGINE_PROGRAMS & set(second["traced"]), "a stored program was traced again"

    # a damaged file is read as a miss: compiled, written again, the same tokens
    (rnd,) = [f for f in files if f.name.startswith("engine_round-")]
    rnd.write_bytes(b"not a program")
    third = _run(ENGINE_RUN, cache)
    assert third["tokens"] == first["tokens"]
    assert third["stats"]["errors"] == 1 and third["stats"]["misses"] == 1
    assert rnd.stat().st_size > 1000


def test_keys_static_arguments_shapes_and_what_jax_cache_served(tmp_path):
    cache = tmp_path / "xla"
    _run(PROGRAMS_RUN, cache, "jax")  # JAX's cache now holds `product` at [4, 4]
    first = _run(PROGRAMS_RUN, cache, "store")
    # `product` at [4, 4] came from JAX's cache: not written (a re-serialised read-back fails on XLA:CPU)
    names = [f.name.split("-")[0] for f in _stored(cache)]
    assert sorted(names) == ["product", "scaled", "scaled"], names
    assert first["stats"] == {"hits": 0, "misses": 4, "unkeyable": 1, "errors": 0}
    x = np.arange(16.0).reshape(4, 4)
    assert first["scaled"] == [2 * x.sum(), 3 * x.sum()]  # one executable per static value
    assert first["product"] == pytest.approx(float((np.sin(x) @ x.T).sum()), rel=1e-5)
    assert first["unkeyable"] == first["product"]

    second = _run(PROGRAMS_RUN, cache, "store")
    assert {k: v for k, v in second.items() if k != "stats"} == {k: v for k, v in first.items() if k != "stats"}
    assert second["stats"] == {"hits": 3, "misses": 1, "unkeyable": 1, "errors": 0}


def _spec(**kw) -> Spec:
    cfg = tiny_config(vocab_size=16, hidden_size=32, num_layers=2)
    return Spec(**{"kind": None, "draft": None, "tcfg": cfg, "buckets": (2,), "max_len": 32, "policy": max, **kw})


def test_stable_key_tells_settings_apart():
    assert stable_key(_spec()) == stable_key(_spec())
    assert stable_key(_spec()) != stable_key(_spec(max_len=33))
    assert stable_key(_spec()) != stable_key(dataclasses.replace(_spec(), tcfg=tiny_config(vocab_size=17)))
    assert stable_key(functools.partial(stable_key, 1)) != stable_key(functools.partial(stable_key, 2))
    assert stable_key((1, 2)) != stable_key([1, 2]) and stable_key(1) != stable_key(1.0)
    assert stable_key(np.float32) == stable_key(np.dtype("float32")) != stable_key(np.dtype(jnp.bfloat16))
    assert stable_key(jnp.bfloat16) == stable_key(np.dtype(jnp.bfloat16))
    assert stable_key(Spec) == "dspark_jax.engine.spec.Spec" != stable_key(KVCache)  # classes by name
    mesh = jax.make_mesh((1,), ("data",))
    named = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    assert "NamedSharding" in stable_key(named) and stable_key(named) != stable_key(
        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def test_a_kind_is_keyed_by_its_name():
    from dspark_jax.drafter import registry

    kinds = [registry.get_kind(n) for n in ("dspark", "dflash")]
    assert stable_key(kinds[0]) != stable_key(kinds[1])
    assert stable_key(kinds[0]).startswith("tuple(dspark_jax.drafter.kinds.block.BlockKind,")
    assert stable_key(kinds[0]) == stable_key(registry.get_kind("dspark"))


@pytest.mark.parametrize("value", [lambda: 0, object(), functools.partial(lambda x: x, 1)])
def test_unkeyable_settings(value):
    with pytest.raises(Unkeyable):
        stable_key({"policy": value})


def test_store_off_is_plain_jit():
    """With the cache off (the suite's setting) a stored program is the jitted function."""
    f = stored_jit(lambda x: x + 1, "plus_one")
    assert int(f(np.int32(1))) == 2
    assert f._directory is None and f._executables == {}


def test_calls_after_the_first_skip_describing_the_arguments(tmp_path, monkeypatch):
    """A call with the last call's static arguments goes to its executable, which checks the rest
    itself: the arguments are not described in Python again. Other static values, shapes or dtypes
    still reach their own executables."""
    from dspark_jax.io import program_store

    described = []
    real = program_store._leaf_signature
    monkeypatch.setattr(program_store, "_leaf_signature", lambda x: described.append(x.shape) or real(x))
    f = stored_jit(lambda x, n: x * n, "scaled_fast", static_argnums=(1,))
    f._directory = tmp_path  # the store on in this process (the suite keeps it off)
    x4 = jnp.ones(4)
    assert float(f(x4, 2).sum()) == 8 and described == [(4,)]
    for _ in range(3):
        assert float(f(x4, 2).sum()) == 8
    assert described == [(4,)]  # taken by the last executable
    assert float(f(x4, 3).sum()) == 12  # another static value: not the last call's executable
    assert float(f(jnp.ones(8), 3).sum()) == 24  # another shape: refused by the last one, then found
    assert float(f(x4, 3).sum()) == 12
    ints = f(jnp.ones(4, jnp.int32), 3)
    assert ints.dtype == jnp.int32 and int(ints.sum()) == 12  # another dtype
    assert f._cache_size() == 4 and len(described) == 5


def test_eviction_removes_the_least_recently_used_first(tmp_path):
    for i, name in enumerate(["old", "mid", "new"]):
        (tmp_path / f"{name}.jaxexe").write_bytes(b"x" * 100)
        os.utime(tmp_path / f"{name}.jaxexe", (1000 + i, 1000 + i))
    (tmp_path / "other.txt").write_bytes(b"y" * 1000)  # not a program: never counted or removed
    assert evict(tmp_path, max_bytes=300) == []
    assert evict(tmp_path, keep=tmp_path / "old.jaxexe", max_bytes=250) == [tmp_path / "mid.jaxexe"]
    assert evict(tmp_path, max_bytes=100) == [tmp_path / "old.jaxexe"]
    assert sorted(f.name for f in tmp_path.iterdir()) == ["new.jaxexe", "other.txt"]
