"""How a program's attention reads a KV cache, chosen once from the platform it is compiled for.

One `AttentionBackend` per program: `attention_backend(requested, mesh)` decides, from the
caller's request and the platform of the mesh the program is traced under (target/kernels.py),
whether the caches are read by a Pallas kernel (each row's pages, or the dense cache's filled
positions, read in place and once: target/paged_kernel.py through Mosaic on TPU,
target/gpu_kernel.py on GPU, which picks Mosaic GPU on Hopper for 16-bit caches, else Triton) or
by the reference path (the row's keys gathered into a `[max_len]` view, then `layers.attention`;
XLA:CPU and tests). Both caches
(target/kv_cache.py, target/paged_kv.py) expose the same two primitives, `layer_view` and
`kernel_lse`, and the backend is the only code that picks between them (a cache may say the
kernel does not pay at its size, `kernel_pays`; the GPU kernels take the shapes the Triton one
tiles, `gpu_kernel_fits`: power-of-two head dims and tiles).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from dspark_jax.parallel.platform import platform
from dspark_jax.target.gpu_kernel import gpu_kernel_fits
from dspark_jax.target.kernels import PAGED_KERNELS, choose_paged_kernel
from dspark_jax.target.layers import attention, attention_parts
from dspark_jax.target.own_keys import OwnKeys
from dspark_jax.target.query_prep import QueryPrep

__all__ = ["AttentionBackend", "attention_backend", "attend_before", "CACHE_READS"]

CACHE_READS = PAGED_KERNELS  # "auto" (kernel where compiled for TPU or GPU), "reference", "pallas"


def attend_before(q, k, v, start, extra):
    """q [R, T, Nq, D] over the keys k, v [R, S, Nkv, D] at positions < start [R] and the key sets
    in `extra` [(k, v, mask [R, T, S_i])], one softmax (`attention_parts`)."""
    r, t, s = q.shape[0], q.shape[1], k.shape[1]
    before = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None, None, :] < start[:, None, None], (r, t, s))
    return attention_parts(q, [(k, v, before), *extra])


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    kernel: bool  # caches read by a Pallas kernel, in place
    interpret: bool  # the kernel in Pallas interpret mode (the program is compiled for neither TPU nor GPU)
    forced: bool = False  # the kernel asked for by name: used whatever the cache's size
    gpu: bool = False  # a GPU kernel (target/gpu_kernel.py chooses Mosaic GPU or Triton) in place of the TPU one

    def _kernel_for(self, cache, k_all) -> bool:
        if self.gpu and not gpu_kernel_fits(k_all.shape[-1], k_all.shape[-2], dense=cache.DENSE):
            return False
        # the TPU kernel pays at any size (no merge around it); the GPU one from `kernel_pays`
        return self.kernel and (self.forced or not self.gpu or cache.kernel_pays(k_all))

    def takes_raw_queries(self, cache, k_all) -> bool:
        """Whether `committed` over this cache prepares raw queries in the kernel (`QueryPrep`):
        the TPU kernel does, once per query block; elsewhere they are prepared before it."""
        return self._kernel_for(cache, k_all) and not self.gpu

    def committed(self, cache, q, k_all, v_all, layer, start, own: OwnKeys, dtype, rows=None,
                  q_prep: QueryPrep | None = None):
        """Attention of q [R, T, Nq, D] over layer `layer`'s keys at positions < start [R] and the
        block's own keys `own`, one softmax: the kernel takes the own keys into its online softmax
        after the cache's (the GPU kernel joins them through their log-sum-exp). `rows` [K]:
        q [K, T, ..] are queries of those slots (a prefill chunk's rows). `q_prep`: q is raw,
        prepared in the kernel where it takes them (`takes_raw_queries`), else here."""
        own = own.astype(dtype)
        if not self._kernel_for(cache, k_all):
            q = q if q_prep is None else q_prep.apply(q)
            return attend_before(q, *cache.layer_view(k_all, v_all, layer, dtype, rows), start,
                                 [own.as_part(q.shape[1])])
        out, _ = cache.kernel_lse(q, k_all, v_all, layer, start, start, rows=rows, own=own, q_prep=q_prep,
                                  interpret=self.interpret, gpu=self.gpu, out_dtype=dtype)
        return out

    def new_tokens(self, cache, q, k_all, v_all, layer, mask, dtype, positions=None, rows=None):
        """Attention of q [R, T, Nq, D] against layer `layer` of the cache, mask [R, T, max_len];
        `rows` [K]: q [K, T, ..] are queries of those slots. With the kernel and `positions` [R, T]
        (each row's queries at consecutive positions, the mask then being keys <= the query's
        position) the kernel reads the cache up to the row's last query instead of the mask."""
        if positions is None or not self._kernel_for(cache, k_all):
            return attention(q, *cache.layer_view(k_all, v_all, layer, dtype, rows), mask)
        start = positions[:, 0].astype(jnp.int32)
        out, _ = cache.kernel_lse(q, k_all, v_all, layer, start + q.shape[1], start, rows=rows,
                                  interpret=self.interpret, gpu=self.gpu)
        return out.astype(dtype)


def attention_backend(requested: str = "auto", mesh=None) -> AttentionBackend:
    """The backend for `requested` ("auto": the kernel where the program is compiled for TPU or GPU
    and the cache says it pays; "pallas": always, the TPU kernel interpreted elsewhere;
    "reference": never) on `mesh` (else the mesh set by `jax.set_mesh`, else the default device)."""
    kernel = choose_paged_kernel(requested, mesh) == "pallas"
    where = platform(mesh)
    return AttentionBackend(kernel=kernel, interpret=where not in ("tpu", "gpu"), forced=requested == "pallas",
                            gpu=where == "gpu")
