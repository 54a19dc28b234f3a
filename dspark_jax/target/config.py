"""Architecture of a target decoder, read from and written to Hugging Face config.json."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
}


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 1_000_000.0
    type: Literal["default", "llama3"] = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    arch: Literal["qwen3", "llama"] = "qwen3"
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 192
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalises q and k per head before RoPE; Llama does not."""
        return self.arch == "qwen3"

    @property
    def hf_architecture(self) -> str:
        return {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[self.arch]

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        archs = hf.get("architectures") or []
        model_type = hf.get("model_type", "")
        arch = None
        for a in archs:
            arch = SUPPORTED_ARCHITECTURES.get(a, arch)
        if arch is None and model_type in ("qwen3", "llama"):
            arch = model_type
        if arch is None or any(k in hf for k in ("num_experts", "num_local_experts", "n_routed_experts")):
            name = ", ".join(archs) or model_type or "unknown"
            raise UnsupportedModelError(
                f"unsupported architecture '{name}': dspark_jax loads dense "
                f"{' / '.join(SUPPORTED_ARCHITECTURES)} checkpoints "
                "(mixture-of-experts and other families are not implemented)"
            )
        heads = hf["num_attention_heads"]
        rope_params = dict(hf.get("rope_parameters") or {})
        scaling = dict(hf.get("rope_scaling") or {})
        rp = {**scaling, **rope_params}
        theta = rp.get("rope_theta", hf.get("rope_theta", 10000.0))
        rtype = rp.get("rope_type", rp.get("type", "default")) or "default"
        if rtype not in ("default", "llama3"):
            raise UnsupportedModelError(f"unsupported rope_type '{rtype}': supported are 'default' and 'llama3'")
        rope = RopeConfig(
            theta=float(theta),
            type=rtype,
            factor=float(rp.get("factor", 1.0)),
            low_freq_factor=float(rp.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rp.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(rp.get("original_max_position_embeddings", 8192)),
        )
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise UnsupportedModelError("checkpoints with attention_bias or mlp_bias are not supported")
        eos = hf.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return cls(
            arch=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=rope,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos,
        )

    def to_hf(self, **extra) -> dict:
        rope = {"rope_theta": self.rope.theta, "rope_type": self.rope.type}
        if self.rope.type == "llama3":
            rope.update(
                factor=self.rope.factor,
                low_freq_factor=self.rope.low_freq_factor,
                high_freq_factor=self.rope.high_freq_factor,
                original_max_position_embeddings=self.rope.original_max_position_embeddings,
            )
        out = {
            "architectures": [self.hf_architecture],
            "model_type": self.arch,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope.theta,
            "rope_parameters": rope,
            "hidden_act": "silu",
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        if self.rope.type == "llama3":
            out["rope_scaling"] = dict(rope)
        out.update(extra)
        return out

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)
