"""Batched, static-shape, lossless speculative decoding (spec 3.1 and 5).

- state.py: the decode-state pytree of R slots, traced controls, per-round records.
- spec.py: the static description of a compiled engine (the drafter kind's adapter inside).
- verify.py: the target's verification forward, packed dense work + padded attention view.
- policy.py: verification-length policies (fixed, threshold, scheduler variants).
- round.py: prefill, the one compiled round, the while loop of rounds.
- page_alloc.py: the host-side page allocator of the paged KV caches (Engine(kv_pages=...)).
- engine.py: the Engine class (continuous batching, Python API), measure_accepted_length.
- generate.py: `python -m dspark_jax.generate`.
"""

import importlib

# Loaded on first use (PEP 562), so `python -m dspark_jax.generate --help` and the planner's
# --help do not import jax.
_EXPORTS = {"Traces": "dspark_jax.calibration.traces", "Engine": "dspark_jax.engine.engine",
            "EngineError": "dspark_jax.engine.engine", "GenerateResult": "dspark_jax.engine.engine",
            "RequestResult": "dspark_jax.engine.engine", "default_buckets": "dspark_jax.engine.engine",
            "measure_accepted_length": "dspark_jax.engine.engine", "OutOfPagesError": "dspark_jax.engine.page_alloc",
            "PageAllocator": "dspark_jax.engine.page_alloc", "with_chunk_room": "dspark_jax.engine.engine"}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'dspark_jax.engine' has no attribute {name!r}")
