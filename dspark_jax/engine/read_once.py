"""The TPU compiler's own price for what a decode step must at least do: read every target weight
once and the KV cache it attends to once.

A decode step is bound by memory: its time cannot fall below its weights' and KV's bytes over the
chip's bandwidth. Which bandwidth the cost model grants a product is the compiler's business (on
v6e an [8, 12288] x [12288, 4096] bf16 product is priced at about 1.0 TB/s, 61 % of the rate it
copies at), so the floor is priced by the same compiler: each of a layer's weight products
compiled bare for one chip, at the step's rows and the chip's shard of the weight, times the
layers, plus the LM head, plus the chip's KV bytes at the rate the compiler prices a kernel's
declared bytes (`tpu_cost.kernel_rates`). A compiled step over that floor is time the program
spends on something else: copies of weights, attention reading more cache than it holds, small
operations (docs/performance.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dspark_jax.parallel.tpu_cost import kernel_rates, program_cost
from dspark_jax.target.config import ModelConfig

__all__ = ["product_shapes", "read_once_seconds"]


def product_shapes(cfg: ModelConfig, tensor: int) -> dict[str, tuple[int, int, int]]:
    """One chip's weight products of a decode step with the weights split over `tensor` chips as
    the rules table splits them (heads, KV heads, MLP and vocabulary over `tensor`):
    name -> (in, out, how many per step)."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * d // tensor, max(cfg.num_kv_heads // tensor, 1) * d
    n = cfg.num_layers
    return {"q_proj": (h, q, n), "k_proj": (h, kv, n), "v_proj": (h, kv, n), "o_proj": (q, h, n),
            "gate_proj": (h, i // tensor, n), "up_proj": (h, i // tensor, n), "down_proj": (i // tensor, h, n),
            "lm_head": (h, cfg.vocab_size // tensor, 1)}


def _bare_seconds(device, rows: int, k: int, n: int, dtype) -> float:
    mesh = Mesh(np.array([device]), ("x",))
    rep = NamedSharding(mesh, P())
    x = jax.ShapeDtypeStruct((rows, k), dtype, sharding=rep)
    w = jax.ShapeDtypeStruct((k, n), dtype, sharding=rep)
    with jax.set_mesh(mesh):  # its own chip, whatever mesh the caller has set
        return program_cost(jax.jit(lambda a, b: a @ b).lower(x, w).compile(), device).seconds


def read_once_seconds(cfg: ModelConfig, device, *, rows: int, tensor: int, kv_bytes_per_chip: int,
                      dtype=jnp.bfloat16) -> dict:
    """The compiler's price of one chip's share of a decode step of `rows` token rows: its weight
    products compiled bare ({name: seconds, all layers}) and its KV read -> {"weights": s, "kv": s,
    "total": s, "products": {...}}."""
    products = {name: m * _bare_seconds(device, rows, k, n, dtype)
                for name, (k, n, m) in product_shapes(cfg, tensor).items()}
    weights = sum(products.values())
    kv = kv_bytes_per_chip / kernel_rates(device)[1]
    return {"weights": weights, "kv": kv, "total": weights + kv, "products": products}
