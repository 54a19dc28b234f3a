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

The compiler prices a short product with a fixed part of a few microseconds besides its bytes (on
v6e-8 at 8 rows, q/k/v as three products 12.1 us a layer, merged into one 4.7 us), and not every
merge is cheaper (v5p-8 at 8 rows: gate and up 10.8 us a layer as two products, 41.4 us merged).
So each group of products that read the same input (q/k/v, gate/up) is priced both ways, as the
parts and merged (target/merged.py), and the floor takes the cheaper: it does not depend on which
form the step runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dspark_jax.parallel.tpu_cost import kernel_rates, program_cost
from dspark_jax.target.config import ModelConfig
from dspark_jax.target.kernels import TPU_ROW_TILE as TILE
from dspark_jax.target.merged import MERGED_PRODUCTS, MergeChoice, merge_choice

__all__ = ["product_shapes", "read_once_seconds", "kv_bytes_per_chip", "weight_bytes_per_chip",
           "draft_read_once_seconds", "context_read_once_seconds"]


def product_shapes(cfg: ModelConfig, tensor: int, merged: MergeChoice | None = None) -> dict[str, tuple]:
    """One chip's weight products of a decode step with the weights split over `tensor` chips as
    the rules table splits them (heads, KV heads, MLP and vocabulary over `tensor`), merged as the
    decode weights merge them there (target/merged.py; `merged` overrides):
    name -> (one chip's weight shape, how many per step)."""
    if merged is None:
        merged = merge_choice(cfg, AbstractMesh((tensor,), ("tensor",)))
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * d // tensor, max(cfg.num_kv_heads // tensor, 1) * d
    n = cfg.num_layers
    out = {"qkv_proj": ((q + 2 * kv, h), n)} if merged.qkv else \
        {"q_proj": ((h, q), n), "k_proj": ((h, kv), n), "v_proj": ((h, kv), n)}
    out["o_proj"] = ((q, h), n)
    out.update({"gate_up_proj": ((2, h, i // tensor), n)} if merged.gate_up else
               {"gate_proj": ((h, i // tensor), n), "up_proj": ((h, i // tensor), n)})
    out["down_proj"] = ((i // tensor, h), n)
    out["lm_head"] = ((h, cfg.vocab_size // tensor), 1)
    return out


@functools.lru_cache(maxsize=None)
def _bare_seconds(device, rows: int, name: str, weight: tuple[int, ...], dtype) -> float:
    """One product of `rows` token rows with weight `name` of shape `weight` ([K, N]; the merged
    forms as target/merged.py holds and multiplies them: q/k/v [N, K], gate/up [2, K, N]),
    compiled alone for `device`. Kept per process: a step, its rounds and its skipped round price
    the same products at the same rows, and each is a TPU compile."""
    mesh = Mesh(np.array([device]), ("x",))
    rep = NamedSharding(mesh, P())
    product, width = MERGED_PRODUCTS.get(name, (lambda a, b: a @ b, -2))
    x = jax.ShapeDtypeStruct((rows, weight[width]), dtype, sharding=rep)
    w = jax.ShapeDtypeStruct(weight, dtype, sharding=rep)
    with jax.set_mesh(mesh):  # its own chip, whatever mesh the caller has set
        return program_cost(jax.jit(product).lower(x, w).compile(), device).seconds


def weight_bytes_per_chip(cfg: ModelConfig, tensor: int, itemsize: int = 2, lm_head: bool = True) -> int:
    """One chip's bytes of the weights a decode step's products read (`product_shapes`, the LM head
    with `lm_head`): what the HBM floor divides by the chip's datasheet bandwidth."""
    return sum(int(np.prod(shape)) * m * itemsize for name, (shape, m) in product_shapes(cfg, tensor).items()
               if lm_head or name != "lm_head")


def kv_bytes_per_chip(cfg: ModelConfig, *, slots: int, context: int, tensor: int, itemsize: int = 2) -> int:
    """One chip's K and V of `slots` rows over `context` positions, its KV heads split over
    `tensor` chips (a head on every chip where there are fewer heads than chips)."""
    return cfg.num_layers * 2 * max(cfg.num_kv_heads // tensor, 1) * cfg.head_dim * itemsize * context * slots


GROUPS = {"q/k/v": (("q_proj", "k_proj", "v_proj"), "qkv_proj"), "gate/up": (("gate_proj", "up_proj"), "gate_up_proj")}


def read_once_seconds(cfg: ModelConfig, device, *, rows: int, tensor: int, kv_bytes_per_chip: int,
                      dtype=jnp.bfloat16) -> dict:
    """The compiler's price of one chip's share of a decode step of `rows` token rows: its weight
    products compiled bare ({name: seconds, all layers}; a group the cheaper of its parts and its
    merged product) and its KV read -> {"weights": s, "kv": s, "total": s, "products": {...}, "bytes": the
    weights' and KV's bytes}."""
    price = lambda choice: {name: m * _bare_seconds(device, rows, name, shape, dtype)
                            for name, (shape, m) in product_shapes(cfg, tensor, choice).items()}
    parts, merged = price(MergeChoice(False, False)), price(MergeChoice(True, True))
    products = {k: v for k, v in parts.items() if not any(k in names for names, _ in GROUPS.values())}
    for label, (names, one) in GROUPS.items():
        products[label] = min(sum(parts[n] for n in names), merged[one])
    weights = sum(products.values())
    kv = kv_bytes_per_chip / kernel_rates(device)[1]
    nbytes = weight_bytes_per_chip(cfg, tensor, jnp.dtype(dtype).itemsize) + kv_bytes_per_chip
    return {"weights": weights, "kv": kv, "total": weights + kv, "products": products, "bytes": nbytes}


def draft_read_once_seconds(layer_cfg: ModelConfig, device, *, slots: int, gamma: int, markov_rank: int,
                            tensor: int, kv_bytes_per_chip: int, dtype=jnp.bfloat16) -> dict:
    """The compiler's price of one chip's share of a block draft (docs/performance.md): the drafter's
    layers and the LM head at the block's R x G rows (`read_once_seconds` over the drafter's layer
    config), the Markov head's W2 at R rows once per slot (each slot's product needs the previous
    slot's token, so the weight is read G times), and the drafter's context KV at the kernel byte
    rate. -> read_once_seconds' dict plus "bytes" (what the draft must read, W2 G times)."""
    rows = max(slots * gamma, TILE)
    out = read_once_seconds(layer_cfg, device, rows=rows, tensor=tensor, kv_bytes_per_chip=kv_bytes_per_chip,
                            dtype=dtype)
    itemsize = jnp.dtype(dtype).itemsize
    w2 = (markov_rank, layer_cfg.vocab_size // tensor)
    if markov_rank:
        out["products"]["markov_w2"] = gamma * _bare_seconds(device, max(slots, TILE), "markov_w2", w2, dtype)
        out["weights"] += out["products"]["markov_w2"]
        out["total"] = out["weights"] + out["kv"]
    out["bytes"] = (weight_bytes_per_chip(layer_cfg, tensor, itemsize) + gamma * int(np.prod(w2)) * itemsize
                    + kv_bytes_per_chip)
    return out


def context_read_once_seconds(layer_cfg: ModelConfig, features: int, device, *, rows: int, tensor: int,
                              dtype=jnp.bfloat16) -> dict:
    """The compiler's price of writing the drafter's context for `rows` verified tokens: the fused
    feature projection [m H, H] split over `tensor` on its output (drafter/decode_weights.py) and
    every drafter layer's k / v products. -> {"total": s, "products": {...}, "bytes": int}."""
    h, kv = layer_cfg.hidden_size, max(layer_cfg.num_kv_heads // tensor, 1) * layer_cfg.head_dim
    shapes = {"fc": ((features * h, h // tensor), 1), "k_proj": ((h, kv), layer_cfg.num_layers),
              "v_proj": ((h, kv), layer_cfg.num_layers)}
    rows = max(rows, TILE)
    products = {n: m * _bare_seconds(device, rows, n, shape, dtype) for n, (shape, m) in shapes.items()}
    nbytes = sum(int(np.prod(shape)) * m for shape, m in shapes.values()) * jnp.dtype(dtype).itemsize
    return {"total": sum(products.values()), "products": products, "bytes": nbytes}
