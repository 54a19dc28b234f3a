"""Every drafter kind behind one interface: build from config, save, load.

dspark / dflash -> `model.Drafter`; eagle3 -> `eagle3.Eagle3Drafter`; mtp1 ->
`mtp.MTPDrafter`. On disk every kind is the same directory layout as `model.save_drafter`:
`drafter.safetensors` (trainable Params only, dotted paths) + `drafter_config.json`
(the resolved DrafterSection, the kind and the target fingerprint).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.io import safetensors_io
from dspark_jax.config import DrafterSection
from dspark_jax.drafter import model as dmodel
from dspark_jax.drafter.eagle3 import Eagle3Drafter
from dspark_jax.drafter.frozen import check_target, trainable_state
from dspark_jax.drafter.mtp import MTPDrafter
from dspark_jax.io.keymap import flatten
from dspark_jax.target.config import ModelConfig

KINDS = ("dspark", "dflash", "eagle3", "mtp1")


def resolve(target_cfg: ModelConfig, dcfg: DrafterSection) -> DrafterSection:
    """The fully resolved drafter config of any kind (what checkpoints record)."""
    if dcfg.kind in ("dspark", "dflash"):
        return dmodel.resolve_config(target_cfg, dcfg)
    if dcfg.kind == "eagle3":
        ids = dmodel.resolve_layer_ids(target_cfg, dcfg)
        return dataclasses.replace(dcfg, target_layer_ids=ids, num_target_features=len(ids), num_layers=1,
                                   markov_rank=0, confidence_head=False)
    if dcfg.kind == "mtp1":
        return dataclasses.replace(dcfg, target_layer_ids=(), num_target_features=0, num_layers=1, gamma=1,
                                   markov_rank=0, confidence_head=False)
    raise dmodel.DrafterConfigError(f"unknown drafter.kind '{dcfg.kind}'; choose one of: {', '.join(KINDS)}")


def build(target_cfg: ModelConfig, dcfg: DrafterSection, *, rngs: nnx.Rngs, param_dtype=jnp.float32, dtype=None,
          ttt_steps: int = 7):
    """A freshly initialised drafter of `dcfg.kind`; `.dcfg` holds the resolved config."""
    d = resolve(target_cfg, dcfg)
    if d.kind in ("dspark", "dflash"):
        return dmodel.Drafter(target_cfg, d, rngs=rngs, param_dtype=param_dtype, dtype=dtype)
    if d.kind == "eagle3":
        m = Eagle3Drafter(target_cfg, len(d.target_layer_ids), rngs=rngs, ttt_steps=ttt_steps,
                          param_dtype=param_dtype, dtype=dtype)
    else:
        m = MTPDrafter(target_cfg, rngs=rngs, param_dtype=param_dtype, dtype=dtype)
    m.dcfg = d
    m.target_fingerprint = None
    return m


def config_json(drafter) -> dict:
    d = drafter.dcfg
    out = {"format": dmodel.FORMAT, **dataclasses.asdict(d)}
    out["target_layer_ids"] = list(d.target_layer_ids)
    out["target_fingerprint"] = getattr(drafter, "target_fingerprint", None)
    out["param_dtype"] = str(np.dtype(jax.tree.leaves(nnx.state(drafter, nnx.Param))[0].dtype))
    return out


def save(drafter, path: str | Path) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    flat = flatten(nnx.to_pure_dict(trainable_state(drafter)))
    tensors = {k: np.asarray(jax.device_get(v)) for k, v in flat.items()}
    safetensors_io.save_file(tensors, path / dmodel.WEIGHTS_FILE, metadata={"format": dmodel.FORMAT})
    (path / dmodel.CONFIG_FILE).write_text(json.dumps(config_json(drafter), indent=2))


def read_config(path: str | Path) -> tuple[DrafterSection, str | None]:
    path = Path(path)
    cfg_file, w_file = path / dmodel.CONFIG_FILE, path / dmodel.WEIGHTS_FILE
    if not cfg_file.is_file() or not w_file.is_file():
        raise FileNotFoundError(f"'{path}' is not a dspark_jax drafter directory (needs {dmodel.CONFIG_FILE} and "
                                f"{dmodel.WEIGHTS_FILE}); train one with `python -m dspark_jax.train` or import a "
                                "DeepSpec checkpoint with `python -m dspark_jax.convert import`")
    data = json.loads(cfg_file.read_text())
    data.setdefault("kind", "dspark")
    return dmodel.config_from_json(data, str(cfg_file))


def load(path: str | Path, target, param_dtype=jnp.float32, dtype=None, mesh=None):
    """Any kind's drafter directory -> a drafter with the target's frozen weights attached."""
    path = Path(path)
    dcfg, fp = read_config(path)
    check_target(fp, target, f"drafter {path}")
    if dcfg.kind in ("dspark", "dflash"):
        return dmodel.load_drafter(path, target, param_dtype, dtype, mesh)
    tmodel = target if hasattr(target, "lm_head_weight") else target.model
    factory = lambda: build(tmodel.cfg, dcfg, rngs=nnx.Rngs(0), param_dtype=param_dtype, dtype=dtype)
    drafter = dmodel.fill_drafter(factory, tmodel, safetensors_io.load_file(path / dmodel.WEIGHTS_FILE),
                                  param_dtype, mesh, source=str(path))
    drafter.dcfg = dcfg
    return drafter
