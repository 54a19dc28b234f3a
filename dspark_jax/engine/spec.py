"""The static description of a compiled engine (hashable: the jit cache key).

Everything the drafter kind decides lives behind `Spec.kind` (drafter/kinds/): the round calls
`spec.kind.prefill / draft / update` whatever the kind; `kind` is None for target-only decoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from dspark_jax.decoding import rejection
from dspark_jax.drafter.kinds.base import DrafterKind, DraftShape
from dspark_jax.target.config import ModelConfig

__all__ = ["Spec", "SURVIVAL_RULES", "CHOOSING_RULES"]

# skip rules that decide on survivals: the confidence head's ("known") or the running acceptance
# of past rounds ("acceptance", drafters without a head); both probe, settle and fund rounds alike
SURVIVAL_RULES = ("known", "acceptance")
# skip rules that choose each round's program (the plain, settled or drafting round)
CHOOSING_RULES = ("best_case", *SURVIVAL_RULES)


@dataclass(frozen=True)
class Spec:
    kind: DrafterKind | None  # the drafter's adapter; None = target-only
    draft: DraftShape | None  # the drafter's static facts (block size, layer config, feature layers)
    tcfg: ModelConfig  # target
    buckets: tuple[int, ...]
    max_len: int
    policy: Callable
    verify: Callable = rejection.verify  # batched rejection sampling (tests inject broken variants)
    # None | "best_case" | "known" | "acceptance": when to skip the draft (engine/round.py); "always"
    # (cost predictions only, engine/predict.py): every round skips, so the compiled round is the skipped one
    skip_drafting: str | None = None
    theta: str = "latency"  # throughput objective of the skip rule ("sps" | "latency")
    probe_every: int = 8  # rules on survivals: first probe interval (rounds) to refresh them ...
    probe_max: int = 64  # ... doubled after each draft whose survivals say no speculation pays, up to this
    prefill_chunk: int = 0  # prompt tokens a round forwards for joining slots (0: prompts are prefilled whole)
    prefill_rows: int = 0  # ... spread over at most this many slots
    prefill_tokens: int = 8192  # prompt tokens one prefill forward holds: larger batches go in row groups
    # attention views (queries per row) the round picks from; () = G + 1 alone. (1, G + 1) adds a one-column
    # view for rounds that verify no drafts; a cost prediction compiles one view at a time
    verify_widths: tuple[int, ...] = ()

    @property
    def G(self) -> int:
        """Compiled block size (draft tokens per round); 0 for target-only."""
        return 0 if self.draft is None else self.draft.G

    @property
    def reads_survivals(self) -> bool:
        """The skip rule decides on survivals (`SURVIVAL_RULES`): it probes, settles and keeps a credit."""
        return bool(self.G) and self.skip_drafting in SURVIVAL_RULES

    @property
    def chooses_rounds(self) -> bool:
        """A skip rule picks each round's program (`round.round_choice`)."""
        return bool(self.G) and self.skip_drafting in CHOOSING_RULES

    @property
    def Gs(self) -> int:
        """Width of confidence / survival arrays (>= 1 so target-only still has shapes)."""
        return max(self.G, 1)

    @property
    def widths(self) -> tuple[int, ...]:
        """Widths of the verification's attention view the round picks from (by its longest row):
        a round that verifies no drafts (skipped, or scheduled to none) attends with one query per
        row, not gamma + 1, and so costs about a target-only step."""
        return self.verify_widths or (self.G + 1,)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return () if self.draft is None else self.draft.feature_layers
