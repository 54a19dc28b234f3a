"""Which attention kernel a target program runs, decided in one place.

A program traced on a CPU host may be compiled for a TPU slice ahead of time, so the kernels are
chosen from the platform of the mesh the program is traced under (`parallel.platform`), never
from the host's backend. Forced choices ("splash", "pallas") run the Pallas kernels in interpret
mode off TPU, which is how the tests compare them with the plain jnp paths.
"""

from __future__ import annotations

from dspark_jax.parallel.platform import platform

__all__ = ["CAUSAL_KERNELS", "PAGED_KERNELS", "SPLASH_BLOCK", "TPU_ROW_TILE", "choose_causal_kernel",
           "choose_paged_kernel", "pallas_interpret", "splash_fits", "row_tile", "per_layer_decode"]

CAUSAL_KERNELS = ("auto", "dense", "splash")  # cache-free causal attention (`TargetModel.attention`)
PAGED_KERNELS = ("auto", "reference", "pallas")  # how a KV cache, dense or paged, is read (`impl`)
SPLASH_BLOCK = 128  # the splash kernel's query and key block
# rows of a TPU product's sublane tile: XLA:TPU turns a product of fewer rows into vector-unit
# multiply-reduces (a one-row Qwen3-8B step priced 1.9x an eight-row one on v6e-8), so decode
# programs pad their token rows up to it (docs/performance.md, "One token per program")
TPU_ROW_TILE = 8


def splash_fits(seq_len: int, head_dim: int) -> bool:
    """The splash kernel's blocks tile the sequence and TPU lanes hold whole heads."""
    return seq_len % SPLASH_BLOCK == 0 and head_dim % SPLASH_BLOCK == 0


def choose_causal_kernel(requested: str, seq_len: int, head_dim: int) -> str:
    """"splash" (jax's TPU kernel) or "blocked" (`layers.causal_attention`). "auto" takes the
    kernel where the program is compiled for TPU and the shapes fit; "splash" forces it and says
    why when the sequence does not tile."""
    if requested not in CAUSAL_KERNELS:
        raise ValueError(f"attention implementation {requested!r} is not one of {CAUSAL_KERNELS}")
    if requested == "dense":
        return "blocked"
    if requested == "auto":
        return "splash" if platform() == "tpu" and splash_fits(seq_len, head_dim) else "blocked"
    if seq_len % SPLASH_BLOCK:
        raise ValueError(f"splash attention needs a sequence length that is a multiple of {SPLASH_BLOCK}, got "
                         f"{seq_len}; pad the batch or use attention 'dense'")
    return "splash"


def choose_paged_kernel(requested: str, mesh=None) -> str:
    """"pallas" (a row's keys read in place: target/paged_kernel.py on TPU, target/gpu_kernel.py on
    GPU) or "reference" (gathered into each row's view), for a dense or a paged cache
    (target/attention_backend.py). "auto": the kernel when the program is compiled for TPU or GPU
    (`mesh`, else the mesh set by `jax.set_mesh`, else the default device)."""
    if requested not in PAGED_KERNELS:
        raise ValueError(f"cache attention {requested!r} is not one of {PAGED_KERNELS}")
    if requested == "auto":
        return "pallas" if platform(mesh) in ("tpu", "gpu") else "reference"
    return requested


def pallas_interpret() -> bool:
    """Pallas kernels compile through Mosaic only for TPU; elsewhere they run interpreted."""
    return platform() != "tpu"


def row_tile(mesh=None) -> int:
    """The fewest token rows a decode program's products should have where it is compiled: a TPU's
    sublane tile (fewer rows cost more, not less), else 1."""
    return TPU_ROW_TILE if platform(mesh) == "tpu" else 1


def per_layer_decode(mesh=None) -> bool:
    """Whether decode programs run the layers unrolled over per-layer weights (target/decode_weights.py)
    where they are compiled: on accelerators, where a scan step copies its layer's weights out of
    the stack (a one-token Qwen3-8B forward 12.8 ms scanned, 6.7 ms per layer on an H200); not on
    XLA:CPU, which hoists the unrolled layers' cache reads ahead of the round's in-place cache write
    and copies the whole cache for it (tests/engine/test_in_place.py), and where the scan costs
    nothing measurable."""
    return platform(mesh) != "cpu"
