"""The project's configuration schema. Presets live in configs/*.yaml.

Sections: target (which frozen LLM), drafter (which draft model), mesh (device layout).
Later stages (data, train, engine, scheduler) add their own sections here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from dspark_jax.config.loader import ConfigError, load_config, split_cli
from dspark_jax.names import KIND_NAMES
from dspark_jax.parallel.slices import parse_slice
from dspark_jax.target.config import ModelConfig

DrafterKind = Literal[KIND_NAMES]
HeadType = Literal["vanilla", "gated", "rnn"]
FEATURE_SOURCES = ("online", "cache")


@dataclass(frozen=True)
class TargetSection:
    path: str | None = None  # local Hugging Face checkpoint directory; None = the embedded default target
    dtype: Literal["float32", "bfloat16"] = "float32"
    model: ModelConfig | None = None  # the target's architecture (presets: for planning; with random_init: built)
    random_init: bool = False  # build a randomly initialised target of `model` (tests, benchmarks)
    # the frozen forward's causal attention: auto = splash kernel on TPU where it fits
    # (sequence and head_dim multiples of 128), dense elsewhere
    attention: Literal["auto", "dense", "splash"] = "auto"


@dataclass(frozen=True)
class DrafterSection:
    kind: DrafterKind = "dspark"
    num_layers: int = 2
    gamma: int = 7  # block size: draft tokens per round
    target_layer_ids: tuple[int, ...] | None = None  # None = the paper's default formula
    num_target_features: int = 5
    markov_rank: int = 256
    head_type: HeadType = "vanilla"
    confidence_head: bool = True
    mask_token_id: int | None = None  # None = the tokenizer's <|mask|> token
    sliding_window: int | None = None  # context window of the drafter (paper production: 128)

    def __post_init__(self):
        if self.gamma < 1:
            raise ValueError(f"gamma must be >= 1 (draft tokens per round), got {self.gamma}")
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank must be >= 0 (0 = no Markov head), got {self.markov_rank}")
        ids = self.target_layer_ids
        if ids is not None and any(b <= a for a, b in zip(ids, ids[1:])):
            raise ValueError(f"target_layer_ids must be strictly increasing, got {list(ids)}")


@dataclass(frozen=True)
class MeshSection:
    data: int = -1  # -1: all devices not used by fsdp x tensor
    fsdp: int = 1
    tensor: int = 1
    # the Cloud TPU slice the preset is laid out for (e.g. "v6e-32"): `train.plan --compile`
    # compiles for it with the TPU compiler; None = no particular slice
    slice: str | None = None

    def __post_init__(self):
        if self.slice is not None:
            parse_slice(self.slice)  # an unknown name fails at load, listing the valid ones


@dataclass(frozen=True)
class DataSection:
    path: str | None = None  # token dataset (data/dataset.py format); None = regenerate with the target
    heldout_path: str | None = None  # held-out token dataset; None = regenerate held-out prompts
    prompts: str | None = None  # prompts jsonl to regenerate from; None = the embedded corpora
    num_prompts: int = 1200
    num_heldout_prompts: int = 64
    regen_max_new_tokens: int = 128
    regen_batch_size: int = 64
    regen_temperature: float = 0.7
    regen_top_p: float = 0.8
    regen_top_k: int = 20
    seq_len: int = 256  # the embedded target's context; real presets use 4096
    num_anchors: int = 64
    # the frozen target's drafter inputs: "online" = a target forward in every step; "cache" =
    # computed once (data/features.py) and read with the tokens (not for kinds whose loss reads logits)
    features: str = "online"
    features_path: str | None = None  # the feature cache's directory; None = <data.path>/features

    def __post_init__(self):
        if self.seq_len < 2 or self.num_anchors < 1:
            raise ValueError("seq_len must be >= 2 and num_anchors >= 1")
        if self.features not in FEATURE_SOURCES:
            raise ValueError(f"features must be 'online' (a target forward per step) or 'cache' (computed once, "
                             f"read from disk), got {self.features!r}")


@dataclass(frozen=True)
class TrainSection:
    output_dir: str = "runs/dspark"
    batch_size: int = 8  # global sequences per optimiser update
    grad_accum: int = 1  # micro-batches per update (activations live for one at a time)
    steps: int | None = None  # None = epochs over the dataset
    epochs: float = 1.0
    lr: float = 6e-4
    warmup_frac: float = 0.04
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    clip_norm: float = 1.0
    compute_dtype: Literal["float32", "bfloat16"] = "float32"  # master weights stay float32
    # "drafter_layers": recompute each drafter layer (its block-to-context attention scores) in the
    # backward instead of storing all layers' at once; the frozen target never stores any
    remat: Literal["none", "drafter_layers"] = "none"
    loss_ce: float = 0.1
    loss_l1: float = 0.9
    loss_conf: float = 1.0
    # slot j's loss weight is exp(-j / loss_decay); "gamma" takes the drafter's gamma, the paper's
    # exp(-(k - 1) / gamma) for position k = j + 1 (4.0: DeepSpec's constant, docs/method.md "Loss")
    loss_decay: float | Literal["gamma"] = 4.0
    loss_conf_detach: bool = False  # the confidence head reads stop_gradient(backbone output): BCE trains the head only
    # "kind": the kind's own weighting (DFlash: CE only; DSpark: the loss_* above); "config": loss_* for every kind
    loss_weights: Literal["kind", "config"] = "kind"
    anchor_chunk: int = 64  # anchors per loss chunk (vocabulary-sized tensors exist per chunk only)
    eagle3_steps: int = 7
    checkpoint_every: int = 200
    keep_checkpoints: int = 3
    eval_every: int = 200
    eval_batches: int = 8
    log_every: int = 10
    resume: bool = True
    stop_after_steps: int | None = None  # stop (with a checkpoint) after this many steps of this run
    measure_prompts: int = 32  # held-out prompts decoded speculatively at the end (0 = skip)
    measure_max_new_tokens: int = 64

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.grad_accum < 1 or self.batch_size % self.grad_accum:
            raise ValueError(f"grad_accum ({self.grad_accum}) must be >= 1 and divide batch_size ({self.batch_size})")
        if not 0 <= self.warmup_frac < 1:
            raise ValueError(f"warmup_frac must be in [0, 1), got {self.warmup_frac}")
        if self.loss_decay != "gamma" and not self.loss_decay > 0:
            raise ValueError(f"loss_decay must be > 0 (slot j weighs exp(-j / loss_decay)) or 'gamma' (the paper's "
                             f"exp(-(k - 1) / gamma)), got {self.loss_decay!r}")


@dataclass(frozen=True)
class Config:
    target: TargetSection = field(default_factory=TargetSection)
    drafter: DrafterSection = field(default_factory=DrafterSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    mesh: MeshSection = field(default_factory=MeshSection)
    seed: int = 0


def from_cli(argv: list[str], cls=Config):
    """`[CONFIG.yaml] [section.key=value ...]` -> a validated config object."""
    path, overrides = split_cli(argv)
    return load_config(cls, path, overrides)


def served_config(preset: str, dtype: str | None = None, gamma: int | None = None) -> Config:
    """A preset as its target is served (costs predict, bench roofline): it must name a target
    model; `dtype` replaces the target's (and so what the drafter is cast to), `gamma` the
    drafter's block."""
    cfg = from_cli([preset])
    if cfg.target.model is None:
        raise ConfigError(f"{preset} names no target.model: use a preset such as configs/qwen3_8b_dspark.yaml")
    if dtype is not None:
        cfg = dataclasses.replace(cfg, target=dataclasses.replace(cfg.target, dtype=dtype))
    if gamma:
        cfg = dataclasses.replace(cfg, drafter=dataclasses.replace(cfg.drafter, gamma=gamma))
    return cfg


__all__ = ["Config", "TargetSection", "DrafterSection", "DataSection", "TrainSection",
           "MeshSection", "ConfigError", "from_cli", "served_config"]
