"""Which platform a program is compiled for: the one place that decides kernels.

A program traced on a CPU host may be compiled for a TPU slice (ahead-of-time, on a mesh of the
slice's devices: parallel/topology.py), so asking the host (`jax.default_backend()`) picks the
wrong kernels. The devices of the mesh the program is traced under decide; without a mesh, the
default device.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh

__all__ = ["platform", "device_kind", "on_tpu"]


def _device(mesh=None):
    """(platform, device_kind) of `mesh`, else of the mesh set by `jax.set_mesh`, else of the
    default device."""
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
    if isinstance(mesh, Mesh) and mesh.devices.size:
        d = mesh.devices.flat[0]
        return d.platform, d.device_kind
    abstract = getattr(mesh, "abstract_device", None) if mesh is not None and not mesh.empty else None
    if abstract is not None:
        return abstract.platform, abstract.device_kind
    d = jax.devices()[0]
    return d.platform, d.device_kind


def platform(mesh=None) -> str:
    """"tpu", "cpu" or "gpu": what the program is compiled for."""
    return _device(mesh)[0]


def device_kind(mesh=None) -> str:
    """e.g. "TPU v6 lite", "cpu"."""
    return _device(mesh)[1]


def on_tpu(mesh=None) -> bool:
    return platform(mesh) == "tpu"
