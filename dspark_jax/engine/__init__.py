"""Batched, static-shape, lossless speculative decoding (spec 3.1 and 5).

- state.py: the decode-state pytree of R slots, traced controls, per-round records.
- verify.py: the target's verification forward, packed dense work + padded attention view.
- drafts.py: per-mode drafter adapters (DSpark, DFlash, Eagle3, MTP-1) and the static Spec.
- policy.py: verification-length policies (fixed, threshold, scheduler variants).
- round.py: prefill, the one compiled round, the while loop of rounds.
- engine.py: the Engine class (continuous batching, Python API), measure_accepted_length.
- traces.py: per round and request records for calibration.
"""

from dspark_jax.engine.engine import (
    Engine, EngineError, GenerateResult, RequestResult, default_buckets, drafter_mode, measure_accepted_length,
)
from dspark_jax.engine.traces import Traces

__all__ = ["Engine", "EngineError", "GenerateResult", "RequestResult", "Traces", "default_buckets", "drafter_mode",
           "measure_accepted_length"]
