"""The target's weights laid out for decoding: one array per layer and weight.

A decode step reads every weight once and does little else, so its time is the weights' bytes over
the memory bandwidth. With the layers stacked ([L, ...], the parameters' layout) the layer loop
slices each layer's weights out of the stack, and XLA materialises the slice before the product
reads it: a second copy of every weight per step (a one-token Qwen3-8B step 12.8 ms where the
layers over per-layer arrays take 6.7 ms on an H200, docs/performance.md). Split once when an
engine is built, each layer's weights are arrays of their own and the forward
(target/forward.py) runs the layers unrolled over them, each product reading its weight in place.

The split is a copy of the decoder layers' weights. `decode_arrays(..., hold=True)` (what the
engine does) makes it the model's own: each stack is deleted once its layers are copied, the
model then holds the per-layer arrays in place of its stacks and reads them when called, and an
engine built later on the same model takes them as they are. So the layers are held once
however many engines and callers use the model: on an accelerator Qwen3-8B's 13.9 GB of bf16
layers, held twice when the stacks stayed beside the split. Holding one representation rather
than slicing the stack on demand is what saves the copy: on XLA a slice of a stacked array is a
copy, so a model that rebuilt stacked views, or an engine that sliced the model's stack each
step, would hold or move a second copy all the same.

The split also merges the products that read the same input (q/k/v, gate/up: target/merged.py),
where the rules table keeps every chip's share of a merged product its own.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dspark_jax.parallel.sharding import logical_to_pspec
from dspark_jax.target.config import ModelConfig
from dspark_jax.target.merged import MERGED_AXES, MergeChoice, merge_choice, merge_gate_up, merge_qkv
from dspark_jax.target.transformer import layer_param_shapes

__all__ = ["unstack_layers", "decode_arrays", "per_layer_sharding", "abstract_decode_arrays", "merge_projections",
           "merged_layers", "abstract_layer_arrays"]


def per_layer_sharding(sharding):
    """The sharding of one layer's slice of a stacked weight: the stacked one without its `layers`
    axis (None when the weight is not laid out on a mesh)."""
    if not isinstance(sharding, NamedSharding):
        return None
    return NamedSharding(sharding.mesh, P(*tuple(sharding.spec)[1:]))


def merge_projections(p: dict, cfg: ModelConfig, choice: MergeChoice) -> dict:
    """One layer's weights with q/k/v and gate/up merged as `choice` says (target/merged.py)."""
    out = dict(p)
    if choice.qkv:
        out["qkv_proj"] = merge_qkv(*(out.pop(k) for k in ("q_proj", "k_proj", "v_proj")), cfg)
    if choice.gate_up:
        out["gate_up_proj"] = merge_gate_up(out.pop("gate_proj"), out.pop("up_proj"))
    return out


def unstack_layers(layers: dict, release: bool = False) -> tuple[dict, ...]:
    """Stacked layer weights {name: [L, ...]} -> L dicts {name: [...]}, each weight laid out on the
    mesh as its stack was (less the layers axis). Eager: the arrays are copied once, here (traced,
    as an abstract engine is built, the slices stay in the trace). `release`: each stack is
    deleted once its layers are copied, so at most one weight's stack is held twice."""
    num = {a.shape[0] for a in layers.values()}
    if len(num) != 1:
        raise ValueError(f"stacked layer weights disagree on the number of layers: {sorted(num)}")
    (n,) = num
    shardings = {k: None if isinstance(a, jax.core.Tracer) else per_layer_sharding(a.sharding)
                 for k, a in layers.items()}

    split = {}
    for k, a in layers.items():
        split[k] = [a[i] if shardings[k] is None else jax.device_put(a[i], shardings[k]) for i in range(n)]
        if release and isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer):
            jax.block_until_ready(split[k])
            a.delete()
    return tuple({k: split[k][i] for k in layers} for i in range(n))


