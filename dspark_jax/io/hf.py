"""Load a local Hugging Face Qwen3 / Llama checkpoint directory into our TargetModel.

No torch, no pickle, no remote code: config.json is read as data, weights come from
safetensors files, and a chat template is only ever rendered in a sandboxed Jinja env.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from dspark_jax.io import safetensors_io
from dspark_jax.io.files import read_json
from dspark_jax.io.keymap import (
    KeyRule,
    export_tensors,
    flatten,
    import_tensors,
    set_path,
)
from dspark_jax.target.config import ModelConfig
from dspark_jax.target.transformer import TargetModel, layer_param_shapes

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

def decoder_layer_rules(prefix: str) -> list[KeyRule]:
    """Key rules of the stacked decoder layers under `prefix` (e.g. "model." for HF targets,
    "" for DeepSpec drafters)."""
    L = re.escape(prefix) + r"layers\.(?P<layer>\d+)\."
    return [
        KeyRule(L + r"input_layernorm\.weight", "layers.input_norm"),
        KeyRule(L + r"self_attn\.q_proj\.weight", "layers.q_proj", transpose=True),
        KeyRule(L + r"self_attn\.k_proj\.weight", "layers.k_proj", transpose=True),
        KeyRule(L + r"self_attn\.v_proj\.weight", "layers.v_proj", transpose=True),
        KeyRule(L + r"self_attn\.o_proj\.weight", "layers.o_proj", transpose=True),
        KeyRule(L + r"self_attn\.q_norm\.weight", "layers.q_norm"),
        KeyRule(L + r"self_attn\.k_norm\.weight", "layers.k_norm"),
        KeyRule(L + r"post_attention_layernorm\.weight", "layers.post_norm"),
        KeyRule(L + r"mlp\.gate_proj\.weight", "layers.gate_proj", transpose=True),
        KeyRule(L + r"mlp\.up_proj\.weight", "layers.up_proj", transpose=True),
        KeyRule(L + r"mlp\.down_proj\.weight", "layers.down_proj", transpose=True),
    ]


TARGET_KEY_TABLE = [
    KeyRule(r"model\.embed_tokens\.weight", "embed"),
    *decoder_layer_rules("model."),
    KeyRule(r"model\.norm\.weight", "final_norm"),
    KeyRule(r"lm_head\.weight", "lm_head", transpose=True),
]
# Buffers some exporters write; never parameters.
IGNORED_KEYS = (r".*rotary_emb\.inv_freq",)


class NotACheckpointError(FileNotFoundError):
    pass


def checkpoint_dtype(path: str | Path) -> str:
    """"bfloat16" when the checkpoint's config says its weights are stored in bf16, else "float32"."""
    cfg = Path(path) / "config.json"
    hf = read_json(cfg, NotACheckpointError) if cfg.is_file() else {}
    return ("bfloat16" if str(hf.get("torch_dtype") or hf.get("dtype") or "") in ("bfloat16", "torch.bfloat16")
            else "float32")


from dspark_jax.parallel.sharding import state_shardings
from dspark_jax.text.chat import load_chat_template
from dspark_jax.text.tokenizer import Tokenizer


def parse_dtype(dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype '{dtype}'; choose one of: {', '.join(DTYPES)}")
        return DTYPES[dtype]
    if dtype in (jnp.float32, jnp.bfloat16, np.float32, ml_dtypes.bfloat16):
        return jnp.dtype(dtype)
    raise ValueError(f"unsupported dtype {dtype!r}; choose one of: {', '.join(DTYPES)}")


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    shapes = {"embed": (cfg.vocab_size, cfg.hidden_size), "final_norm": (cfg.hidden_size,)}
    for name, (shape, _) in layer_param_shapes(cfg).items():
        shapes[f"layers.{name}"] = (cfg.num_layers, *shape)
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (cfg.hidden_size, cfg.vocab_size)
    return shapes


def read_config(path: str | Path) -> tuple[dict, ModelConfig]:
    path = Path(path)
    if not path.is_dir():
        raise NotACheckpointError(f"'{path}' is not a directory; "
                                  "pass a Hugging Face checkpoint directory (config.json + *.safetensors)")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise NotACheckpointError(f"'{path}' is not a Hugging Face checkpoint directory: it has no config.json")
    hf = read_json(cfg_file, NotACheckpointError)
    return hf, ModelConfig.from_hf(hf)


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / n for n in names]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise NotACheckpointError(f"{path}: the safetensors index names files "
                                      f"that are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        extra = (" (only PyTorch .bin weights found: convert them to safetensors; pickled weights are never loaded)"
                 if list(path.glob("*.bin")) else "")
        raise NotACheckpointError(f"'{path}' has no *.safetensors weights{extra}")
    return files


