"""The reference's regeneration settings, importable without JAX (the command's --help shows them)."""

from __future__ import annotations

from dspark_jax.decoding.params import SamplingParams

DEFAULT_SAMPLING = SamplingParams(temperature=0.7, top_k=20, top_p=0.8)
# Reference-like lengths (it regenerates up to 4096 tokens) where the target's context allows.
DEFAULT_MAX_NEW, DEFAULT_MAX_PROMPT = 4096, 2048


def default_lengths(context: int, max_new: int | None, max_prompt: int | None) -> tuple[int, int]:
    """Unset lengths: the reference's (4096 new, 2048 prompt) cut to fit the target's context."""
    if max_new is None:
        max_new = min(DEFAULT_MAX_NEW, max(1, context // 2) if max_prompt is None else max(1, context - max_prompt))
    if max_prompt is None:
        max_prompt = min(DEFAULT_MAX_PROMPT, max(1, context - max_new))
    return max_new, max_prompt