def merged_layers(layers, cfg: ModelConfig, release: bool = False) -> tuple[dict, ...]:
    """`merge_projections` of each per-layer dict, each merged weight split over the mesh as its
    parts are (traced, as an abstract engine is built: for the mesh it is traced under).
    `release` (`layers` a list the caller gives up): each layer's parts are deleted once it is
    merged, so the merge holds one layer's weights twice at most, not every layer's."""
    first = layers[0]["down_proj"]
    if isinstance(first, jax.core.Tracer):
        mesh = jax.sharding.get_abstract_mesh()
        choice = merge_choice(cfg, None if mesh.empty else mesh)
        return tuple(merge_projections(p, cfg, choice) for p in layers)
    sharding = first.sharding
    if not isinstance(sharding, NamedSharding):
        merge = functools.partial(merge_projections, cfg=cfg, choice=merge_choice(cfg))
    else:
        mesh = sharding.mesh
        choice = merge_choice(cfg, mesh)
        _, axes = _axes(cfg)
        shapes = jax.eval_shape(lambda p: merge_projections(p, cfg, choice), layers[0])
        out_sh = {k: NamedSharding(mesh, logical_to_pspec(axes[k], a.shape, mesh)) for k, a in shapes.items()}
        merge = _merge_program(cfg, choice, tuple(sorted(out_sh.items())))
    out = []
    for i in range(len(layers)):
        p = layers[i]
        out.append(merge(p))
        if release:
            kept = {id(a) for a in out[-1].values()}
            jax.block_until_ready(out[-1])
            for a in p.values():
                if id(a) not in kept and not a.is_deleted():
                    a.delete()
            layers[i] = None
    return tuple(out)


@functools.lru_cache(maxsize=8)
def _merge_program(cfg: ModelConfig, choice: MergeChoice, out_sh: tuple):
    """The jitted merge of one layer, one per model shape and layout (engines of the same shapes
    share it, as they share their programs)."""
    return jax.jit(lambda p: merge_projections(p, cfg, choice), out_shardings=dict(out_sh))


def decode_arrays(model, dtype=None, per_layer: bool = True, hold: bool = False) -> dict:
    """`model.arrays(dtype)` (embed, final_norm, lm_head [H, V]) with the layers split per layer
    and their products merged (`per_layer`; else as the model holds them:
    `target.kernels.per_layer_decode` decides). `hold` (with `per_layer`): the split becomes the
    model's (module docstring): each stack is deleted as its layers are copied, and the model
    holds and reads the per-layer arrays from then on. A model that already holds its layers per
    layer gives them as they are, whatever `per_layer` says (no copy)."""
    arrays = model.arrays(dtype)
    if not per_layer or isinstance(arrays["layers"], tuple):
        return arrays
    traced = isinstance(jax.tree.leaves(arrays["layers"])[0], jax.core.Tracer)
    hold = hold and not traced  # an abstract engine (plan.py) allocates nothing: the model stays as it is
    layers = list(unstack_layers(arrays.pop("layers"), release=hold))
    if not hold:
        return {**arrays, "layers": merged_layers(layers, model.cfg)}
    model.layers.release()  # where `arrays(dtype)` cast copies, the parameters themselves
    merged = merged_layers(layers, model.cfg, release=True)
    model.layers.hold_per_layer(merged, _axes(model.cfg)[1])
    return {**arrays, "layers": merged}


def _axes(cfg: ModelConfig) -> tuple[dict, dict]:
    """Logical axis names of `decode_arrays`' leaves: (the non-layer weights, one layer's)."""
    top = {"embed": ("vocab", "embed"), "final_norm": ("norm",), "lm_head": ("embed", "vocab")}
    return top, {**{name: axes for name, (_, axes) in layer_param_shapes(cfg).items()}, **MERGED_AXES}


def abstract_decode_arrays(cfg: ModelConfig, arrays: dict, mesh, per_layer: bool = True) -> dict:
    """The shapes of `model.arrays()` (`jax.eval_shape`) as `decode_arrays` lays them out on `mesh`:
    ShapeDtypeStructs with the rules table's shardings, what an ahead-of-time compile of the
    engine's programs takes as the target's weights."""
    top, layer = _axes(cfg)

    def sds(a, names):
        return jax.ShapeDtypeStruct(a.shape, a.dtype,
                                    sharding=NamedSharding(mesh, logical_to_pspec(names, a.shape, mesh)))

    out = {k: sds(arrays[k], names) for k, names in top.items()}
    if not per_layer:
        return {**out, "layers": {k: sds(a, ("layers", *layer[k])) for k, a in arrays["layers"].items()}}
    one = {k: jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for k, a in arrays["layers"].items()}
    out["layers"] = (abstract_layer_arrays(cfg, one, mesh),) * cfg.num_layers
    return out


def abstract_layer_arrays(cfg: ModelConfig, one: dict, mesh) -> dict:
    """One layer's weights (shapes `one`, {name: [...]}) merged as `merged_layers` merges them on
    `mesh`, as ShapeDtypeStructs with the rules table's shardings."""
    _, layer = _axes(cfg)
    merged = jax.eval_shape(lambda p: merge_projections(p, cfg, merge_choice(cfg, mesh)), one)
    return {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, logical_to_pspec(layer[k], a.shape,
                                                                                                      mesh)))
            for k, a in merged.items()}
