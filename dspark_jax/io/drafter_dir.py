"""The one on-disk drafter format, for every kind.

A directory with `drafter.safetensors` (trainable Params only, our paths joined with dots,
e.g. `layers.q_proj`; the frozen embedding / LM head are re-attached from the target) and
`drafter_config.json` (format tag, the resolved DrafterSection, the target fingerprint, the
parameter dtype, and, for a drafter a training run wrote, `training`: the run settings an
export needs, e.g. `{"num_anchors": 512}`). Directories written by earlier versions, which
recorded fewer fields, load with the schema's defaults for the missing ones.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from dspark_jax.config import DrafterSection
from dspark_jax.drafter import registry
from dspark_jax.drafter.frozen import (
    Frozen,
    attach_target,
    check_target,
    trainable_state,
)
from dspark_jax.drafter.kinds.block import DSPARK
from dspark_jax.drafter.model import DrafterConfigError
from dspark_jax.io import safetensors_io
from dspark_jax.io.files import read_json
from dspark_jax.io.keymap import KeyRule, flatten, import_tensors
from dspark_jax.parallel.sharding import state_shardings

__all__ = ["FORMAT", "WEIGHTS_FILE", "CONFIG_FILE", "config_json", "read_config", "read_training", "save", "load",
           "param_shapes", "from_params"]

FORMAT = "dspark_jax.drafter/1"
WEIGHTS_FILE = "drafter.safetensors"
CONFIG_FILE = "drafter_config.json"


def _target_model(target):
    """A TargetModel from itself or from a LoadedTarget."""
    return target if hasattr(target, "lm_head_weight") else target.model


def config_json(drafter) -> dict:
    d = drafter.dcfg
    out = {"format": FORMAT, **dataclasses.asdict(d)}
    out["target_layer_ids"] = list(d.target_layer_ids)
    out["target_fingerprint"] = getattr(drafter, "target_fingerprint", None)
    out["param_dtype"] = str(np.dtype(jax.tree.leaves(nnx.state(drafter, nnx.Param))[0].dtype))
    return out


def _config_from_json(data: dict, source: str) -> tuple[DrafterSection, str | None]:
    if data.get("format") != FORMAT:
        raise DrafterConfigError(f"{source}: not a dspark_jax drafter config (format {data.get('format')!r}, "
                                 f"expected {FORMAT!r})")
    fields = {f.name for f in dataclasses.fields(DrafterSection)}
    kw = {k: v for k, v in data.items() if k in fields}
    kw.setdefault("kind", DSPARK.name)  # every version wrote it; a hand-written config without it means DSpark
    kw["target_layer_ids"] = tuple(kw.get("target_layer_ids") or ())
    try:
        return DrafterSection(**kw), data.get("target_fingerprint")
    except (TypeError, ValueError) as e:
        raise DrafterConfigError(f"{source}: invalid drafter config ({e})") from e


def read_config(path: str | Path) -> tuple[DrafterSection, str | None]:
    """(resolved DrafterSection, target fingerprint) of a drafter directory."""
    path = Path(path)
    cfg_file, w_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not cfg_file.is_file() or not w_file.is_file():
        raise FileNotFoundError(f"'{path}' is not a dspark_jax drafter directory (needs {CONFIG_FILE} and "
                                f"{WEIGHTS_FILE}); train one with `python -m dspark_jax.train` or import a "
                                "DeepSpec checkpoint with `python -m dspark_jax convert import`")
    return _config_from_json(read_json(cfg_file, DrafterConfigError), str(cfg_file))


def read_training(path: str | Path) -> dict:
    """The `training` record of a drafter directory ({} when it has none: a drafter no training
    run wrote)."""
    data = read_json(Path(path) / CONFIG_FILE, DrafterConfigError)
    training = data.get("training") if isinstance(data, dict) else None
    return dict(training) if isinstance(training, dict) else {}


def save(drafter, path: str | Path, training: dict | None = None) -> None:
    """Write the directory (created if needed; the two files are replaced). `training`: run
    settings recorded beside the config (JSON values; read back with `read_training`)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    flat = flatten(nnx.to_pure_dict(trainable_state(drafter)))
    tensors = {k: np.asarray(jax.device_get(v)) for k, v in flat.items()}
    safetensors_io.save_file(tensors, path / WEIGHTS_FILE, metadata={"format": FORMAT})
    cfg = config_json(drafter)
    if training:
        cfg["training"] = dict(training)
    (path / CONFIG_FILE).write_text(json.dumps(cfg, indent=2))


def load(path: str | Path, target, param_dtype=jnp.float32, dtype=None, mesh=None):
    """Any kind's drafter directory -> the drafter with `target`'s frozen weights attached
    (a TargetModel or LoadedTarget; its fingerprint must match the recorded one)."""
    path = Path(path)
    dcfg, fp = read_config(path)
    check_target(fp, target, f"drafter {path}")
    return from_params(target, dcfg, safetensors_io.load_file(path / WEIGHTS_FILE), param_dtype, dtype, mesh,
                       source=str(path / WEIGHTS_FILE))


def _factory(tmodel, dcfg: DrafterSection, param_dtype, dtype):
    return lambda: registry.build(tmodel.cfg, dcfg, rngs=nnx.Rngs(0), param_dtype=param_dtype, dtype=dtype)


def param_shapes(target_cfg, dcfg: DrafterSection) -> dict[str, tuple[int, ...]]:
    """Dotted Param path -> shape for a drafter of `dcfg`, without building any arrays."""
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: registry.build(target_cfg, dcfg, rngs=nnx.Rngs(0)))
    return {k: tuple(v.shape) for k, v in flatten(nnx.to_pure_dict(nnx.state(abstract, nnx.Param))).items()}


def from_params(target, dcfg: DrafterSection, params: dict, param_dtype=jnp.float32, dtype=None, mesh=None,
                source: str = "drafter params"):
    """A drafter of `dcfg` for `target` with Params from a nested or dotted-flat dict of arrays
    (every missing / unexpected / mis-shaped entry reported at once) and the target's frozen
    weights attached. No random initialisation."""

    tmodel = _target_model(target)
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(_factory(tmodel, dcfg, param_dtype, dtype))
    graphdef, pstate, fstate = nnx.split(abstract, nnx.Param, Frozen)
    expected = {k: tuple(v.shape) for k, v in flatten(nnx.to_pure_dict(pstate)).items()}
    rules = [KeyRule(re.escape(p), p) for p in expected]
    pure = import_tensors({k: np.asarray(v) for k, v in flatten(params).items()}, rules, expected, 0, source=source)
    np_dtype = ml_dtypes.bfloat16 if jnp.dtype(param_dtype) == jnp.bfloat16 else np.dtype(param_dtype)
    nnx.replace_by_pure_dict(pstate, jax.tree.map(lambda a: np.asarray(a).astype(np_dtype), pure))
    # host arrays put on the device (a transfer; jnp.asarray / jnp.zeros outside a trace compile a
    # small program per shape)
    fstate = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), fstate)
    if mesh is not None:
        pstate = jax.device_put(pstate, state_shardings(pstate, mesh))
        fstate = jax.device_put(fstate, state_shardings(fstate, mesh))
    else:
        pstate, fstate = jax.device_put((pstate, fstate))
    drafter = nnx.merge(graphdef, pstate, fstate)
    attach_target(drafter, tmodel)
    return drafter
