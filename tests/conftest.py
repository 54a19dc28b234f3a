"""Session-wide fixtures: build shared artefacts once per run so the suite stays fast."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# XLA:CPU compiles the suite's many small programs with LLVM's optimiser off and, where the installed
# XLA still has them (jax 0.10; XLA in jax 0.12 has only the MLIR fusion emitters and aborts on the
# flag), with its older loop emitters: on 2 cores the suite is compile-bound (docs/status.md, "CI
# time") and these tiny programs run about as fast either way; the numerics (no fast-math either
# way) are the same programs'. DSPARK_JAX_TEST_XLA_OPT=1 keeps XLA's defaults. Set before jax is
# imported; subprocesses inherit them (fake_devices_env keeps them).
_FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
# the flags this XLA knows, decided once per run (the xdist workers inherit it)
_CHOSEN_ENV = "DSPARK_JAX_TEST_XLA_FLAGS_CHECKED"
# XLA_FLAGS as the run found them, before the flags above: work that runs long programs in a child
# process (the tiny embedded target's build) gets them back
_FOUND_ENV = "DSPARK_JAX_TEST_XLA_FLAGS_FOUND"


def _xla_knows(flags: list[str]) -> list[str]:
    """Those of `flags` the installed XLA accepts: an unknown flag in XLA_FLAGS aborts the process,
    so each is tried in a child process of its own (all at once, about a second)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    probes = [subprocess.Popen([sys.executable, "-c", "import jax; jax.devices()"], env={**env, "XLA_FLAGS": f},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for f in flags]
    return [f for f, p in zip(flags, probes) if p.wait() == 0]


os.environ.setdefault(_FOUND_ENV, os.environ.get("XLA_FLAGS", ""))
if not os.environ.get("DSPARK_JAX_TEST_XLA_OPT") and not os.environ.get(_CHOSEN_ENV):
    _flags = os.environ.get("XLA_FLAGS", "")
    _new = _xla_knows([f for f in _FAST_COMPILE if f.split("=")[0] not in _flags])
    os.environ["XLA_FLAGS"] = " ".join([_flags, *_new]).strip()
    os.environ[_CHOSEN_ENV] = "1"

# The test extra installs libtpu (the TPU compiler, for deviceless compiles): with it present jax
# would probe for a TPU at start-up in every process (seconds, and a page of warnings); the suite
# runs on CPU and compiles for TPU slices explicitly (parallel/topology.py).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# commands turn on JAX's persistent compilation cache (io/compile_cache.py); the tests run commands
# in process and keep it off for the reason below (tests/io/test_compile_cache.py turns it on)
os.environ.setdefault("DSPARK_JAX_COMPILE_CACHE", "off")
# engines that measure their own cost table (engine/own_costs.py) keep it for this run only
os.environ.setdefault("DSPARK_JAX_COST_TABLES", tempfile.mkdtemp(prefix="dspark_cost_tables_"))

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")
# JAX's persistent compilation cache is opt-in for tests (DSPARK_JAX_TEST_COMPILE_CACHE=DIR):
# with it on, a full run segfaulted twice inside the cache read (XLA:CPU deserialising an
# executable, `compilation_cache.get_executable_and_time`) in a long-lived pytest process,
# at the same test, while every entry deserialises cleanly in a fresh process. CI runs without.
_CACHE = os.environ.get("DSPARK_JAX_TEST_COMPILE_CACHE")
if _CACHE:
    jax.config.update("jax_compilation_cache_dir", _CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def dspark_caplog(caplog):
    """caplog for the package's log lines at INFO, which a command's `show_logs` keeps from the root
    logger (caplog's own place)."""
    lg = logging.getLogger("dspark_jax")
    lg.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="dspark_jax")
    yield caplog
    lg.removeHandler(caplog.handler)


@pytest.fixture(autouse=True)
def _logging_as_found():
    """A command run in-process (`serve`'s `main`) configures logging for its process: a handler on
    the test's captured stderr, closed when the test ends, and the package's loggers at INFO.
    Restored after each test, so that a later test's log line neither lands on a closed stream
    ("--- Logging error ---" in that test's stderr) nor depends on the tests before it."""
    root, pkg = logging.getLogger(), logging.getLogger("dspark_jax")
    handlers, levels = list(root.handlers), (root.level, pkg.level)
    yield
    for h in root.handlers[:]:
        if h not in handlers:
            root.removeHandler(h)
    root.setLevel(levels[0])
    pkg.setLevel(levels[1])


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled programs after each test module. One pytest process runs the whole
    suite; with every module's executables kept alive, XLA:CPU segfaulted (compiling, or reading
    the persistent cache) at the same test two thirds of the way through, three runs in a row."""
    yield
    import gc

    jax.clear_caches()
    gc.collect()


def fake_devices_env(n: int) -> dict:
    """os.environ for a subprocess with `n` fake CPU devices (the other XLA flags kept)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    return dict(os.environ, XLA_FLAGS=" ".join([*flags, f"--xla_force_host_platform_device_count={n}"]),
                JAX_PLATFORMS="cpu")


