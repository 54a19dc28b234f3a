"""Names shared by the configuration, the library and the commands, defined once and without JAX
so that every parser can list them as choices and `--help` answers at once: the drafter kinds
(the config schema's `drafter.kind`; drafter.registry.KINDS has one adapter per name, equal by
tests/test_cli_errors.py), the engine planner's verification-length policies and the programs it
can compile (engine/plan.py)."""

from __future__ import annotations

KIND_NAMES = ("dspark", "dflash", "eagle3", "mtp1")

ENGINE_POLICIES = ("fixed", "scheduled")
PLAN_PROGRAMS = ("round", "host_rounds", "prefill", "admit")
