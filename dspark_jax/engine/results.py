"""What `Engine.generate` returns: one record per request and the call's totals."""

from __future__ import annotations

from dataclasses import dataclass, field

from dspark_jax.calibration.traces import Traces

__all__ = ["RequestResult", "GenerateResult"]


@dataclass
class RequestResult:
    tokens: list[int]
    prompt_len: int
    rounds: int
    accepted: int  # accepted draft tokens kept, over all rounds (len(tokens) == accepted + rounds)
    seconds: float
    finish_reason: str | None = None  # "stop", "length" (max_new_tokens) or "context" (max_len full first)

    @property
    def tau(self) -> float:
        """Mean over rounds of (accepted + 1)."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else float("nan")


@dataclass
class GenerateResult:
    results: list[RequestResult]
    seconds: float
    round_calls: int  # compiled round dispatches (host loop) or while-loop calls
    traces: Traces | None = None
    extra: dict = field(default_factory=dict)

    @property
    def tau(self) -> float:
        """Accepted length over all rounds of all requests."""
        r = sum(x.rounds for x in self.results)
        return (sum(x.accepted for x in self.results) + r) / r if r else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return sum(len(x.tokens) for x in self.results) / self.seconds if self.seconds > 0 else float("nan")
