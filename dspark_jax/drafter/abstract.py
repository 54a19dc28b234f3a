"""The models of a config as shapes: what the train and serving plans compile, with no memory."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from dspark_jax.config import Config
from dspark_jax.drafter import registry
from dspark_jax.target import TargetModel

__all__ = ["abstract_models"]


def abstract_models(cfg: Config):
    """The target and drafter as shapes with their shardings' names (no memory), as the trainer builds them."""
    tcfg = cfg.target.model
    dt = jnp.bfloat16 if cfg.target.dtype == "bfloat16" else jnp.float32
    with nnx.use_eager_sharding(False):
        target = nnx.eval_shape(lambda: TargetModel(tcfg, rngs=nnx.Rngs(0), param_dtype=dt))
        drafter = nnx.eval_shape(lambda: registry.build(tcfg, cfg.drafter, rngs=nnx.Rngs(0),
                                                        ttt_steps=cfg.train.eagle3_steps))
    target.attention = cfg.target.attention  # as the trainer sets it: the compiled step runs the same kernels
    return target, drafter
