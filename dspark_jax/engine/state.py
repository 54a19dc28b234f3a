"""The decode state of R request slots (a pytree, every leaf a fixed-shape array) and the
traced per-call controls.

Convention per slot r: while its prompt is forwarded in chunks (`EngineConfig(prefill_chunk=...)`),
`pos[r] < plen[r] - 1` is how far it got (the cache holds positions < pos); then the
committed sequence is x_0..x_p, `anchor[r] = x_p`,
`pos[r] = p`; the target cache holds K/V of positions < p (`cache.lengths == pos`), the
anchor is forwarded by the next round's verification. Drafter state per mode:
DSpark/DFlash: context K/V of positions < p; Eagle3/MTP-1: their one-layer cache with
`lengths == p - 1` and `last` = target features (Eagle3, [R, m, H]) or final hidden
(MTP-1, [R, H]) at position p - 1.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.target.kv_cache import KVCache
from dspark_jax.target.paged_kv import PagedKVCache

__all__ = ["DecodeState", "Control", "RoundOut", "FINISH_REASONS"]

# why a request ended (DecodeState.finish): still running, a stop token, max_new tokens, or the
# slot's context (max_len) full before max_new was reached
FINISH_NONE, FINISH_STOP, FINISH_LENGTH, FINISH_CONTEXT = 0, 1, 2, 3
FINISH_REASONS = {FINISH_NONE: None, FINISH_STOP: "stop", FINISH_LENGTH: "length", FINISH_CONTEXT: "context"}


class DecodeState(NamedTuple):
    cache: KVCache | PagedKVCache  # target KV: dense [L, R, Nkv, S, D] or paged (EngineConfig(kv_pages=...))
    dcache: KVCache  # drafter cache (mode dependent; a 1-position dummy for target-only)
    last: jax.Array  # Eagle3 [R, m, H] / MTP-1 [R, H] / dummy [R, 1]
    anchor: jax.Array  # [R] int32
    pos: jax.Array  # [R] int32
    active: jax.Array  # [R] bool: holds an unfinished request
    keys: jax.Array  # [R] typed PRNG keys (per request)
    rounds: jax.Array  # [R] int32 rounds run by the request
    acc_sum: jax.Array  # [R] int32 sum over rounds of accepted drafts
    n_gen: jax.Array  # [R] int32 tokens generated
    max_new: jax.Array  # [R] int32
    out: jax.Array  # [R, S] int32 generated tokens
    # [2, R, G'] prefix survivals of the last two rounds (carried through skipped rounds; -1 = none yet)
    a_hist: jax.Array
    step: jax.Array  # scalar int32 rounds run by the engine
    since_draft: jax.Array  # scalar int32 rounds since the last round that drafted ("known" / "acceptance")
    # scalar int32 rounds between probes; doubles while fresh survivals say "no"; -n after a settled
    # "no" with n slots decoding (no probes while at least n decode)
    probe_gap: jax.Array
    # scalar float32 seconds the rounds that drafted saved against plain decoding, as their own
    # survivals expect (`prefix.drafting_gain`, the skip rules on survivals): what funds rounds that may lose
    probe_credit: jax.Array
    # scalar float32 decayed sums over the rounds that drafted: drafts the confidence head's
    # survivals expected accepted among those verified, and drafts accepted (`round._calibration`)
    calib_expected: jax.Array
    calib_accepted: jax.Array
    # [2, G'] float32 decayed sums over the rounds that drafted, per draft position k: rows at
    # risk at k (verified it, every draft before it accepted), and rows whose draft at k was
    # accepted (the "acceptance" skip rule's survivals, `prefix.running_survivals`)
    run_counts: jax.Array
    finish: jax.Array  # [R] int32 why the slot's request ended (FINISH_*; 0 while running)
    plen: jax.Array  # [R] int32 prompt length of the slot's request
    joined: jax.Array  # [R] int32 `step` at which it joined (chunked prefill serves the earliest first)
    prompt: jax.Array  # [R, S] int32 its prompt, read by chunked prefill ([R, 1] when the engine has none)


PIN_POLICY = -1  # Control.pin: the round's policy and skip rule decide
PIN_SKIP = -2  # Control.pin: the round skips drafting (the plain round, drafter context kept)


class Control(NamedTuple):
    """Traced settings of a call: changing them does not recompile."""

    sampling: SamplingParams  # each field [R]
    gamma: jax.Array  # int32: fixed-gamma verification length (<= the compiled block size)
    threshold: jax.Array  # float32: static confidence threshold
    sts: jax.Array  # [G'] float32 STS temperatures for the prefix survival
    table: Any  # scheduler.CostTable
    default_k: jax.Array  # int32: production scheduler capacity for its first two rounds
    stop_ids: jax.Array  # [R, K] int32 per slot (-1 = none)
    # int32, for timing the round (engine/own_costs.py): -1 the policy and skip rule decide; g >= 0
    # every active slot drafts and verifies g drafts; PIN_SKIP: the round skips drafting
    pin: jax.Array


class RoundOut(NamedTuple):
    """Per-round, per-slot record (the trace the calibration reads)."""

    z: jax.Array  # [R, G'] raw confidence logits
    lengths: jax.Array  # [R] verification length chosen
    accepted: jax.Array  # [R] accepted draft tokens kept (a cut round counts only what it kept)
    n_out: jax.Array  # [R] tokens committed this round
    active: jax.Array  # [R] slot was active in this round
    bucket: jax.Array  # scalar: bucket index used
    cut: jax.Array  # [R] bool: a stop token or max_new discarded verified tokens this round
    drafted: jax.Array  # scalar bool: the drafter ran this round (False: a skip rule skipped it, or target-only)
