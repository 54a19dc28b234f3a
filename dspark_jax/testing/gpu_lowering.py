"""A function lowered for CUDA on a host without a GPU, and the custom calls in its StableHLO: what
the GPU kernel tests read to check a kernel's call (its payload, grid and operands) without a GPU."""

from __future__ import annotations

from collections.abc import Iterator

import jax
from jax._src.lib.mlir import ir

from dspark_jax.target.gpu_kernel import abstract_gpu


def lower_for_gpu(kind: str, f, *args):
    """`f` lowered for CUDA for an abstract GPU of `kind` (e.g. "NVIDIA H100 80GB HBM3"): jax 0.12's
    GPU lowerings ask the device for its compute capability, jax 0.10.2's lower without one."""
    with abstract_gpu(kind):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))


def custom_call_configs(lowered, call_target: str) -> Iterator[ir.DictAttr]:
    """The backend configs of the `stablehlo.custom_call`s to `call_target` in `lowered`, nested
    regions included, in program order."""

    def walk(op):
        op = op.operation
        if op.name == "stablehlo.custom_call" and ir.StringAttr(op.attributes["call_target_name"]).value == call_target:
            yield ir.DictAttr(op.attributes["mhlo.backend_config"])
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    yield from walk(inner)

    yield from walk(lowered.compiler_ir("stablehlo"))
