"""What an engine requires of its drafter: built for this target, a block size the config can
use, and a confidence head when the settings read survivals. Checked once, when the engine is
built, each refusal saying what to change."""

from __future__ import annotations

from dspark_jax.drafter.frozen import TargetMismatchError, check_target
from dspark_jax.engine.config import EngineConfig
from dspark_jax.engine.errors import EngineError
from dspark_jax.engine.policy import SCHEDULED

__all__ = ["draft_shape", "check_confidence_head"]


def draft_shape(kind, drafter, target, gamma, layer_ids):
    """The kind's static draft facts (block size, feature layers) for `drafter` on `target`."""
    tcfg = target.cfg
    check_target(getattr(drafter, "target_fingerprint", None), target, f"{kind.name} drafter")
    if tuple(drafter.embed.shape) != (tcfg.vocab_size, tcfg.hidden_size):
        raise TargetMismatchError(f"the {kind.name} drafter's embedding {tuple(drafter.embed.shape)} does not fit "
                                  f"the target ({tcfg.vocab_size}, {tcfg.hidden_size}): build it for this target")
    try:
        return kind.draft_shape(drafter, tcfg, gamma, layer_ids)
    except ValueError as e:
        raise EngineError(str(e)) from None


def check_confidence_head(drafter, config: EngineConfig, G: int, skip_rule, mode: str, policy=None) -> None:
    """A scheduler, the threshold policy and the "known" skip rule read survivals from the
    drafter's confidence head: refuse those settings for a drafter without one. `policy`: the
    resolved one (default the config's)."""
    policy = config.policy if policy is None else policy
    reads = G > 0 and (policy in (*SCHEDULED, "threshold") or skip_rule == "known")
    if reads and not getattr(getattr(drafter, "dcfg", None), "confidence_head", False):
        what = f"policy {policy!r}" if policy != "fixed" else f"skip_drafting={config.skip_drafting!r}"
        raise EngineError(f"{what} schedules verification from the drafter's confidence head, and this {mode} "
                          "drafter has none: use policy 'fixed' (and skip_drafting 'acceptance', 'best_case' or "
                          "none), or a DSpark drafter trained with its confidence head")
