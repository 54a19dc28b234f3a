"""Cloud TPU slices by name (what `mesh.slice` and `--topology` accept), without JAX.

Slices are named as Cloud TPU names accelerator types: v5e / v6e count chips (`v6e-8` = 8
chips), v4 / v5p / v7x count TensorCores, two per chip (`v5p-8` = 4 chips). parallel/topology.py
turns one into the devices the TPU compiler builds for.
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["TpuSlice", "parse_slice", "slice_names", "HBM_GIB", "PEAK_BF16_TFLOPS", "HBM_GBPS", "ICI_GBPS",
           "ICI_PORTS", "DATASHEET", "tpu_generation"]

# HBM per chip (GiB), from Cloud TPU's system architecture pages
HBM_GIB = {"v4": 32.0, "v5e": 16.0, "v6e": 32.0, "v5p": 95.0, "v7x": 192.0}
# peak dense bf16 TFLOP/s per chip, from Cloud TPU's system architecture pages
PEAK_BF16_TFLOPS = {"v4": 275.0, "v5e": 197.0, "v6e": 918.0, "v5p": 459.0, "v7x": 2307.0}
# HBM bandwidth per chip (GB/s, 10^9 bytes), from the same pages (v4: "1200 GBps"; v5e: 819; v6e: 1638;
# v5p: 2765; TPU7x: 7380)
HBM_GBPS = {"v4": 1200.0, "v5e": 819.0, "v6e": 1638.0, "v5p": 2765.0, "v7x": 7380.0}
# bidirectional inter-chip interconnect (ICI) bandwidth per chip (GB/s), summed over its ports, from the
# same pages (v5e: 400; v6e: 800; v5p and TPU7x: 1200); v4 has no such figure there
ICI_GBPS = {"v5e": 400.0, "v6e": 800.0, "v5p": 1200.0, "v7x": 1200.0}
ICI_PORTS = {"v4": 6, "v5e": 4, "v6e": 4, "v5p": 6, "v7x": 6}
DATASHEET = ("Cloud TPU system architecture pages (docs.cloud.google.com/tpu/docs/v5e, v6e, v5p, tpu7x), "
             "read 2026-12-05")
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

    @property
    def hbm_bytes_per_s(self) -> float:
        """Datasheet HBM bandwidth of one chip (`HBM_GBPS`)."""
        return HBM_GBPS[self.generation] * 1e9

    @property
    def peak_tflops(self) -> float:
        """Peak dense bf16 TFLOP/s of one chip."""
        return PEAK_BF16_TFLOPS[self.generation]


# the device kind a libtpu device reports -> its generation
_DEVICE_KINDS = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v6 lite": "v6e", "TPU v6e": "v6e",
                 "TPU v5": "v5p", "TPU v5p": "v5p", "TPU7x": "v7x", "TPU v7x": "v7x"}


def tpu_generation(device_kind: str) -> str:
    """"v6e" for "TPU v6 lite" (a device's `device_kind`), and so on; ValueError for others."""
    if device_kind not in _DEVICE_KINDS:
        raise ValueError(f"device kind {device_kind!r} is not a Cloud TPU generation this table knows "
                         f"({', '.join(sorted(set(_DEVICE_KINDS.values())))})")
    return _DEVICE_KINDS[device_kind]


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
