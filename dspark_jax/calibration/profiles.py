"""Acceptance profiles: traces for the serving simulator from a published tau instead of a run.

A profile is a drafter kind, a block size gamma and a target tau (mean accepted drafts + 1 per
round at full gamma, the paper's metric). `profile_traces` draws traces from the parametric model
of `synthetic_traces` (per-request difficulty, per-position decay of the kind, over-confident
noisy confidences for STS to fix) with the acceptance level solved so the traces' tau is the
profile's. Published figures are named in PROFILES with their source; any tau can be given as
``tau:5.4`` (kind and gamma from the caller) or per-position acceptance rates as
``rates:0.94,0.9,...`` (the share of rounds whose draft j was accepted, j = 1..gamma).

The paper's and DeepSpec's profiles below were measured at temperature 1; docs/tpu_predictions.md
applies them to programs compiled greedy (temperature 0), whose acceptance was not published.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dspark_jax.calibration.traces import SYNTHETIC_PRESETS, TraceError, TraceSet, synthetic_traces

__all__ = ["Profile", "PROFILES", "parse_profile", "profile_traces", "rates_tau"]


@dataclasses.dataclass(frozen=True)
class Profile:
    kind: str  # dspark | dflash | mtp1 (the per-position decay of SYNTHETIC_PRESETS)
    gamma: int
    tau: float
    source: str


_PAPER = "the DSpark paper, Qwen3-4B, T = 1, gamma 7 (docs/method.md §7)"
_DEEPSPEC = ("DeepSpec's evaluation of the DSpark Qwen3-8B drafter, a third-party run of DeepSpec's eval.py at "
             "temperature 1 (its default; the run compares itself with the paper's temperature-1 table), gamma 7")
PROFILES = {
    "paper-4b-gsm8k-dspark": Profile("dspark", 7, 6.11, _PAPER),
    "paper-4b-gsm8k-dflash": Profile("dflash", 7, 5.40, _PAPER),
    "paper-4b-arena-hard-dspark": Profile("dspark", 7, 3.29, _PAPER),
    "paper-4b-arena-hard-dflash": Profile("dflash", 7, 2.83, _PAPER),
    "deepspec-8b-gsm8k-dspark": Profile("dspark", 7, 6.15, _DEEPSPEC),
    "deepspec-8b-math500-dspark": Profile("dspark", 7, 5.80, _DEEPSPEC),
    "deepspec-8b-humaneval-dspark": Profile("dspark", 7, 5.53, _DEEPSPEC),
    "deepspec-8b-mbpp-dspark": Profile("dspark", 7, 5.17, _DEEPSPEC),
    "deepspec-8b-mt-bench-dspark": Profile("dspark", 7, 3.72, _DEEPSPEC),
    "tpu-inference-4b-dflash-k16": Profile(
        "dflash", 15, 5.42, "tpu-inference's DFlash on TPU v5p-8, Qwen3-4B, K = 16, batch 1, mean over its sets"),
}


def rates_tau(rates) -> float:
    """tau of per-position acceptance rates (the share of rounds accepting draft j): 1 + their sum."""
    return 1.0 + float(np.sum(rates))


def parse_profile(text: str, kind: str = "dspark", gamma: int = 7) -> Profile:
    """A name from PROFILES, ``tau:X`` or ``rates:r1,...,rG`` -> Profile; anything else is a
    ValueError naming what is accepted."""
    text = str(text).strip()
    if text in PROFILES:
        return PROFILES[text]
    if text.startswith("tau:"):
        tau = float(text[4:])
        if not 1.0 <= tau <= gamma + 1:
            raise ValueError(f"acceptance {text!r}: tau must lie in 1 .. gamma + 1 = {gamma + 1}")
        return Profile(kind, gamma, tau, f"given: tau {tau:g}")
    if text.startswith("rates:"):
        rates = [float(x) for x in text[6:].split(",") if x]
        if len(rates) != gamma:
            raise ValueError(f"acceptance {text!r} gives {len(rates)} per-position rates, the drafter drafts "
                             f"gamma = {gamma}: give exactly {gamma}")
        if any(not 0.0 <= r <= 1.0 for r in rates) or any(b > a for a, b in zip(rates, rates[1:])):
            raise ValueError(f"acceptance {text!r}: rates must lie in [0, 1] and not increase (draft j + 1 is "
                             "accepted only when draft j is)")
        return Profile(kind, gamma, rates_tau(rates), f"given: per-position rates {rates}")
    raise ValueError(f"unknown acceptance profile {text!r}: give one of {', '.join(sorted(PROFILES))}, "
                     "tau:X (e.g. tau:5.4) or rates:r1,...,rG")


def profile_traces(profile: Profile, n_requests: int = 256, rounds_per_request: int = 64, seed: int = 0,
                   tol: float = 0.01) -> TraceSet:
    """Traces whose tau is `profile.tau` within `tol` (bisection on the acceptance level mu0 of
    `synthetic_traces`, the kind's decay kept; fixed seed, so the same profile gives the same traces)."""
    if profile.kind not in SYNTHETIC_PRESETS:
        raise TraceError(f"profile kind {profile.kind!r}: choose one of {sorted(SYNTHETIC_PRESETS)}")
    make = lambda mu0: synthetic_traces(n_requests, rounds_per_request, profile.gamma, kind=profile.kind, seed=seed,
                                        mu0=mu0)
    lo, hi = -8.0, 16.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        ts = make(mid)
        if abs(ts.tau() - profile.tau) <= tol:
            break
        lo, hi = (mid, hi) if ts.tau() < profile.tau else (lo, mid)
    else:
        raise TraceError(f"no acceptance level gives tau {profile.tau} at gamma {profile.gamma} for {profile.kind}")
    ts.meta["source"] = f"profile: tau {profile.tau:g} ({profile.source}); {ts.meta['source']}"
    return ts
