"""The frozen target LLM (Qwen3 / Llama-3 dense decoders) in Flax NNX."""

from dspark_jax.target.config import ModelConfig, RopeConfig
from dspark_jax.target.kv_cache import KVCache
from dspark_jax.target.paged_kv import PagedKVCache
from dspark_jax.target.transformer import ForwardOut, TargetModel

__all__ = ["ModelConfig", "RopeConfig", "KVCache", "PagedKVCache", "TargetModel", "ForwardOut"]
