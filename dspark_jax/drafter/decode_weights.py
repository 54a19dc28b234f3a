"""A block drafter's weights laid out for decoding, as target/decode_weights.py lays out the target's.

A draft reads the drafter's weights once and does little arithmetic besides, so it is bound by
their bytes, as a target step is. Two layouts of the parameters cost it more than that:

- the layers stacked ([L, ...]): the backbone's `lax.scan` slices each layer's weights out of the
  stack and XLA:TPU copies the slice before the products read it. Split once per engine, the
  layers are a tuple of per-layer dicts and the backbone runs them unrolled
  (`drafter.backbone`), each product reading its weight in place; where the engine keeps the scan
  (XLA:CPU, `target.kernels.per_layer_decode`) they stay stacked. Split, each layer's q / k / v
  and gate / up are merged as the target's are (target/merged.py: XLA:TPU copied the input-major
  q weight into [N, H] every draft otherwise), and k / v are also kept apart for the context's
  products (`update_context` projects the fused features with them alone: 2 x H x D a KV head);
- the fused feature projection `fc` [m H, H] replicated (its output axis is `embed`, split over
  `fsdp` for training and whole on a tensor-parallel mesh): every chip read all of it for the
  context of every verified token. For decoding its output is split over `tensor` like the
  heads (`ctx_out` in the rules table); the RMS norm after it and the context's k / v products
  gather the small [rows, H] result;
- the Markov head's W1 [V, rank] split over the vocabulary: each step of the sequential head
  gathers one row per slot (the previous token's), and from a vocabulary-split table that gather
  is a masked lookup on every chip plus an all-reduce, inside the scan, once per slot. Whole on
  every chip (V x rank is small: 78 MB in bf16 for Qwen3-8B's drafter, a fifth of one of its layers) each
  step's gather is one slice.

Nothing else changes: the embedding, the LM head and W2 keep their (vocabulary-split)
layout. `abstract_drafter_arrays` gives the same layout as ShapeDtypeStructs for compiling ahead
of time (engine/plan.py).
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding

from dspark_jax.parallel.sharding import logical_to_pspec
from dspark_jax.target.config import ModelConfig
from dspark_jax.target.decode_weights import abstract_layer_arrays, merged_layers, per_layer_sharding, unstack_layers

__all__ = ["FC_DECODE_AXES", "drafter_decode_arrays", "abstract_drafter_arrays"]

FC_DECODE_AXES = ("fused", "ctx_out")
W1_DECODE_AXES = (None, "rank")


def _fc_sharding(fc, mesh):
    return NamedSharding(mesh, logical_to_pspec(FC_DECODE_AXES, fc.shape, mesh))


def _w1_sharding(w1, mesh):
    return NamedSharding(mesh, logical_to_pspec(W1_DECODE_AXES, w1.shape, mesh))


def _with_context_kv(merged: tuple[dict, ...], layers: tuple[dict, ...]) -> tuple[dict, ...]:
    return tuple({**m, "k_proj": p["k_proj"], "v_proj": p["v_proj"]} for m, p in zip(merged, layers))


def drafter_decode_arrays(arrays: dict, cfg: ModelConfig, per_layer: bool, mesh=None) -> dict:
    """`Drafter.arrays()` of a drafter with layer config `cfg` -> the decode layout (module
    docstring): layers per layer and merged where `per_layer`, `fc` split over `mesh`'s tensor
    axis. Eager: the split copies the layers once."""
    out = dict(arrays)
    if per_layer and isinstance(out.get("layers"), dict):
        layers = unstack_layers(out["layers"])
        out["layers"] = _with_context_kv(merged_layers(layers, cfg), layers)
    if mesh is not None and "fc" in out:
        out["fc"] = jax.device_put(out["fc"], _fc_sharding(out["fc"], mesh))
    if mesh is not None and "markov_w1" in out:
        out["markov_w1"] = jax.device_put(out["markov_w1"], _w1_sharding(out["markov_w1"], mesh))
    return out


def abstract_drafter_arrays(arrays: dict, shardings: dict, mesh, per_layer: bool, cfg: ModelConfig) -> dict:
    """The shapes of `Drafter.arrays()` (`jax.eval_shape`) with their parameters' `shardings` (the
    same tree), as `drafter_decode_arrays` lays them out on `mesh`: what an ahead-of-time compile
    of the engine's programs takes as the drafter's weights."""
    sds = lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)
    out = {k: sds(a, shardings[k]) for k, a in arrays.items() if k != "layers"}
    if "fc" in out:
        out["fc"] = sds(arrays["fc"], _fc_sharding(arrays["fc"], mesh))
    if "markov_w1" in out:
        out["markov_w1"] = sds(arrays["markov_w1"], _w1_sharding(arrays["markov_w1"], mesh))
    layers, lsh = arrays.get("layers"), shardings.get("layers")
    if layers is not None:
        if per_layer:
            n = {a.shape[0] for a in layers.values()}.pop()
            one = {k: jax.ShapeDtypeStruct(a.shape[1:], a.dtype, sharding=per_layer_sharding(lsh[k]))
                   for k, a in layers.items()}
            merged = abstract_layer_arrays(cfg, one, mesh)
            out["layers"] = _with_context_kv((merged,) * n, (one,) * n)
        else:
            out["layers"] = {k: sds(a, lsh[k]) for k, a in layers.items()}
    return out
