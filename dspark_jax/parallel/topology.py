"""Cloud TPU slices by name, as devices the TPU compiler can build for on any machine.

`libtpu` compiles for a named topology without a TPU present (jax's `get_topology_desc`): the
devices it returns hold no memory and run nothing, but `jit(f).lower(...).compile()` on a mesh of
them is the real XLA:TPU compiler (and Mosaic for Pallas kernels), so `memory_analysis()` and
`cost_analysis()` are the chip's. Slices are named as Cloud TPU names accelerator types: v5e / v6e
count chips (`v6e-8` = 8 chips), v4 / v5p / v7x count TensorCores, two per chip (`v5p-8` = 4 chips).
docs/tpu_memory.md lists what was compiled this way.
"""

from __future__ import annotations

import importlib.util
import os

import jax
from jax.experimental import topologies

from dspark_jax.cli import quiet_libtpu_start
from dspark_jax.parallel.sharding import make_mesh
from dspark_jax.parallel.slices import TpuSlice, parse_slice

__all__ = ["slice_devices", "slice_mesh", "require_libtpu", "hbm_refusal"]

def require_libtpu() -> None:
    """The TPU compiler ships in the `libtpu` wheel: say which extra installs it."""
    if importlib.util.find_spec("libtpu") is None:
        raise ValueError("compiling for a TPU slice needs libtpu, which is not installed: "
                         "pip install -e \".[aot]\" (the version jax[tpu] pins)")


def slice_devices(slc: TpuSlice | str):
    """The slice's devices for ahead-of-time compilation (no TPU needed). With JAX_PLATFORMS unset
    it is set to cpu first, so nothing tries to open a TPU."""
    slc = parse_slice(slc) if isinstance(slc, str) else slc
    require_libtpu()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # libtpu takes a machine-wide lock meant for processes that drive a TPU; compiling only, several
    # processes (a test's subprocesses, two plan commands) may load it at once
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

    # what is compiled for devices that run nothing cannot be read back from JAX's persistent cache
    # (no client to load it on: a warning and a compile again), so nothing this process compiles
    # from here on is written to it
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
    with quiet_libtpu_start():
        desc = topologies.get_topology_desc(slc.topology, "tpu", chips_per_host_bounds=slc.chips_per_host)
    return list(desc.devices)


def slice_mesh(slc: TpuSlice | str, data: int, fsdp: int, tensor: int):
    """A (data, fsdp, tensor) mesh over the slice's devices; its size must be the device count."""
    slc = parse_slice(slc) if isinstance(slc, str) else slc
    devices = slice_devices(slc)
    n = data * fsdp * tensor
    if data != -1 and n != len(devices):
        raise ValueError(f"mesh data {data} x fsdp {fsdp} x tensor {tensor} = {n} devices, but slice {slc.name} has "
                         f"{len(devices)} ({slc.chips} chips): set mesh.data/fsdp/tensor so their product is "
                         f"{len(devices)}, or data=-1 to fill the rest")
    return make_mesh(data, fsdp, tensor, devices=devices)


def hbm_refusal(err) -> str | None:
    """XLA:TPU refuses to compile a program that cannot fit the chip's HBM: the compiler's reason
    (with the bytes it needed and had), else None."""
    text = str(err)
    if "RESOURCE_EXHAUSTED" not in text or "HBM" not in text:
        return None
    line = next((ln for ln in text.splitlines() if "HBM" in ln), text)
    return line.split("RESOURCE_EXHAUSTED:", 1)[-1].strip()
