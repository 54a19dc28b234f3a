"""Verification-length policies: one interface, `policy(a, active, ctl, a_stale, stale_valid) -> l [R]`.

`a` [R, G] is the prefix survival of the current drafts (from the confidence logits and
the STS temperatures), `active` [R] bool, `ctl` the traced `Control` (gamma, threshold,
cost table, default capacity), `a_stale` the survivals of two rounds ago. A policy must
respect the lossless invariant of docs/method.md §3: whether draft j is verified never depends on
the value of draft j itself (all policies here do; see prefix.py). Policies are static
(part of the compiled program); their parameters are traced.

The throughput objective is static too: `theta="sps"` is the paper's `tau * SPS(B)`,
`theta="latency"` is `tau / (T_draft + T_verify(B))`; `cost` is how a batch of B tokens
is priced between buckets ("step": the bucket it runs in; "interp": linear).
Defaults (theta "latency", Algorithm 1 on "interp", production on "step") are what the
engine used before these were options.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from dspark_jax.scheduler import prefix

__all__ = ["POLICIES", "SCHEDULED", "THETA_MODES", "COSTS", "get_policy", "fixed", "threshold", "early_stop",
           "static", "production"]

THETA_MODES = ("sps", "latency")
COSTS = ("step", "interp")
SCHEDULED = ("early_stop", "static", "production")


def fixed(a, active, ctl, a_stale, stale_valid, **_):
    return jnp.where(active, jnp.clip(ctl.gamma, 0, a.shape[1]), 0).astype(jnp.int32)


def threshold(a, active, ctl, a_stale, stale_valid, **_):
    return jnp.minimum(prefix.schedule_threshold(a, active, ctl.threshold), ctl.gamma)


def early_stop(a, active, ctl, a_stale, stale_valid, mode="latency", cost="interp"):
    return prefix.schedule_early_stop(a, active, ctl.table, mode=mode, cost=cost)


def static(a, active, ctl, a_stale, stale_valid, mode="latency", cost=None):
    """docs/method.md §3.1: early stop on the interpolated table (`cost` does not apply), then the bucket is filled."""
    return prefix.schedule_static(a, active, ctl.table, mode=mode)[0]


def production(a, active, ctl, a_stale, stale_valid, mode="latency", cost="step"):
    return prefix.schedule_production(a, active, a_stale, stale_valid, ctl.table, ctl.default_k,
                                         mode=mode, cost=cost)[0]


POLICIES = {"fixed": fixed, "threshold": threshold, "early_stop": early_stop, "static": static,
            "production": production}


def get_policy(policy, theta: str = "latency", cost: str | None = None):
    """A policy by name with its objective bound (`theta`; `cost`, None = the policy's default:
    "interp" for Algorithm 1's exact-B throughput, "step" for production's bucket search),
    or a user function as is."""
    if callable(policy):
        return policy
    if policy not in POLICIES:
        raise ValueError(f"unknown length policy {policy!r}; choose one of: {', '.join(POLICIES)} or pass a function")
    if theta not in THETA_MODES:
        raise ValueError(f"unknown throughput objective theta={theta!r}; choose one of: {', '.join(THETA_MODES)}")
    if cost is not None and cost not in COSTS:
        raise ValueError(f"unknown cost model {cost!r}; choose one of: {', '.join(COSTS)}")
    if policy not in SCHEDULED:
        return POLICIES[policy]
    return _bound(policy, theta, cost)


@functools.lru_cache(maxsize=None)
def _bound(policy: str, theta: str, cost: str | None):
    """One object per (policy, theta, cost): engines of equal settings have equal specs, and so
    share their compiled programs (engine/programs.py)."""
    kw = {"mode": theta} if cost is None else {"mode": theta, "cost": cost}
    return functools.partial(POLICIES[policy], **kw)