def run_multidevice(code: str, n: int = 8, timeout: int = 600) -> str:
    """Run `code` in a fresh interpreter with `n` fake CPU devices; return its stdout."""
    env = fake_devices_env(n)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True,
                         text=True, env=env, timeout=timeout, cwd=REPO)
    if res.returncode:
        raise AssertionError(f"subprocess failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}")
    return res.stdout


@pytest.fixture(scope="session")
def micro_cfg():
    from dspark_jax.config import from_cli

    return from_cli(["micro"])


@pytest.fixture(scope="session")
def micro_target(micro_cfg):
    from flax import nnx

    from dspark_jax.parallel.sharding import create_model
    from dspark_jax.target import TargetModel

    return create_model(lambda: TargetModel(micro_cfg.target.model, rngs=nnx.Rngs(0)))


# torch's CPU wheel is at hand for Python 3.11 only; pyproject's test extra installs it there alone
TORCH_MISSING = ("torch not installed: the test extra installs it on Python 3.11 only; elsewhere install a CPU "
                 "build (README, \"The two commands\") to run the parity tests against transformers")


def _torch():
    return pytest.importorskip("torch", reason=TORCH_MISSING)


def _save_hf(kind: str, path: Path, dtype: str):
    torch = _torch()
    transformers = pytest.importorskip("transformers", reason="transformers not installed (pip install -e .[test])")
    torch.manual_seed(0)
    common = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if kind == "qwen3":
        cfg = transformers.Qwen3Config(head_dim=16, tie_word_embeddings=False, rope_theta=10000.0, **common)
        model = transformers.Qwen3ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(
            tie_word_embeddings=True,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
            **common,
        )
        model = transformers.LlamaForCausalLM(cfg)
    # Random init has tiny norms everywhere; make the norms non-trivial so they are tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    model.eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """name -> (directory, torch model) for tiny random Qwen3 and Llama checkpoints."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, kind, dtype in [("qwen3_f32", "qwen3", "float32"), ("qwen3_bf16", "qwen3", "bfloat16"),
                              ("llama_f32", "llama", "float32")]:
        d = root / name
        out[name] = (d, _save_hf(kind, d, dtype))
    return out


@pytest.fixture(scope="session")
def embedded_tiny_dir():
    """The tiny embedded target, built once per cache. A missing one is built by the command in a
    child process under XLA's default optimisation: its 200 training steps run there in about 55 s
    on 2 cores, about 125 s under the suite's fast-compile flags, while the other worker waits on
    the build's lock (docs/status.md, "CI time")."""
    from dspark_jax.embedded.target import embedded_target_dir, target_cache_dir, verify_target_dir

    if verify_target_dir(target_cache_dir("tiny")) is not None:
        res = subprocess.run([sys.executable, "-m", "dspark_jax", "embedded", "build", "--preset", "tiny",
                              "--no-progress"], env={**os.environ, "XLA_FLAGS": os.environ[_FOUND_ENV]},
                             capture_output=True, text=True, timeout=1800)
        assert res.returncode == 0, f"building the tiny embedded target failed:\n{res.stderr[-3000:]}"
    return embedded_target_dir(preset="tiny", progress=False, build=False)


@pytest.fixture(scope="session")
def tiny_dspark_drafter_dir(embedded_tiny_dir, tmp_path_factory):
    """An untrained DSpark drafter (gamma 4) for the tiny embedded target, saved to disk."""

    from flax import nnx

    from dspark_jax.config import DrafterSection
    from dspark_jax.drafter import registry
    from dspark_jax.drafter.frozen import attach_target
    from dspark_jax.io import drafter_dir as drafter_io
    from dspark_jax.io.hf import load_target
    from dspark_jax.parallel.sharding import create_model

    t = load_target(embedded_tiny_dir)
    dcfg = DrafterSection(kind="dspark", num_layers=1, gamma=4, markov_rank=16, target_layer_ids=(1, 3, 5),
                          mask_token_id=t.tokenizer.mask_id)
    d = create_model(lambda: registry.build(t.cfg, dcfg, rngs=nnx.Rngs(3)))
    attach_target(d, t.model)
    out = tmp_path_factory.mktemp("drafter") / "dspark"
    drafter_io.save(d, out)
    return out
