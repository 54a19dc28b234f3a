"""Verification-length policies: one interface, `policy(a, active, ctl, a_stale, stale_valid) -> l [R]`.

`a` [R, G] is the prefix survival of the current drafts (from the confidence logits and
the STS temperatures), `active` [R] bool, `ctl` the traced `Control` (gamma, threshold,
cost table, default capacity), `a_stale` the survivals of two rounds ago. A policy must
respect the lossless invariant of spec 3: whether draft j is verified never depends on
the value of draft j itself (all policies here do; see scheduler.py). Policies are static
(part of the compiled program); their parameters are traced.
"""

from __future__ import annotations

import jax.numpy as jnp

from dspark_jax import scheduler

__all__ = ["POLICIES", "get_policy", "fixed", "threshold", "early_stop", "static", "production"]


def fixed(a, active, ctl, a_stale, stale_valid):
    return jnp.where(active, jnp.clip(ctl.gamma, 0, a.shape[1]), 0).astype(jnp.int32)


def threshold(a, active, ctl, a_stale, stale_valid):
    return jnp.minimum(scheduler.schedule_threshold(a, active, ctl.threshold), ctl.gamma)


def early_stop(a, active, ctl, a_stale, stale_valid):
    return scheduler.schedule_early_stop(a, active, ctl.table, mode="latency")


def static(a, active, ctl, a_stale, stale_valid):
    return scheduler.schedule_static(a, active, ctl.table, mode="latency")[0]


def production(a, active, ctl, a_stale, stale_valid):
    return scheduler.schedule_production(a, active, a_stale, stale_valid, ctl.table, ctl.default_k,
                                         mode="latency", cost="step")[0]


POLICIES = {"fixed": fixed, "threshold": threshold, "early_stop": early_stop, "static": static,
            "production": production}


def get_policy(policy):
    if callable(policy):
        return policy
    if policy not in POLICIES:
        raise ValueError(f"unknown length policy {policy!r}; choose one of: {', '.join(POLICIES)} or pass a function")
    return POLICIES[policy]
