"""The presets ship inside the wheel: after a non-editable install, `python -m dspark_jax.train
smollm2_135m_dspark` (a preset by name) resolves without the source tree.

`dspark_jax/configs` is a symlink to the top-level `configs/` (the one source of the presets);
the wheel must carry the files themselves. The wheel is built offline from a copy of the
sources (no build isolation, so no download) and imported from its unzipped contents, from a
working directory outside the repository.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PRESETS = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))
COST_TABLES = sorted(p.name for p in (ROOT / "configs" / "costs").glob("*.json"))

CHECK = """
import json, sys
import dspark_jax
from dspark_jax.config import from_cli
from dspark_jax.config.loader import CONFIG_DIR, ConfigError, preset_names, resolve_preset

cfg = from_cli(["qwen3_8b_dspark_v6e"])  # by name; it inherits qwen3_8b_dspark.yaml by name
try:
    resolve_preset("no_such_preset")
    missing = ""
except ConfigError as e:
    missing = str(e)
print(json.dumps({"package": dspark_jax.__file__, "config_dir": str(CONFIG_DIR),
                  "smollm2": str(resolve_preset("smollm2_135m_dspark")), "names": preset_names(),
                  "mesh": [cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor], "remat": cfg.train.remat,
                  "layers": list(cfg.drafter.target_layer_ids), "missing": missing}))
"""


def _sources(dest: Path) -> Path:
    """What the wheel is built from, copied so the build leaves nothing in the checkout."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    shutil.copytree(ROOT / "configs", dest / "configs")
    shutil.copytree(ROOT / "dspark_jax", dest / "dspark_jax", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    assert (dest / "dspark_jax" / "configs").is_symlink(), "dspark_jax/configs should link to ../configs"
    return dest


def test_wheel_ships_the_presets_and_they_resolve_by_name(tmp_path):
    src = _sources(tmp_path / "src")
    dist = tmp_path / "dist"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                            "-q", "-w", str(dist), str(src)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = dist.glob("dspark_jax-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        z.extractall(tmp_path / "site")
    assert {f"dspark_jax/configs/{p}" for p in PRESETS} <= names, sorted(n for n in names if "configs" in n)
    assert {f"dspark_jax/configs/costs/{c}" for c in COST_TABLES} <= names
    assert "dspark_jax/config/loader.py" in names

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    run = subprocess.run([sys.executable, "-c", CHECK], cwd=elsewhere, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])
    site = str((tmp_path / "site").resolve())
    assert got["package"].startswith(site), got  # the unzipped wheel, not the editable checkout
    assert got["config_dir"].startswith(site) and got["smollm2"].startswith(site), got
    assert got["names"] == [p.removesuffix(".yaml") for p in PRESETS]
    assert got["mesh"] == [4, 8, 1] and got["remat"] == "drafter_layers"
    assert got["layers"] == [1, 9, 17, 25, 33]
    assert "smollm2_135m_dspark" in got["missing"]


def test_checkout_resolves_presets_from_the_top_level_configs():
    from dspark_jax.config.loader import CONFIG_DIR, resolve_preset

    assert CONFIG_DIR == (ROOT / "configs").resolve()
    assert resolve_preset("micro") == CONFIG_DIR / "micro.yaml"


def _requirements() -> dict:
    """pyproject's dependencies and extras as parsed requirements, by extra ("" for the main list)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {"": [Requirement(r) for r in project["dependencies"]],
            **{k: [Requirement(r) for r in v] for k, v in project["optional-dependencies"].items()}}


def test_floor_environment_pins_the_lowest_versions_pyproject_admits():
    """.ci/floor.txt pins what the floor CI environment installs: each pin must be the lower bound
    pyproject.toml declares (a floor that is not tested is not a floor)."""
    deps = {r.name: r for r in _requirements()[""]}
    pins = [Requirement(line) for line in (ROOT / ".ci" / "floor.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    for pin in pins:
        (spec,) = pin.specifier
        assert spec.operator == "==", pin
        if pin.name in deps:
            lower = [s.version for s in deps[pin.name].specifier if s.operator == ">="]
            assert lower == [spec.version], f"{pin} in .ci/floor.txt, but pyproject.toml says {deps[pin.name]}"
    assert {"jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain"} <= {p.name for p in pins}


def test_supported_jax_range_and_the_tpu_extras_admit_the_newest_jax():
    reqs = _requirements()
    jax = next(r for r in reqs[""] if r.name == "jax")
    assert jax.specifier.contains("0.10.2") and jax.specifier.contains("0.12.0.1")
    assert not jax.specifier.contains("0.10.1") and not jax.specifier.contains("0.13.0")
    for extra in ("tpu", "aot"):
        tpu = next(r for r in reqs[extra] if r.name == "jax")
        assert tpu.extras == {"tpu"} and tpu.specifier.contains("0.12.0.1"), (extra, tpu)
    # torch's CPU wheel is at hand for Python 3.11 only: elsewhere the test extra leaves torch out
    torch = next(r for r in reqs["test"] if r.name == "torch")
    assert torch.marker.evaluate({"python_version": "3.11"}) and not torch.marker.evaluate({"python_version": "3.12"})
