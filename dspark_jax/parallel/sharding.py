"""Meshes and the one table mapping logical axis names to mesh axes.

Model code annotates parameters with logical names ("embed", "heads", ...). Only this
module knows which mesh axes they land on, so model code never asks which devices exist.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axis (or tuple of mesh axes, or None = replicated)
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("rank", None),
    ("fused", None),
    ("head_in", None),
    ("layers", None),
    ("norm", None),
    ("head_dim", None),
    ("seq", None),
    # activations: rows over the batch axes, features whole (fsdp shards weights, not activations)
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_vocab", "tensor"),
    # the drafter's fused feature projection's output in decoding (drafter/decode_weights.py)
    ("ctx_out", "tensor"),
)


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, devices=None) -> Mesh:
    """A (data, fsdp, tensor) mesh with Auto axes (jax.make_mesh defaults to Explicit)."""
    devices = list(devices if devices is not None else jax.devices())
    n = data * fsdp * tensor
    if n != len(devices):
        if data == -1:
            data = len(devices) // (fsdp * tensor)
            n = data * fsdp * tensor
        if n != len(devices):
            raise ValueError(
                f"mesh data={data} x fsdp={fsdp} x tensor={tensor} = {n} devices, but {len(devices)} are present; "
                "set mesh.data/fsdp/tensor so their product equals the device count (data=-1 fills the rest)"
            )
    return Mesh(device_grid((data, fsdp, tensor), devices), MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def parse_mesh(text: str | None) -> Mesh | None:
    """"D,F,T" (a command's --mesh) -> a (data, fsdp, tensor) mesh over this host's devices."""
    if not text:
        return None
    try:
        d, f, t = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--mesh {text!r}: give three integers DATA,FSDP,TENSOR, e.g. 1,1,8") from None
    return make_mesh(d, f, t)


from jax.experimental import mesh_utils


def device_grid(shape: tuple[int, int, int], devices) -> np.ndarray:
    """Devices arranged as (data, fsdp, tensor) by jax's mesh utilities: on TPU the axes follow
    the chips' physical interconnect (ICI); over several slices (multislice) `data` spans the
    slices, the only axis whose traffic (one gradient all-reduce per step) suits the slower DCN."""

    slices = sorted({getattr(d, "slice_index", 0) for d in devices})
    if len(slices) > 1:
        n = len(slices)
        if shape[0] % n:
            raise ValueError(f"mesh.data={shape[0]} must be a multiple of the {n} slices (data spans the slices)")
        return mesh_utils.create_hybrid_device_mesh((shape[0] // n, *shape[1:]), (n, 1, 1), devices)
    return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)


def logical_to_pspec(names: Sequence[str | None] | None, shape: Sequence[int] | None = None,
                     mesh: Mesh | None = None, rules=LOGICAL_AXIS_RULES, strict: bool = False) -> P:
    """PartitionSpec for logical `names`. A mesh axis that does not divide its dimension is
    dropped (replicated) unless `strict`, then it is an error naming the dimension."""
    if not names:
        return P()
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for dim, name in enumerate(names):
        axes = table.get(name) if name is not None else None
        if axes is None:
            spec.append(None)
            continue
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        axes = tuple(a for a in axes if a not in used and (mesh is None or mesh.shape.get(a, 1) > 1))
        if mesh is not None and shape is not None and axes:
            size = int(np.prod([mesh.shape[a] for a in axes]))
            if shape[dim] % size:
                if strict:
                    raise ValueError(f"dimension {dim} ('{name}', size {shape[dim]}) "
                                     f"is not divisible by mesh axes {axes} (size {size})")
                axes = ()
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*spec)


def state_shardings(state, mesh: Mesh, rules=LOGICAL_AXIS_RULES, strict: bool = False):
    """NamedSharding per leaf of an NNX state, from each variable's `out_sharding` names."""
    def one(v):
        names = v.get_metadata().get("out_sharding") if isinstance(v, nnx.Variable) else None
        shape = getattr(v, "shape", None)
        return NamedSharding(mesh, logical_to_pspec(names, shape, mesh, rules, strict))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def create_model(factory: Callable[[], nnx.Module], mesh: Mesh | None = None, rules=LOGICAL_AXIS_RULES):
    """Build an NNX model on a plain CPU (mesh=None) or directly sharded over `mesh`.

    Eager sharding is turned off during construction; with a mesh, initialisation is a
    jitted function whose outputs land on the shardings given by the rules table.
    """
    with nnx.use_eager_sharding(False):
        if mesh is None:
            return factory()
        abstract = nnx.eval_shape(factory)
        graphdef, abs_state = nnx.split(abstract)
        shardings = state_shardings(abs_state, mesh, rules)

        init = jax.jit(lambda: nnx.split(factory())[1], out_shardings=shardings)
        state = init()
        return nnx.merge(graphdef, state)


def shard_model(model: nnx.Module, mesh: Mesh, rules=LOGICAL_AXIS_RULES) -> nnx.Module:
    """Place an existing model's parameters on `mesh` following the rules table."""
    graphdef, state = nnx.split(model)
    shardings = state_shardings(state, mesh, rules)
    state = jax.device_put(state, shardings)
    return nnx.merge(graphdef, state)


def host_arrays(tree):
    """Every jax array of `tree` as one numpy array on this host, also arrays spanning several
    processes: those are all-gathered (one program for the tree), which makes this a collective
    that every process must call."""
    spread = lambda x: isinstance(x, jax.Array) and not x.is_fully_addressable
    if any(spread(x) for x in jax.tree.leaves(tree)):
        whole = jax.tree.map(lambda x: NamedSharding(x.sharding.mesh, P()) if spread(x) else None, tree)
        tree = jax.jit(lambda t: t, out_shardings=whole)(tree)  # replicated: every process holds all
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0) if spread(x) else jax.device_get(x)), tree)


def constrain(x, names: Sequence[str | None], rules=LOGICAL_AXIS_RULES):
    """Pin activation `x` to the layout the rules table gives its logical `names` on the mesh
    set by `jax.set_mesh` (the trainer sets it); without one, `x` is returned as is. So model
    code states what an axis is, never which devices hold it."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or len(names) != x.ndim:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_pspec(names, x.shape, mesh, rules))
