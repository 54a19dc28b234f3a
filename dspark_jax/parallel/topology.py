"""Cloud TPU slices by name, as devices the TPU compiler can build for on any machine.

`libtpu` compiles for a named topology without a TPU present (jax's `get_topology_desc`): the
devices it returns hold no memory and run nothing, but `jit(f).lower(...).compile()` on a mesh of
them is the real XLA:TPU compiler (and Mosaic for Pallas kernels), so `memory_analysis()` and
`cost_analysis()` are the chip's. Slices are named as Cloud TPU names accelerator types: v5e / v6e
count chips (`v6e-8` = 8 chips), v4 / v5p / v7x count TensorCores, two per chip (`v5p-8` = 4 chips).
docs/tpu_memory.md lists what was compiled this way.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re

from jax.experimental import topologies

from dspark_jax.parallel.sharding import make_mesh

__all__ = ["TpuSlice", "parse_slice", "slice_names", "slice_devices", "slice_mesh", "require_libtpu", "hbm_refusal", "HBM_GIB"]

# HBM per chip (GiB), from Cloud TPU's system architecture pages
HBM_GIB = {"v4": 32.0, "v5e": 16.0, "v6e": 32.0, "v5p": 95.0, "v7x": 192.0}
# topology-name prefix libtpu knows each generation by
_TOPOLOGY_PREFIX = {"v4": "v4", "v5e": "v5e", "v6e": "v6e", "v5p": "v5p", "v7x": "tpu7x"}
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "tpu7x": "v7x", "v6": "v6e"}
# chips -> torus shape: 2-D for the lite chips, 3-D for the others
_SHAPES_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)}
_SHAPES_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4), 128: (4, 4, 8),
              256: (4, 8, 8), 512: (8, 8, 8)}
_CORES_PER_CHIP = {"v4": 2, "v5p": 2, "v7x": 2, "v5e": 1, "v6e": 1}


@dataclasses.dataclass(frozen=True)
class TpuSlice:
    name: str  # canonical accelerator type, e.g. "v6e-8"
    generation: str  # "v4" | "v5e" | "v6e" | "v5p" | "v7x"
    chips: int
    shape: tuple[int, ...]  # the chips' torus
    chips_per_host: tuple[int, int, int]

    @property
    def topology(self) -> str:
        """libtpu's topology string, e.g. "v6e:2x4"."""
        return f"{_TOPOLOGY_PREFIX[self.generation]}:{'x'.join(map(str, self.shape))}"

    @property
    def hosts(self) -> int:
        per = self.chips_per_host[0] * self.chips_per_host[1] * self.chips_per_host[2]
        return max(self.chips // per, 1)

    @property
    def hbm_gib(self) -> float:
        """HBM of one chip."""
        return HBM_GIB[self.generation]


def slice_names() -> list[str]:
    """Every accelerator type `parse_slice` accepts, in Cloud TPU's spelling."""
    out = []
    for gen in ("v5e", "v6e"):
        out += [f"{gen}-{n}" for n in _SHAPES_2D]
    for gen in ("v4", "v5p", "v7x"):
        out += [f"{gen}-{n * _CORES_PER_CHIP[gen]}" for n in _SHAPES_3D]
    return out


def _summary() -> str:
    two = "/".join(str(n) for n in _SHAPES_2D)
    three = "/".join(str(2 * n) for n in _SHAPES_3D)
    return f"v5e-N or v6e-N with N chips in {two}; v4-N, v5p-N or v7x-N with N TensorCores in {three}"


def parse_slice(name: str) -> TpuSlice:
    """"v6e-8", "v5litepod-16", "v5p-8", "v7x-8" (or libtpu's "v6e:2x4") -> TpuSlice; anything
    else is a ValueError listing what is accepted."""
    text = str(name).strip().lower()
    m = re.fullmatch(r"([a-z0-9]+?)(?:pod)?-(\d+)", text)
    if m:
        gen, n = _ALIASES.get(m.group(1), m.group(1)), int(m.group(2))
        if gen in ("v5e", "v6e") and n in _SHAPES_2D:
            return _slice(gen, n, _SHAPES_2D[n])
        if gen in _CORES_PER_CHIP and gen not in ("v5e", "v6e") and n % 2 == 0 and n // 2 in _SHAPES_3D:
            return _slice(gen, n // 2, _SHAPES_3D[n // 2])
    m = re.fullmatch(r"([a-z0-9]+):(\d+(?:x\d+)+)", text)
    if m:
        gen = _ALIASES.get(m.group(1), m.group(1))
        shape = tuple(int(x) for x in m.group(2).split("x"))
        table = _SHAPES_2D if gen in ("v5e", "v6e") else _SHAPES_3D
        chips = 1
        for s in shape:
            chips *= s
        if gen in _CORES_PER_CHIP and table.get(chips) == shape:
            return _slice(gen, chips, shape)
    raise ValueError(f"unknown TPU slice {name!r}: name it as Cloud TPU does: {_summary()} "
                     "(e.g. v5e-8, v6e-8, v6e-32, v5p-8, v5p-64, v4-8, v7x-8)")


def _slice(gen: str, chips: int, shape: tuple[int, ...]) -> TpuSlice:
    if gen in ("v5e", "v6e"):  # one host holds 1, 4 or 8 chips; larger slices 4 per host
        per = {1: (1, 1, 1), 4: (2, 2, 1), 8: (2, 4, 1)}.get(chips, (2, 2, 1))
    else:
        per = (2, 2, 1)
    name = f"{gen}-{chips * _CORES_PER_CHIP[gen]}"
    return TpuSlice(name, gen, chips, shape, per)


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

    return list(topologies.get_topology_desc(slc.topology, "tpu", chips_per_host_bounds=slc.chips_per_host).devices)


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
