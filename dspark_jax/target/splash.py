"""The target's cache-free causal attention through jax's maintained TPU kernel (splash attention).

Training runs the frozen target over whole sequences; its dense path materialises float32
scores [B, heads, T, T]. On TPU this module runs the same math in Pallas' splash attention
(block-sparse causal mask, scores never leave VMEM). Padding keys are handled with segment ids
(real tokens 1, padding 0), so every real query sees exactly the keys the dense path lets it
see; padding rows differ and are never read. Off TPU the kernel runs in Pallas interpret mode,
which is how the tests compare it with the dense path. Whether it runs is decided in
target/kernels.py, from the platform of the mesh the program is traced under.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_kernel as sk,
)
from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_mask as sm,
)
from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel import (
    SegmentIds,
)

from dspark_jax.parallel.sharding import logical_to_pspec
from dspark_jax.target.kernels import SPLASH_BLOCK as BLOCK
from dspark_jax.target.kernels import pallas_interpret


def _build_kernel(group: int, seq_len: int, interpret: bool):

    mask = sm.MultiHeadMask([sm.CausalMask((seq_len, seq_len)) for _ in range(group)])
    blocks = sk.BlockSizes(block_q=BLOCK, block_kv=BLOCK, block_kv_compute=BLOCK)
    # one kv head shared by `group` query heads: the MQA form of the kernel, mapped over kv heads
    return sk.make_splash_mqa_single_device(mask, block_sizes=blocks, interpret=interpret)


@functools.lru_cache(maxsize=16)
def _kernel(group: int, seq_len: int, interpret: bool):
    """The kernel's mask tables are concrete arrays (`jnp.array`). Built in the tracing thread
    they would be tracers (cached: leaked) or, under a mesh of compile-only TPU devices (an
    ahead-of-time compile), placed on devices that cannot hold data. The trace and the mesh are
    thread-local, so a worker thread builds them on the host's default device, as plain
    constants of whatever program uses them."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(_build_kernel, group, seq_len, interpret).result()


def _local(q, k, v, key_valid, interpret: bool):
    """q [B, T, Nkv, G, D]; k, v [B, T, Nkv, D]; key_valid [B, T] -> [B, T, Nkv, G, D]."""
    b, t, nkv, g, d = q.shape
    kernel = _kernel(g, t, interpret)
    qh = jnp.transpose(q * jnp.asarray(1.0 / math.sqrt(d), q.dtype), (0, 2, 3, 1, 4))  # [B, Nkv, G, T, D]
    kh = jnp.transpose(k, (0, 2, 1, 3))  # [B, Nkv, T, D]
    vh = jnp.transpose(v, (0, 2, 1, 3))
    seg = key_valid.astype(jnp.int32)

    def one_row(qr, kr, vr, sr):
        per_head = jax.vmap(lambda qq, kk, vv: kernel(qq, kk, vv, segment_ids=SegmentIds(sr, sr)))
        return per_head(qr, kr, vr)

    # bf16 operands are multiplied exactly with f32 accumulation at the default precision; a
    # process-wide "highest" (jax_default_matmul_precision) would ask Mosaic for an fp32
    # contraction of bf16 operands, which it refuses
    bf16 = q.dtype == jnp.bfloat16
    with jax.default_matmul_precision("default") if bf16 else contextlib.nullcontext():
        out = jax.vmap(one_row)(qh, kh, vh, seg)  # [B, Nkv, G, T, D]
    return jnp.transpose(out, (0, 3, 1, 2, 4))


def splash_causal_attention(q, k, v, key_valid):
    """Same contract as `layers.causal_attention`: q [B, T, Nq, D], k, v [B, T, Nkv, D],
    key_valid [B, T]. On a mesh (`jax.set_mesh`) the kernel runs per shard: rows over the batch
    axes, kv heads over `tensor` when they divide it, as the rules table says."""
    b, t, nq, d = q.shape
    nkv = k.shape[2]
    q5 = q.reshape(b, t, nkv, nq // nkv, d)
    mesh = jax.sharding.get_abstract_mesh()
    local = functools.partial(_local, interpret=pallas_interpret())
    if mesh.empty:
        out = local(q5, k, v, key_valid)
    else:
        q_spec = logical_to_pspec(("batch", None, "act_heads", None, None), q5.shape, mesh)
        kv_spec = logical_to_pspec(("batch", None, "act_heads", None), k.shape, mesh)
        valid_spec = logical_to_pspec(("batch", None), key_valid.shape, mesh)
        out = jax.shard_map(local, in_specs=(q_spec, kv_spec, kv_spec, valid_spec), out_specs=q_spec,
                            check_vma=False)(q5, k, v, key_valid)
    return out.reshape(b, t, nq, d)
