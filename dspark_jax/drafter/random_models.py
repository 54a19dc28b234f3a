"""Random targets and drafters of any shape and kind, for timing: `costs measure` and the roofline
benchmark time the compiled programs of a config's shapes without a checkpoint, since a program's
time depends on the shapes and dtypes, not on the weights' values.

Random init (std 0.02) gives near-uniform distributions, under which drafts are almost never
accepted: here the target's embedding is rescaled so its next-token distributions are peaked, and
the drafters' heads are rescaled so their proposals are informative (or, for `bad=True`,
anti-correlated with the target), so rounds commit a realistic number of tokens. The tests build
on the same models (testing/tiny.py).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from dspark_jax.config import DrafterSection
from dspark_jax.drafter import registry
from dspark_jax.drafter.frozen import attach_target
from dspark_jax.parallel.sharding import create_model
from dspark_jax.target import TargetModel
from dspark_jax.target.config import ModelConfig

__all__ = ["tiny_config", "random_target", "random_drafter"]


def tiny_config(vocab_size: int = 16, hidden_size: int = 32, num_layers: int = 2) -> ModelConfig:
    """The smallest target shape every drafter kind and engine path accepts (`costs measure --target tiny`)."""
    return ModelConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                       num_layers=num_layers, num_heads=2, num_kv_heads=1, head_dim=hidden_size // 2,
                       tie_word_embeddings=True, max_position_embeddings=512)


def _scale(var, factor):
    var.set_value(var[...] * factor)


def random_target(cfg: ModelConfig, seed: int = 0, logit_scale: float = 3.0, mesh=None,
                param_dtype=jnp.float32) -> TargetModel:
    """Random target whose logits have standard deviation about `logit_scale`."""
    t = create_model(lambda: TargetModel(cfg, rngs=nnx.Rngs(seed), param_dtype=param_dtype), mesh)
    _scale(t.embed, logit_scale / (0.02 * cfg.hidden_size ** 0.5))
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        _scale(getattr(t.layers, name), 10.0)
    return t


def random_drafter(kind: str, target: TargetModel, *, gamma: int = 3, seed: int = 1, bad: bool = False,
                 head_type: str = "vanilla", markov_scale: float = 10.0, mesh=None, dcfg: DrafterSection | None = None,
                 dtype=None):
    """A random drafter of `kind` attached to `target` (Eagle3 fuses layer 0 only).

    `dcfg`: a DSpark / DFlash drafter of that shape instead of the one-layer, rank-8 default (a
    preset's drafter section, so `costs measure` times the drafter a run would train); `dtype`:
    the compute dtype (parameters stay float32, as a loaded drafter's do)."""
    cfg = target.cfg
    adapter = registry.get_kind(kind)
    section = dcfg or adapter.random_section(cfg, gamma=gamma, head_type=head_type)
    d = create_model(lambda: registry.build(cfg, section, rngs=nnx.Rngs(seed), dtype=dtype), mesh)
    if getattr(d, "markov_w1", None) is not None:
        _scale(d.markov_w1, markov_scale)
        _scale(d.markov_w2, markov_scale)
    if getattr(d, "conf_kernel", None) is not None:
        _scale(d.conf_kernel, 50.0)
    attach_target(d, target)
    stack = adapter.decoder_layers(d)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        _scale(getattr(stack, name), 10.0)
    # Softer base logits (the frozen head is the target's, scaled for peaked targets); negated when
    # bad: proposals anti-correlated with the target.
    _scale(d.final_norm, -0.3 if bad else 0.3)
    return d
