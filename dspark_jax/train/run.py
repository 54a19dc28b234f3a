"""The main job end to end: target -> regenerated data -> training -> held-out summary."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.config import Config
from dspark_jax.config.loader import ConfigError
from dspark_jax.data.corpora import build_corpus
from dspark_jax.data.dataset import TokenDataset
from dspark_jax.data.features import FeatureCache, FeatureCacheError, default_dir, ensure_features
from dspark_jax.data.formats import read_conversations
from dspark_jax.data.pipeline import PAD_ID, NoAssistantTokensError
from dspark_jax.data.regenerate import regenerate
from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.drafter import registry
from dspark_jax.drafter.frozen import TargetMismatchError
from dspark_jax.drafter.model import DrafterConfigError
from dspark_jax.embedded.target import embedded_target_dir
from dspark_jax.engine import measure_accepted_length
from dspark_jax.io import drafter_dir as drafter_io
from dspark_jax.io.cache import cache_root
from dspark_jax.io.hf import LoadedTarget, NotACheckpointError, load_target
from dspark_jax.io.keymap import CheckpointMismatchError
from dspark_jax.parallel.sharding import create_model, make_mesh
from dspark_jax.target import TargetModel
from dspark_jax.target.config import UnsupportedModelError
from dspark_jax.train.step import require_cacheable
from dspark_jax.train.trainer import Phases, Trainer, TrainingError, output_paths

EXPECTED_ERRORS = (ConfigError, TrainingError, DrafterConfigError, NoAssistantTokensError, NotACheckpointError,
                   CheckpointMismatchError, UnsupportedModelError, TargetMismatchError, FileNotFoundError,
                   FeatureCacheError)


def prepare_target(cfg: Config, phases: Phases | None = None, mesh=None) -> LoadedTarget:
    """The frozen target: a local HF checkpoint, a random model of a given shape, or the embedded default.

    With a `mesh`, the weights go straight onto it (each host reads its own chips' blocks)."""
    loaded = _load_or_build_target(cfg, phases, mesh)
    loaded.model.attention = cfg.target.attention
    return loaded


def _load_or_build_target(cfg: Config, phases: Phases | None, mesh) -> LoadedTarget:
    tc = cfg.target
    phases = phases or Phases()
    if tc.path:
        with phases("load target"):
            target = load_target(tc.path, dtype=tc.dtype, mesh=mesh)
        if tc.model is not None:  # a preset that names an architecture: the checkpoint must be it
            keys = ("vocab_size", "hidden_size", "num_layers", "num_heads",
                    "num_kv_heads", "head_dim", "intermediate_size")
            diff = [f"{k} {getattr(target.cfg, k)} != {getattr(tc.model, k)}" for k in keys
                    if getattr(target.cfg, k) != getattr(tc.model, k)]
            if diff:
                raise ConfigError(f"checkpoint {tc.path} does not match the config's target.model ({'; '.join(diff)}): "
                                  "use the preset for this model, or set target.model=null")
        return target
    if tc.model is not None and not tc.random_init:
        raise ConfigError(
            f"this config describes a {tc.model.num_layers}-layer {tc.model.arch} target "
            f"(hidden {tc.model.hidden_size}) "
            "but gives no checkpoint: pass target.path=/path/to/hf_checkpoint (or target.random_init=true for a "
            "randomly initialised target of that shape)"
        )
    if tc.model is not None:
        dt = jnp.bfloat16 if tc.dtype == "bfloat16" else jnp.float32
        # always initialised by one jitted program (on the mesh, or one device): eager initialisation
        # draws other values, and a drafter must find the same random target when it is reloaded

        mesh = mesh if mesh is not None else make_mesh(1, 1, 1, devices=jax.devices()[:1])
        model = create_model(lambda: TargetModel(tc.model, rngs=nnx.Rngs(cfg.seed + 1000), param_dtype=dt), mesh)
        return LoadedTarget(model, tc.model, tc.model.to_hf(), Path("<random>"), None, None)

    with phases("target build"):
        path = embedded_target_dir(build=True, progress=True)
    with phases("load target"):
        return load_target(path, dtype=tc.dtype, mesh=mesh)


def with_mask_token(cfg: Config, target: LoadedTarget) -> Config:
    """Fill drafter.mask_token_id from the tokenizer's <|mask|> token when not set."""
    if cfg.drafter.mask_token_id is not None:
        return cfg
    mask = target.tokenizer.mask_id if target.tokenizer is not None else None
    if mask is None:
        raise ConfigError("drafter.mask_token_id is not set and the tokenizer has no <|mask|> token: "
                          "set drafter.mask_token_id to an unused embedding row (Qwen3: 151669)")
    return dataclasses.replace(cfg, drafter=dataclasses.replace(cfg.drafter, mask_token_id=mask))


def _data_key(cfg: Config, target: LoadedTarget, split: str) -> str:
    d = cfg.data
    info = {"target": str(target.path),
            "hf": hashlib.sha256(json.dumps(target.hf_config, sort_keys=True, default=str).encode()).hexdigest(),
            "prompts": d.prompts, "n": d.num_prompts if split == "train" else d.num_heldout_prompts,
            "max_new": d.regen_max_new_tokens, "t": d.regen_temperature, "p": d.regen_top_p, "k": d.regen_top_k,
            "seed": cfg.seed, "split": split}
    return hashlib.sha256(json.dumps(info, sort_keys=True, default=str).encode()).hexdigest()[:12]


def regenerate_split(cfg: Config, target: LoadedTarget, split: str, n: int, key: str) -> TokenDataset:
    """Responses to `n` prompts regenerated by the target (docs/method.md §4), cached by
    everything that determines them; an interrupted regeneration resumes where it stopped."""

    d = cfg.data
    out = cache_root() / "regen" / key / split
    if (out / "meta.json").is_file():
        ds = TokenDataset(out)
        if len(ds) >= n:
            return ds
    if d.prompts:
        convs = read_conversations(d.prompts)
        n_held = min(d.num_heldout_prompts, max(len(convs) // 10, 1))
        convs = convs[:n_held] if split == "heldout" else convs[n_held:]
    else:
        per = -(-n // 3) + 8
        convs = build_corpus("train" if split == "train" else "heldout", cfg.seed, n_code=per, n_math=per, n_prose=per)
    n = min(n, len(convs))
    sampling = SamplingParams(d.regen_temperature, d.regen_top_k, d.regen_top_p)
    regenerate(target, convs, out, num=n, batch_size=d.regen_batch_size, max_new_tokens=d.regen_max_new_tokens,
               max_prompt_len=max(16, d.seq_len - d.regen_max_new_tokens - 8), sampling=sampling,
               seed=cfg.seed + (0 if split == "train" else 10_000), resume=True)
    return TokenDataset(out)


def prepare_data(cfg: Config, target: LoadedTarget, phases: Phases) -> tuple[TokenDataset, TokenDataset | None]:
    """Token datasets: given paths, or responses regenerated by the target (cached)."""
    d = cfg.data
    if d.path:
        train = TokenDataset(d.path)
        held = TokenDataset(d.heldout_path) if d.heldout_path else None
        return train, held

    target.require_tokenizer()
    out = {}
    with phases("regeneration"):
        for split, n in (("train", d.num_prompts), ("heldout", d.num_heldout_prompts)):
            out[split] = regenerate_split(cfg, target, split, n, key=_data_key(cfg, target, split))
    return out["train"], out["heldout"]


def prepare_features(cfg: Config, target: LoadedTarget, train_ds, phases: Phases | None = None, mesh=None,
                     progress: bool = True) -> FeatureCache | None:
    """With `data.features: cache`, the training set's feature cache: computed where missing
    (resuming an interrupted write), then opened; None when the features are computed online."""
    d = cfg.data
    if d.features != "cache":
        return None
    require_cacheable(registry.get_kind(cfg.drafter.kind))  # before any work
    path = d.features_path
    if path is None:
        if getattr(train_ds, "path", None) is None:
            raise ConfigError("data.features=cache needs data.features_path for a dataset that is not on disk")
        path = default_dir(train_ds.path)
    dcfg = registry.resolve(target.cfg, cfg.drafter)
    with (phases or Phases())("features"):
        return ensure_features(target.model, train_ds, path, layers=dcfg.target_layer_ids, seq_len=d.seq_len,
                               pad_id=PAD_ID, progress=progress, mesh=mesh)


def heldout_prompts(ds, n: int) -> list[list[int]]:
    """The prompt part (tokens before the first assistant token) of the first n records."""
    out = []
    for i in range(min(n, len(ds))):
        rec = ds[i]
        first = int(rec["loss_mask"].argmax()) if rec["loss_mask"].any() else len(rec["tokens"])
        if first >= 2:
            out.append(rec["tokens"][:first].tolist())
    return out


def measure_heldout_tau(cfg: Config, target: LoadedTarget, held_ds, drafter) -> float:
    """Accepted length of real speculative decoding (fixed gamma, temperature 1) on held-out prompts.

    `drafter`: a drafter directory, or the trained drafter (any parameter layout; it is rebuilt
    on this process's devices, next to the target)."""

    if isinstance(drafter, (str, Path)):
        drafter = drafter_io.load(drafter, target.model)
    else:
        params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(drafter, nnx.Param)))
        drafter = drafter_io.from_params(target.model, drafter.dcfg, params)
    prompts = heldout_prompts(held_ds, cfg.train.measure_prompts)
    stops = tuple(target.tokenizer.stop_ids) if target.tokenizer is not None else ()
    return float(measure_accepted_length(target.model, drafter, prompts,
                                         max_new_tokens=cfg.train.measure_max_new_tokens,
                                         stop_ids=stops, seed=cfg.seed))


def format_summary(summary: dict, phases: Phases) -> str:
    ev = summary.get("eval", {})
    lines = [
        "",
        "=" * 60,
        f"training finished at step {summary['step']}/{summary['total_steps']}"
        + (" (preempted)" if summary["preempted"] else ""),
        f"checkpoint:      {summary['checkpoint']}",
        f"drafter export:  {summary['drafter'] or 'none (preempted: rerun the same command to resume)'}",
    ]
    if "eval/expected_accepted_length" in ev:
        lines += [
            f"held-out expected accepted length (1 + sum_j prod c*): {ev['eval/expected_accepted_length']:.3f} "
            f"(95 % CI over held-out batches {ev['eval/expected_accepted_length_ci95'][0]:.3f}-"
            f"{ev['eval/expected_accepted_length_ci95'][1]:.3f})",
            f"held-out acceptance per position: {ev['eval/acceptance_per_position']}",
        ]
    if "eval/loss" in ev:
        lines.append(f"held-out loss: {ev['eval/loss']:.4f}")
    if "measured_tau" in summary:
        lines.append(f"held-out measured accepted length (speculative decoding): {summary['measured_tau']:.3f}")
    lines += ["time per phase:", phases.table(), "=" * 60]
    return "\n".join(lines)


def run(cfg: Config, progress: bool = True) -> dict:
    phases = Phases()
    t0 = time.perf_counter()

    mesh = make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    target = prepare_target(cfg, phases, mesh)
    cfg = with_mask_token(cfg, target)
    train_ds, held_ds = prepare_data(cfg, target, phases)
    features = prepare_features(cfg, target, train_ds, phases, mesh, progress)
    with phases("setup and compile"):
        trainer = Trainer(cfg, target.model, train_ds, held_ds, progress=progress, phases=phases, mesh=mesh,
                          features=features)
    trainable = sum(int(x.size) for x in jax.tree.leaves(trainer.state.params))
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    if held_ds is not None and cfg.train.measure_prompts > 0 and not summary["preempted"]:
        with phases("speculative decoding"):
            summary["measured_tau"] = measure_heldout_tau(cfg, target, held_ds, trainer.exported)
        if jax.process_index() != 0:  # process 0 prints it in the summary
            print(f"[process {jax.process_index()}] held-out measured accepted length: {summary['measured_tau']:.3f}")
    summary["trainable_params"] = trainable
    summary["wall_s"] = time.perf_counter() - t0
    summary["phases_s"] = dict(phases.times)
    summary["phases_compile_s"] = dict(phases.compile)  # compiling and reading stored programs back
    summary["phases_stored_read_s"] = dict(phases.reading)
    if jax.process_index() == 0:
        remote, local = output_paths(cfg.train.output_dir)
        text = json.dumps(summary, indent=2)
        (local / "summary.json").write_text(text)
        if remote != local:
            (remote / "summary.json").write_text(text)
        print(format_summary(summary, phases))
    return summary
