"""TPU presets: every sharded dimension divides on the intended mesh, the step traces at
full shape on abstract arrays, and the per-device estimate fits a v5p chip (95 GiB)."""

import pytest

from dspark_jax.config import from_cli
from dspark_jax.train.plan import GIB, check_step_shapes, plan

V5P_HBM_GIB = 95


@pytest.mark.parametrize("preset", ["qwen3_4b_dspark", "qwen3_8b_dspark", "qwen3_14b_dspark",
                                    "qwen3_8b_dflash", "qwen3_8b_eagle3", "qwen3_8b_mtp1"])
def test_preset_plans_on_its_mesh(preset):
    cfg = from_cli([preset])
    p = plan(cfg)
    assert not p["problems"], p["problems"]
    assert p["micro_batch_per_device"] == 1
    assert p["total"] / GIB < 0.8 * V5P_HBM_GIB
    state, metrics, _ = check_step_shapes(cfg)
    assert metrics["loss"].shape == ()
    # the shapes of the updated parameters equal the inputs'
    assert state.params["layers"]["q_proj"].shape[0] == cfg.drafter.num_layers if cfg.drafter.kind in ("dspark", "dflash") else True


def test_plan_reports_indivisible_dimension():
    cfg = from_cli(["qwen3_8b_dspark", "mesh.fsdp=7", "mesh.data=1"])
    p = plan(cfg)
    assert any("not divisible by mesh axes ('fsdp',)" in x for x in p["problems"])
