"""The project's configuration schema. Presets live in configs/*.yaml.

Sections: target (which frozen LLM), drafter (which draft model), mesh (device layout).
Later stages (data, train, engine, scheduler) add their own sections here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dspark_jax.configlib import ConfigError, load_config, split_cli
from dspark_jax.model.config import ModelConfig

DrafterKind = Literal["dspark", "dflash", "eagle3", "mtp1"]
HeadType = Literal["vanilla", "gated", "rnn"]


@dataclass(frozen=True)
class TargetSection:
    path: str | None = None  # local Hugging Face checkpoint directory; None = the embedded default target
    dtype: Literal["float32", "bfloat16"] = "float32"
    model: ModelConfig | None = None  # architecture for a randomly initialised target (tests, benchmarks)


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


@dataclass(frozen=True)
class Config:
    target: TargetSection = field(default_factory=TargetSection)
    drafter: DrafterSection = field(default_factory=DrafterSection)
    mesh: MeshSection = field(default_factory=MeshSection)
    seed: int = 0


def from_cli(argv: list[str], cls=Config):
    """`[CONFIG.yaml] [section.key=value ...]` -> a validated config object."""
    path, overrides = split_cli(argv)
    return load_config(cls, path, overrides)


__all__ = ["Config", "TargetSection", "DrafterSection", "MeshSection", "ConfigError", "from_cli"]
