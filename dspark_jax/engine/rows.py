"""Host-side shaping of a join's device arguments: per-slot rows of the prompts, keys and
budgets, the sampling settings and stop ids of the traced controls. Fixed shapes throughout,
so which slots join never recompiles anything; host arrays go to the device by `jax.device_put`
(a transfer), not `jnp.asarray` (outside a trace, a small compiled program per shape)."""

from __future__ import annotations

import jax
import numpy as np

from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.engine.buckets import bucket_for
from dspark_jax.engine.requests import stop_row
from dspark_jax.engine.state import Control, DecodeState

__all__ = ["join_rows", "by_bucket", "control_rows"]


def join_rows(R: int, st: DecodeState, width: int, slots, prompts, key_data, max_new):
    """The device arguments of a join: prompts right padded [R, width], plen, join mask,
    per-request keys (rows not joining keep theirs: only the shape of `st.keys` is read) and
    max_new, each an [R] row set at `slots`."""
    tok = np.zeros((R, width), np.int32)
    plen = np.ones((R,), np.int32)
    join = np.zeros((R,), bool)
    mx = np.zeros((R,), np.int32)
    old = jax.random.key_data(st.keys)
    kd = np.zeros(old.shape, old.dtype)
    slots = np.asarray(slots, np.int64)
    for s, p in zip(slots, prompts):
        tok[s, : len(p)] = p
        plen[s] = len(p)
    join[slots], mx[slots], kd[slots] = True, np.asarray(max_new), np.asarray(key_data)
    keys = jax.random.wrap_key_data(jax.device_put(kd), impl=jax.random.key_impl(st.keys))
    return (*jax.device_put((tok, plen, join)), keys, jax.device_put(mx))


def by_bucket(buckets, prompts) -> list[list[int]]:
    """Indices of `prompts` grouped by their prefill bucket (one compiled prefill per group), in
    order of first appearance."""
    groups: dict = {}
    for j, p in enumerate(prompts):
        groups.setdefault(bucket_for(buckets, len(p)), []).append(j)
    return list(groups.values())


def control_rows(ctl: Control, slots, samplings, stop_ids) -> Control:
    """`ctl` with the sampling settings and stop ids of the requests joining `slots` in their rows."""
    samp = [np.array(x) for x in jax.device_get(ctl.sampling)]
    stops = np.array(ctl.stop_ids)
    for j, s in enumerate(slots):
        for col, v in zip(samp, samplings[j]):
            col[s] = v
        stops[s] = stop_row(stop_ids[j])
    return ctl._replace(sampling=SamplingParams(*jax.device_put(samp)), stop_ids=jax.device_put(stops))
