"""Batched, static-shape, lossless speculative decoding (docs/method.md §3.1 and §5).

- state.py: the decode-state pytree of R slots, traced controls, per-round records.
- spec.py: the static description of a compiled engine (the drafter kind's adapter inside).
- verify.py: the target's verification forward, packed dense work + padded attention view.
- policy.py: verification-length policies (fixed, threshold, scheduler variants).
- round.py: prefill, the one compiled round, the while loop of rounds.
- config.py: EngineConfig, the engine's settings (checked once); errors.py: its errors.
- buckets.py, rows.py, layout.py, programs.py: compiled sizes, a join's device rows, the decode
  state and its mesh layout, the jitted programs.
- page_alloc.py: the host-side page allocator of the paged KV caches, admission by reservation
  (EngineConfig(kv_pages=...)); slot_pages.py: its page table inside the decode state.
- requests.py: one request checked against the engine's ranges (Engine.validate_request).
- engine.py: the Engine class (slots, controls, compiled calls), measure_accepted_length.
- batcher.py: continuous batching (Engine.generate, the server, the benchmarks); results.py.
- texts.py: chat conversations through the engine, completions as text (the generate command).
- plan.py: per-chip serving memory (`python -m dspark_jax plan engine`).
"""

import importlib

# Loaded on first use (PEP 562), so importing the package for a command's --help and the planner's
# --help do not import jax.
_EXPORTS = {"Traces": "dspark_jax.calibration.traces", "Engine": "dspark_jax.engine.engine",
            "EngineConfig": "dspark_jax.engine.config", "EngineError": "dspark_jax.engine.errors",
            "EngineConfigError": "dspark_jax.engine.errors", "InvalidRequest": "dspark_jax.engine.errors",
            "GenerateResult": "dspark_jax.engine.results", "RequestResult": "dspark_jax.engine.results",
            "Batcher": "dspark_jax.engine.batcher", "Job": "dspark_jax.engine.batcher",
            "default_buckets": "dspark_jax.engine.buckets", "with_chunk_room": "dspark_jax.engine.buckets",
            "measure_accepted_length": "dspark_jax.engine.engine", "OutOfPagesError": "dspark_jax.engine.page_alloc",
            "PageAllocator": "dspark_jax.engine.page_alloc"}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'dspark_jax.engine' has no attribute {name!r}")
