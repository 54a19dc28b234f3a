"""Batched, static-shape, lossless speculative decoding (spec 3.1 and 5).

- state.py: the decode-state pytree of R slots, traced controls, per-round records.
- spec.py: the static description of a compiled engine (the drafter kind's adapter inside).
- verify.py: the target's verification forward, packed dense work + padded attention view.
- policy.py: verification-length policies (fixed, threshold, scheduler variants).
- round.py: prefill, the one compiled round, the while loop of rounds.
- page_alloc.py: the host-side page allocator of the paged target KV cache (Engine(kv_pages=...)).
- engine.py: the Engine class (continuous batching, Python API), measure_accepted_length.
- generate.py: `python -m dspark_jax.generate`.
"""

from dspark_jax.calibration.traces import Traces
from dspark_jax.engine.engine import (
    Engine, EngineError, GenerateResult, RequestResult, default_buckets, measure_accepted_length,
)
from dspark_jax.engine.page_alloc import OutOfPagesError, PageAllocator

__all__ = ["Engine", "EngineError", "GenerateResult", "OutOfPagesError", "PageAllocator", "RequestResult", "Traces",
           "default_buckets", "measure_accepted_length"]
