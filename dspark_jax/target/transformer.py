"""Qwen3 / Llama-3 dense decoder in Flax NNX: the parameters, with layers stacked for `lax.scan`.

The module only holds parameters; calling it runs the one forward (target/forward.py) with the
attention its arguments describe: cache-free causal (training, full forwards), at explicit
positions, or writing into a dense or paged KV cache (prefill, regeneration).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.target.attention import cache_update, causal_self, masked_self
from dspark_jax.target.config import ModelConfig
from dspark_jax.target.forward import ForwardOut, forward
from dspark_jax.target.kv_cache import KVCache
from dspark_jax.target.layers import lm_head_logits
from dspark_jax.target.paged_kv import PagedKVCache

# the decoder layer's halves live in target/layers.py; the drafters import them from here too
__all__ = ["INIT_STD", "DecoderStack", "ForwardOut", "TargetModel", "layer_param_shapes"]

INIT_STD = 0.02


def layer_param_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Name -> (per-layer shape, logical axes) of one decoder layer. The single source of truth."""
    h, q, kv, i, d = (cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
                      cfg.intermediate_size, cfg.head_dim)
    shapes = {
        "input_norm": ((h,), ("norm",)),
        "q_proj": ((h, q), ("embed", "heads")),
        "k_proj": ((h, kv), ("embed", "kv_heads")),
        "v_proj": ((h, kv), ("embed", "kv_heads")),
        "o_proj": ((q, h), ("heads", "embed")),
        "post_norm": ((h,), ("norm",)),
        "gate_proj": ((h, i), ("embed", "mlp")),
        "up_proj": ((h, i), ("embed", "mlp")),
        "down_proj": ((i, h), ("mlp", "embed")),
    }
    if cfg.qk_norm:
        shapes["q_norm"] = ((d,), ("head_dim",))
        shapes["k_norm"] = ((d,), ("head_dim",))
    return shapes


def _init(rngs: nnx.Rngs, name: str, shape, dtype):
    if name.endswith("norm"):
        return jnp.ones(shape, dtype)
    return (INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class DecoderStack(nnx.Module):
    """All decoder layers' weights, each stacked on a leading `layers` axis."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, num_layers: int | None = None, param_dtype=jnp.float32):
        self.num_layers = num_layers or cfg.num_layers
        self.names = tuple(layer_param_shapes(cfg))
        for name, (shape, axes) in layer_param_shapes(cfg).items():
            value = _init(rngs, name, (self.num_layers, *shape), param_dtype)
            setattr(self, name, nnx.Param(value, out_sharding=("layers", *axes)))

    def release(self) -> None:
        """Delete the stacked weights' device buffers (their per-layer copies live elsewhere,
        target/decode_weights.py): the stack cannot run afterwards."""
        for n in self.names:
            a = getattr(self, n)[...] if hasattr(self, n) else None
            if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer) and not a.is_deleted():
                a.delete()

    def hold_per_layer(self, layers: tuple[dict, ...], axes: dict) -> None:
        """Hold `layers` (one dict of weights per layer, as target/decode_weights.py splits and
        merges them) in place of the stacked weights, which are deleted: an engine splits the
        layers once and the model reads that split too, so the layers are held once. Each
        weight stays a Param carrying its logical `axes`, so the rules table lays it out where
        the stack's weights were laid out (parallel/sharding.py)."""
        self.release()
        with nnx.use_eager_sharding(False):  # the arrays keep the layout they have
            held = tuple({k: nnx.Param(a, out_sharding=axes[k]) for k, a in p.items()} for p in layers)
        for n in self.names:
            if hasattr(self, n):
                delattr(self, n)
        self.per_layer = nnx.data(held)

    @property
    def holds_per_layer(self) -> bool:
        """Whether the layers are held per layer (`hold_per_layer`) rather than stacked."""
        return getattr(self, "per_layer", None) is not None

    def arrays(self, dtype=None):
        """{name: [L, ...]} stacked, or where the layers are held per layer, one dict per layer
        (the forward, target/forward.py, runs either); cast to `dtype` where given."""
        if self.holds_per_layer:
            out = tuple({k: v[...] for k, v in p.items()} for p in self.per_layer)
        else:
            out = {n: getattr(self, n)[...] for n in self.names}
        return out if dtype is None else jax.tree.map(lambda a: a if a.dtype == dtype else a.astype(dtype), out)


class TargetModel(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32, dtype=None):
        self.cfg = cfg
        self.dtype = dtype  # compute dtype; None = the parameters' dtype
        # cache-free causal attention: "auto" = splash kernel on TPU where it fits, else dense
        self.attention = "auto"
        self.embed = nnx.Param(_init(rngs, "embed", (cfg.vocab_size, cfg.hidden_size), param_dtype),
                               out_sharding=("vocab", "embed"))
        self.layers = DecoderStack(cfg, rngs=rngs, param_dtype=param_dtype)
        self.final_norm = nnx.Param(jnp.ones((cfg.hidden_size,), param_dtype), out_sharding=("norm",))
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Param(_init(rngs, "lm_head", (cfg.hidden_size, cfg.vocab_size), param_dtype),
                                     out_sharding=("embed", "vocab"))
        else:
            self.lm_head = None

    def _dtype(self):
        return self.dtype or self.embed[...].dtype

    def lm_head_weight(self):
        """[H, V] kernel (the transposed embedding when tied)."""
        return self.embed[...].T if self.lm_head is None else self.lm_head[...]

    def logits(self, hidden):
        return lm_head_logits(hidden, self.lm_head_weight())

    def arrays(self, dtype=None) -> dict:
        """The weights as the one forward takes them: layers in the compute dtype (`dtype`, default
        the model's), lm_head [H, V] even when tied."""
        return {"embed": self.embed[...], "layers": self.layers.arrays(dtype or self._dtype()),
                "final_norm": self.final_norm[...], "lm_head": self.lm_head_weight()}

    def __call__(self, tokens, positions=None, valid=None, cache: KVCache | PagedKVCache | None = None,
                 feature_layers: tuple[int, ...] = (), return_logits: bool = True) -> ForwardOut:
        """Forward a chunk of new tokens [R, T] at `positions` (default 0..T-1).

        `valid` [R, T] marks real tokens; the valid tokens of a row must sit at consecutive
        positions starting at the row's cache length. Without a cache the chunk attends
        causally to itself (training / full forward); with one (dense or paged), to the cache.
        """
        r, t = tokens.shape
        if valid is None:
            valid = jnp.ones((r, t), bool)
        causal = positions is None and cache is None  # tokens at 0..T-1 attending to themselves
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (r, t))
        if causal:
            attn = causal_self(valid, self.attention, self.cfg.head_dim)
        elif cache is None:
            attn = masked_self(positions, valid)
        else:
            attn = cache_update(cache, positions, valid)
        return forward(self.arrays(), self.cfg, tokens, positions, attn, feature_layers=feature_layers,
                       return_logits=return_logits)
