"""The DSpark drafter as an NNX module, its configuration checks, and its on-disk format.

Parameter names are fixed (the converter and trainer rely on them): `embed`, `lm_head`
(Frozen, the target's), `fc` [m*H, H], `hidden_norm`, `layers` (DecoderStack),
`final_norm`, `markov_w1` [V,r], `markov_w2` [r,V], gated `gate_kernel` [H+r,r] /
`gate_bias`, rnn `joint_kernel` [2r+H,3r] / `joint_bias`, confidence `conf_kernel`
[H+r,1] (or [H,1] without a Markov head) / `conf_bias`. Kernels are in `x @ W` layout.

The module only holds weights; the math lives in backbone.py / heads.py /
confidence.py as pure functions over `Drafter.arrays(dtype)`, called by the kind's
adapter (kinds/block.py). On disk: dspark_jax.io.drafter_dir.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.config import DrafterSection
from dspark_jax.drafter.frozen import Frozen
from dspark_jax.target.config import ModelConfig
from dspark_jax.target.kv_cache import KVCache
from dspark_jax.target.transformer import DecoderStack

INIT_STD = 0.02
FORMAT = "dspark_jax.drafter/1"
WEIGHTS_FILE = "drafter.safetensors"
CONFIG_FILE = "drafter_config.json"
HEAD_TYPES = ("vanilla", "gated", "rnn")


class DrafterConfigError(ValueError):
    pass


# ---------------------------------------------------------------------------- config


def default_layer_ids(num_target_layers: int, m: int) -> tuple[int, ...]:
    """The paper's default feature layers: `round(1 + i*(L-4)/(m-1))`, i = 0..m-1 (Python round).

    L=36, m=5 -> (1, 9, 17, 25, 33). m=1 -> (1,). Not validated here (resolve_layer_ids does).
    """
    if m < 1:
        raise DrafterConfigError(f"num_target_features must be >= 1, got {m}")
    if m == 1:
        return (1,)
    return tuple(int(round(1 + i * (num_target_layers - 4) / (m - 1))) for i in range(m))


def validate_layer_ids(ids, num_target_layers: int) -> tuple[int, ...]:
    ids = tuple(int(i) for i in ids)
    L = num_target_layers
    if not ids:
        raise DrafterConfigError("target_layer_ids is empty: the drafter needs at least one target layer")
    if any(i < 0 for i in ids):
        raise DrafterConfigError(f"target_layer_ids {list(ids)} has negative ids: "
                                 f"ids are decoder layer outputs 0..{L - 2}")
    if any(b <= a for a, b in zip(ids, ids[1:])):
        raise DrafterConfigError(f"target_layer_ids {list(ids)} must be strictly increasing")
    if ids[-1] > L - 2:
        raise DrafterConfigError(
            f"target_layer_ids {list(ids)} exceed {L - 2}: the target has {L} layers and its final layer "
            f"({L - 1}) is never a feature layer; pass ids in 0..{L - 2}"
        )
    return ids


def resolve_layer_ids(target_cfg: ModelConfig, dcfg: DrafterSection) -> tuple[int, ...]:
    """Explicit `dcfg.target_layer_ids`, or the default formula for `num_target_features` layers."""
    L = target_cfg.num_layers
    if dcfg.target_layer_ids is not None:
        return validate_layer_ids(dcfg.target_layer_ids, L)
    ids = default_layer_ids(L, dcfg.num_target_features)
    try:
        return validate_layer_ids(ids, L)
    except DrafterConfigError as e:
        raise DrafterConfigError(
            f"the default target_layer_ids formula gives {list(ids)} for a {L}-layer target with "
            f"{dcfg.num_target_features} features, which is invalid ({e}); set drafter.target_layer_ids "
            f"explicitly (strictly increasing ids in 0..{L - 2})"
        ) from None


def resolve_config(target_cfg: ModelConfig, dcfg: DrafterSection) -> DrafterSection:
    """Fill in and check everything the drafter needs; the result is what checkpoints record.

    Layer ids resolved (num_target_features = their count); head_type is "vanilla" without
    a Markov head; the mask id must be a row of the vocabulary. (What a kind changes, e.g.
    DFlash's missing heads, its adapter in drafter/kinds/ sets before calling this.)
    """
    if dcfg.head_type not in HEAD_TYPES:
        raise DrafterConfigError(f"unknown drafter.head_type '{dcfg.head_type}'; "
                                 f"choose one of: {', '.join(HEAD_TYPES)}")
    ids = resolve_layer_ids(target_cfg, dcfg)
    V = target_cfg.vocab_size
    if dcfg.mask_token_id is None:
        raise DrafterConfigError(
            "drafter.mask_token_id is not set: pass the tokenizer's <|mask|> id (Tokenizer.mask_id) "
            "or an otherwise unused embedding row (Qwen3: 151669)"
        )
    if not 0 <= dcfg.mask_token_id < V:
        raise DrafterConfigError(
            f"drafter.mask_token_id {dcfg.mask_token_id} is outside the target vocabulary (0..{V - 1}); "
            "use an unused row of the target's embedding"
        )
    if dcfg.sliding_window is not None and dcfg.sliding_window < 1:
        raise DrafterConfigError(f"drafter.sliding_window must be >= 1 or null, got {dcfg.sliding_window}")
    extra = {"head_type": "vanilla"} if dcfg.markov_rank == 0 else {}  # a head type means nothing without the head
    return dataclasses.replace(dcfg, target_layer_ids=ids, num_target_features=len(ids), **extra)


def layer_config(target_cfg: ModelConfig, num_layers: int) -> ModelConfig:
    """The drafter's layer config: the target's width, Qwen3 layer math (q/k norm), drafter depth."""
    return target_cfg.replace(arch="qwen3", num_layers=num_layers, tie_word_embeddings=False)


# ---------------------------------------------------------------------------- module


def _normal(rngs: nnx.Rngs, shape, dtype):
    return (INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class Drafter(nnx.Module):
    """DSpark / DFlash drafter: parallel backbone + optional sequential and confidence heads.

    Build one through `registry.build`, which applies the kind's rules to the config."""

    def __init__(self, target_cfg: ModelConfig, dcfg: DrafterSection, *, rngs: nnx.Rngs,
                 param_dtype=jnp.float32, dtype=None):
        # registry.build passes the config its kind resolved (DFlash without heads); resolving
        # again is a no-op there and fills the derived fields for a config built by hand
        self.dcfg = resolve_config(target_cfg, dcfg)
        self.target_cfg = target_cfg
        self.cfg = layer_config(target_cfg, self.dcfg.num_layers)
        self.dtype = dtype  # compute dtype; None = the parameters' dtype
        self.target_fingerprint = None  # set by attach_target
        d = self.dcfg
        H, V, r, m = target_cfg.hidden_size, target_cfg.vocab_size, d.markov_rank, d.num_target_features
        pd = param_dtype
        self.embed = Frozen(_normal(rngs, (V, H), pd), out_sharding=("vocab", "embed"))
        self.lm_head = Frozen(_normal(rngs, (H, V), pd), out_sharding=("embed", "vocab"))
        self.fc = nnx.Param(_normal(rngs, (m * H, H), pd), out_sharding=("fused", "embed"))
        self.hidden_norm = nnx.Param(jnp.ones((H,), pd), out_sharding=("norm",))
        self.layers = DecoderStack(self.cfg, rngs=rngs, num_layers=d.num_layers, param_dtype=pd)
        self.final_norm = nnx.Param(jnp.ones((H,), pd), out_sharding=("norm",))
        rank_p = lambda shape, axes, init=_normal: nnx.Param(init(rngs, shape, pd), out_sharding=axes)
        zeros = lambda rngs, shape, dtype: jnp.zeros(shape, dtype)
        gated, rnn = bool(r) and d.head_type == "gated", bool(r) and d.head_type == "rnn"
        # Absent heads are None (assigned once: NNX fixes an attribute's data/static status).
        self.markov_w1 = rank_p((V, r), ("vocab", "rank")) if r else None
        self.markov_w2 = rank_p((r, V), ("rank", "vocab")) if r else None
        self.gate_kernel = rank_p((H + r, r), ("head_in", "rank")) if gated else None
        self.gate_bias = rank_p((r,), ("rank",), zeros) if gated else None
        self.joint_kernel = rank_p((2 * r + H, 3 * r), ("head_in", "rank")) if rnn else None
        self.joint_bias = rank_p((3 * r,), ("rank",), zeros) if rnn else None
        self.conf_kernel = rank_p((H + r, 1), ("head_in", None)) if d.confidence_head else None
        self.conf_bias = rank_p((1,), (None,), zeros) if d.confidence_head else None

    # -- static facts
    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self.dcfg.target_layer_ids

    @property
    def gamma(self) -> int:
        return self.dcfg.gamma

    @property
    def mask_token_id(self) -> int:
        return self.dcfg.mask_token_id

    @property
    def head_type(self) -> str | None:
        """'vanilla' | 'gated' | 'rnn', or None without a Markov head (DFlash)."""
        return self.dcfg.head_type if self.dcfg.markov_rank else None

    def _dtype(self):
        return self.dtype or self.fc[...].dtype

    def arrays(self, dtype=None) -> dict:
        """All weights as a dict of arrays for the pure functions (cast to `dtype`, default the
        compute dtype). Frozen weights are wrapped in stop_gradient."""
        dtype = dtype or self._dtype()
        out = {"embed": jax.lax.stop_gradient(self.embed[...]), "lm_head": jax.lax.stop_gradient(self.lm_head[...]),
               "layers": self.layers.arrays()}
        for name in ("fc", "hidden_norm", "final_norm", "markov_w1", "markov_w2", "gate_kernel", "gate_bias",
                     "joint_kernel", "joint_bias", "conf_kernel", "conf_bias"):
            v = getattr(self, name)
            if v is not None:
                out[name] = v[...]
        return jax.tree.map(lambda a: a.astype(dtype), out)

    # -- inference state
    def init_cache(self, num_slots: int, max_len: int, dtype=None) -> KVCache:
        """Empty drafter context cache (context K/V only), one layer per drafter layer."""
        return KVCache.create(self.cfg, num_slots, max_len, dtype or self._dtype(), num_layers=self.dcfg.num_layers)