def read_weights(path: str | Path) -> dict[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    for f in weight_files(Path(path)):
        tensors.update(safetensors_io.load_file(f))
    return tensors


def build_from_pure(cfg: ModelConfig, pure: dict, dtype, mesh=None, model_dtype=None) -> TargetModel:
    """Construct a TargetModel without random init and fill it from a nested dict of arrays."""
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: TargetModel(cfg, rngs=nnx.Rngs(0), param_dtype=dtype, dtype=model_dtype))
    graphdef, state = nnx.split(abstract)
    if mesh is not None:
        # each device's block is read from the (memory-mapped) checkpoint on its own host: no host
        # holds the whole model, no chip receives more than its shard

        shardings = flatten(nnx.to_pure_dict(state_shardings(state, mesh)))
        placed: dict = {}
        for path, leaf in flatten(pure).items():
            set_path(placed, path, jax.make_array_from_callback(
                tuple(leaf.shape), shardings[path], lambda idx, a=leaf: np.asarray(a[idx]).astype(dtype)))
        nnx.replace_by_pure_dict(state, placed)
        return nnx.merge(graphdef, state)
    cast = jax.tree.map(lambda a: np.asarray(a).astype(dtype), pure)
    nnx.replace_by_pure_dict(state, cast)
    state = jax.device_put(state)  # a transfer: jnp.asarray would compile a small program per shape
    return nnx.merge(graphdef, state)


@dataclass
class LoadedTarget:
    model: TargetModel
    cfg: ModelConfig
    hf_config: dict
    path: Path
    tokenizer: object | None
    chat_template: str | None

    def require_tokenizer(self):
        if self.tokenizer is None:
            raise FileNotFoundError(f"{self.path} has no tokenizer.json, "
                                    "and this command needs a tokenizer: "
                                    "add the model's tokenizer.json to the directory")
        return self.tokenizer


def load_target(path: str | Path, dtype="float32", mesh=None, load_tokenizer: bool = True) -> LoadedTarget:
    """Load a local HF checkpoint (config.json, safetensors, tokenizer.json, chat template).

    `dtype`: "float32", "bfloat16" or "auto" (the dtype the checkpoint is stored in)."""
    path = Path(path)
    dt = parse_dtype(checkpoint_dtype(path) if dtype == "auto" else dtype)
    hf, cfg = read_config(path)
    tensors = read_weights(path)
    ignore = IGNORED_KEYS + ((r"lm_head\.weight",) if cfg.tie_word_embeddings else ())
    pure = import_tensors(tensors, TARGET_KEY_TABLE, expected_shapes(cfg), cfg.num_layers,
                          source=str(path), ignore=ignore,
                          lazy=mesh is not None)
    model = build_from_pure(cfg, pure, dt, mesh)
    tokenizer = None
    if load_tokenizer and (path / "tokenizer.json").is_file():
        tokenizer = Tokenizer.load(path)

    return LoadedTarget(model, cfg, hf, path, tokenizer, load_chat_template(path))


def model_pure_dict(model: nnx.Module) -> dict:
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def save_target(model: TargetModel, path: str | Path, extra_config: dict | None = None, dtype="float32") -> None:
    """Write the Hugging Face layout (config.json + model.safetensors) that `load_target` reads."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    np_dtype = np.float32 if parse_dtype(dtype) == jnp.float32 else ml_dtypes.bfloat16
    pure = jax.tree.map(lambda a: np.asarray(a).astype(np_dtype), model_pure_dict(model))
    pure = {k: v for k, v in pure.items() if v is not None}
    tensors = export_tensors(pure, TARGET_KEY_TABLE, model.cfg.num_layers)
    safetensors_io.save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    hf = model.cfg.to_hf(torch_dtype=dtype, **(extra_config or {}))
    (path / "config.json").write_text(json.dumps(hf, indent=2))


__all__ = ["load_target", "save_target", "LoadedTarget", "TARGET_KEY_TABLE", "flatten"]
