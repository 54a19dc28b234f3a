"""A configuration completed from its checkpoint: the target's model shape from config.json and
the drafter's mask token from the tokenizer. Programs compile from shapes, so planning memory or
compiling for a TPU slice needs `target.model` before any weight is read."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dspark_jax.config.loader import ConfigError
from dspark_jax.io.hf import read_config
from dspark_jax.text.tokenizer import Tokenizer

__all__ = ["with_checkpoint_model"]


def with_checkpoint_model(cfg, path=None, *, fallback_mask_token_id: int | None = None):
    """`cfg` with `target.model` read from the checkpoint's config.json (`path`, default
    `cfg.target.path`) and `drafter.mask_token_id`, when unset, from its tokenizer's <|mask|> token,
    else `fallback_mask_token_id` (Qwen3's tokenizer has none: the reference uses the unused
    embedding row 151669)."""

    path = Path(path or cfg.target.path)
    _, model = read_config(path)
    target = dataclasses.replace(cfg.target, model=model)
    drafter = cfg.drafter
    if drafter.mask_token_id is None:
        mask = None
        if (path / "tokenizer.json").is_file():
            mask = Tokenizer.load(path).mask_id
        if mask is None:
            mask = fallback_mask_token_id
        if mask is None:
            raise ConfigError("drafter.mask_token_id is not set and the tokenizer has no <|mask|> token: "
                              "set drafter.mask_token_id to an unused embedding row (Qwen3: 151669)")
        drafter = dataclasses.replace(drafter, mask_token_id=mask)
    return dataclasses.replace(cfg, target=target, drafter=drafter)
