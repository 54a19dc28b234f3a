"""The engine's settings: one frozen, typed value, checked once when it is made.

    engine = Engine(target, drafter, EngineConfig(num_slots=8, max_len=512))  # the kind's scheduling, own table
    config = EngineConfig(num_slots=8, max_len=512, policy="fixed")            # every round verifies gamma drafts

What needs the models (the drafter's block size, whether it has a confidence head, whether a cost
table prices the buckets) is checked by the `Engine` that uses the config; everything a value alone
decides is checked here, and each refusal names the field and what to give instead.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass, fields

from dspark_jax.engine.errors import EngineConfigError
from dspark_jax.engine.policy import get_policy
from dspark_jax.target.paged_kernel import PAGED_ATTENTION_IMPLS

__all__ = ["AUTO", "EngineConfig", "EngineConfigError", "SKIP_RULES"]

AUTO = "auto"  # policy / skip_drafting: the drafter kind's default (`DrafterKind.default_scheduling`)

# accepted `skip_drafting` values -> the rule the compiled round applies (None: always draft)
SKIP_RULES = {False: None, None: None, "none": None, True: "known", "known": "known", "best_case": "best_case",
              "acceptance": "acceptance"}


@dataclass(frozen=True)
class EngineConfig:
    # request slots decoded together: the batch of every compiled round
    num_slots: int = 8
    # tokens a slot holds (prompt + generated + one round's drafts): the KV cache length
    max_len: int = 512
    # default verification length (fixed / threshold policies); None = the drafter's block size
    gamma: int | None = None
    # verification bucket sizes in tokens; None = a cost table's buckets, else R, 2R, ... R * (G + 1)
    buckets: tuple[int, ...] | None = None
    # prompt-length buckets, one compiled prefill each; None = 16, 32, ... up to max_len
    prefill_buckets: tuple[int, ...] | None = None
    # verification lengths: "auto" (the drafter kind's default: `DrafterKind.default_scheduling`),
    # "fixed", "threshold", a scheduler ("early_stop", "static", "production") or a function
    policy: str | Callable = "auto"
    # what a scheduler maximises: "sps" (tau * SPS(B), the paper's) or "latency" (tau / round time)
    theta: str = "latency"
    # how a scheduler prices B tokens: "interp" / "step"; None = the policy's own default
    cost: str | None = None
    # skip the whole draft when it cannot pay: None, "best_case", "known" (on the confidence head's
    # survivals; True = "known") or "acceptance" (on past rounds' acceptance, any drafter);
    # "auto": the kind's default with policy "auto", else None
    skip_drafting: str | bool | None = "auto"
    # a scheduled engine given no cost table measures its own on its compiled programs, read back
    # from the user cache when an engine of the same key measured it (engine/own_costs.py);
    # False: it needs table=
    own_costs: bool = True
    # timed sweeps of the buckets when it measures its own table (after one untimed; the medians)
    own_costs_repeats: int = 3
    # rules on survivals ("known", "acceptance"): rounds between probes that refresh them ...
    probe_every: int = 8
    # ... doubled while fresh survivals say no, up to this
    probe_max: int = 64
    # target layers the drafter reads (None: the drafter's own)
    layer_ids: tuple[int, ...] | None = None
    # (num_pages, page_size): a paged KV cache, a pool shared by the slots; None = dense [R, max_len]
    kv_pages: tuple[int, int] | None = None
    # how attention reads the KV cache, dense or paged: "auto" (Pallas kernel on TPU, reference
    # elsewhere), "pallas", "reference" (target/attention_backend.py)
    paged_attention: str = "auto"
    # prompt tokens a round forwards for a request joining running ones; None = prompts prefilled whole
    prefill_chunk: int | None = None
    # ... spread over at most this many joining slots a round
    prefill_rows: int = 4
    # prompt tokens one prefill forward holds: the slots of a larger prefill go in groups of rows
    prefill_tokens: int = 8192
    # where the engine splits the target's layers per layer (compiled for an accelerator), the
    # model keeps its stacked decoder weights beside the split, the layers held twice; by default
    # the model gives them up and reads the split (target/decode_weights.py). For a caller that
    # runs arrays it took from the model before the engine was built (an `nnx.split` state, a
    # trainer's), which the default would delete
    keep_target_stacks: bool = False

    def __post_init__(self):
        for name in ("buckets", "prefill_buckets", "layer_ids", "kv_pages"):  # lists -> tuples (hashable)
            value = getattr(self, name)
            if value is None:
                continue
            try:
                items = tuple(value)
            except TypeError:
                items = None
            if items is None or not all(_is_int(x) for x in items):
                raise EngineConfigError(f"EngineConfig.{name} must be a sequence of integers, got {value!r}")
            object.__setattr__(self, name, tuple(int(x) for x in items))
        self.check()

    def check(self) -> None:
        """Raise EngineConfigError naming the first field out of range and the fix."""
        _at_least("num_slots", self.num_slots, 1, "one request slot at least")
        _at_least("max_len", self.max_len, 3, "room for a prompt token, a new token and a round")
        if self.gamma is not None:
            _at_least("gamma", self.gamma, 0, "None takes the drafter's block size")
        for name in ("buckets", "prefill_buckets"):
            value = getattr(self, name)
            if value is not None and (not value or min(value) < 1):
                raise EngineConfigError(f"EngineConfig.{name} must be positive token counts, got {value!r}; "
                                        "or None for the defaults")
        try:
            get_policy("fixed" if self.policy == AUTO else self.policy, self.theta, self.cost)
        except ValueError as e:
            raise EngineConfigError(f"EngineConfig: {e}") from None
        if self.skip_drafting != AUTO and self.skip_drafting not in SKIP_RULES:
            raise EngineConfigError(f"EngineConfig.skip_drafting={self.skip_drafting!r}: use 'auto', None, "
                                    "'best_case', 'known' (True = 'known') or 'acceptance'")
        _at_least("own_costs_repeats", self.own_costs_repeats, 1, "one timed sweep of the buckets at least")
        if not (_is_int(self.probe_every) and _is_int(self.probe_max) and 1 <= self.probe_every <= self.probe_max):
            raise EngineConfigError(f"EngineConfig needs 1 <= probe_every <= probe_max, got {self.probe_every} and "
                                    f"{self.probe_max}")
        if self.kv_pages is not None:
            if len(self.kv_pages) != 2:
                raise EngineConfigError(f"EngineConfig.kv_pages must be (num_pages, page_size), got {self.kv_pages!r}")
            if min(self.kv_pages) < 1:
                raise EngineConfigError(f"EngineConfig.kv_pages needs num_pages >= 1 and page_size >= 1, got "
                                        f"{self.kv_pages!r}")
        if self.paged_attention not in PAGED_ATTENTION_IMPLS:
            raise EngineConfigError(f"EngineConfig.paged_attention {self.paged_attention!r} is not one of "
                                    f"{PAGED_ATTENTION_IMPLS}")
        if self.prefill_chunk is not None:
            _at_least("prefill_chunk", self.prefill_chunk, 1, "None prefills prompts whole")
        _at_least("prefill_rows", self.prefill_rows, 1, "at least one joining slot a round")
        _at_least("prefill_tokens", self.prefill_tokens, 1, "a prefill forwards one row at least")

    @property
    def skip_rule(self) -> str | None:
        """The skip rule the config names, by its one name: None, "best_case", "known" or "acceptance" ("auto":
        None here; the drafter kind decides, `scheduling`)."""
        return SKIP_RULES[None if self.skip_drafting == AUTO else self.skip_drafting]

    def scheduling(self, kind, drafter) -> tuple[str | Callable, str | None]:
        """(policy, skip rule by its one name: None, "best_case", "known" or "acceptance") for a drafter of
        `kind` (None: target-only): "auto" takes the kind's `default_scheduling`; an explicit
        policy with skip_drafting "auto" skips nothing."""
        if kind is None:
            return ("fixed" if self.policy == AUTO else self.policy), None
        policy, skip = self.policy, self.skip_drafting
        if policy == AUTO:
            policy, default_skip = kind.default_scheduling(drafter)
            skip = default_skip if skip == AUTO else skip
        rule = SKIP_RULES[None if skip == AUTO else skip]
        if rule == "acceptance" and policy != "fixed":
            raise EngineConfigError(f"EngineConfig.skip_drafting='acceptance' prices rounds of the fixed length, and "
                                    f"the policy is {policy!r}: use skip_drafting 'known' with a scheduler, or "
                                    "policy 'fixed'")
        return policy, rule

    def replace(self, **changes) -> EngineConfig:
        """A copy with `changes` (checked like a new config)."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise EngineConfigError(f"EngineConfig has no field(s) {unknown}; fields: {', '.join(sorted(known))}")
        return EngineConfig(**{**{f.name: getattr(self, f.name) for f in fields(self)}, **changes})


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _at_least(name: str, value, low: int, why: str) -> None:
    if not _is_int(value) or value < low:
        raise EngineConfigError(f"EngineConfig.{name} must be an integer >= {low} ({why}), got {value!r}")
