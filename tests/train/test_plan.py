"""TPU presets: every sharded dimension divides on the intended mesh, the step traces at
full shape on abstract arrays, and the per-device estimate fits a v5p chip (95 GiB)."""

import json

import pytest

from dspark_jax.config import from_cli
from dspark_jax.train.plan import GIB, check_step_shapes, plan

V5P_HBM_GIB = 95


@pytest.mark.parametrize("preset", ["qwen3_4b_dspark", "qwen3_8b_dspark", "qwen3_14b_dspark",
                                    "qwen3_8b_dflash", "qwen3_8b_eagle3", "qwen3_8b_mtp1",
                                    "qwen3_4b_dspark_v5e", "qwen3_4b_dspark_v6e", "qwen3_8b_dspark_v5e",
                                    "qwen3_8b_dspark_v6e"])
def test_preset_plans_on_its_mesh(preset):
    cfg = from_cli([preset])
    p = plan(cfg)
    assert not p["problems"], p["problems"]
    assert p["micro_batch_per_device"] == 1
    assert p["total"] / GIB < 0.8 * V5P_HBM_GIB
    state, metrics, _ = check_step_shapes(cfg)
    assert metrics["loss"].shape == ()
    # the shapes of the updated parameters equal the inputs'
    assert (state.params["layers"]["q_proj"].shape[0] == cfg.drafter.num_layers
            if cfg.drafter.kind in ("dspark", "dflash") else True)


def test_plan_reports_indivisible_dimension():
    cfg = from_cli(["qwen3_8b_dspark", "mesh.fsdp=7", "mesh.data=1"])
    p = plan(cfg)
    assert any("not divisible by mesh axes ('fsdp',)" in x for x in p["problems"])


COMPILED = r"""
import json, re, jax
import dspark_jax.train.compiled as C
from dspark_jax.config import from_cli
import dspark_jax.train.step as st

texts = []
_memory = C._memory
def keep_hlo(compiled):
    texts.append(compiled.as_text())
    return _memory(compiled)
C._memory = keep_hlo
permutes = lambda: len(re.findall(r"collective-permute(-start)?\(", texts[-1]))
base = ["micro", "mesh.data=1", "mesh.fsdp=8", "data.seq_len=256", "data.num_anchors=16", "train.anchor_chunk=16"]
one = C.compile_steps(from_cli(base + ["train.batch_size=8", "train.grad_accum=1"]))
two = C.compile_steps(from_cli(base + ["train.batch_size=16", "train.grad_accum=2"]), steps=("train",))
two_permutes = permutes()
two.update(C.compile_steps(from_cli(base + ["train.batch_size=16", "train.grad_accum=2"]), steps=("eval",)))
# the broken variant: contiguous micro-batches (each on half of the chips)
st.split_micro = lambda batch, n, sharding=None: jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]),
                                                              batch)
contiguous = C.compile_steps(from_cli(base + ["train.batch_size=16", "train.grad_accum=2"]), steps=("train",))
contiguous_permutes = permutes()
deep = base + ["drafter.num_layers=4", "train.batch_size=8"]
stored = C.compile_steps(from_cli(deep), steps=("train",))
remat = C.compile_steps(from_cli(deep + ["train.remat=drafter_layers"]), steps=("train",))
print(json.dumps({"one": one, "two": two, "contiguous": contiguous, "peak": C.peak(two["train"]),
                  "stored": stored["train"]["temporaries"], "remat": remat["train"]["temporaries"],
                  "two_permutes": two_permutes, "contiguous_permutes": contiguous_permutes}))
"""


def test_compiled_memory_of_gradient_accumulation_matches_the_micro_batch():
    """Compiled on 8 fake devices (XLA memory_analysis per chip): batch 16 in 2 strided micro-batches
    needs at most 1.2x the temporaries of batch 8 in one, and moves no rows between chips (no
    collective-permute in the program); contiguous micro-batches (each on half of the chips) must
    be moved onto all chips every micro-step, which the compiled program shows."""
    from tests.conftest import run_multidevice

    out = json.loads(run_multidevice(COMPILED).strip().splitlines()[-1])
    one, two = out["one"], out["two"]
    for step in ("train", "eval"):
        assert two[step]["temporaries"] <= 1.2 * one[step]["temporaries"], (step, one[step], two[step])
        assert two[step]["arguments"] > 0 and two[step]["temporaries"] > 0
    assert out["two_permutes"] == 0
    assert out["contiguous_permutes"] > 0
    assert out["peak"] >= two["train"]["arguments"]
    # 4 drafter layers recomputed in the backward: clearly fewer temporaries than storing all four
    assert out["remat"] < 0.8 * out["stored"], (out["remat"], out["stored"])


SLICES = {"qwen3_4b_dspark": "v5p-32", "qwen3_8b_dspark": "v5p-64", "qwen3_14b_dspark": "v5p-128",
          "qwen3_8b_eagle3": "v5p-64",  # inherited with the mesh
          "qwen3_4b_dspark_v5e": "v5e-32", "qwen3_8b_dspark_v5e": "v5e-32",
          "qwen3_4b_dspark_v6e": "v6e-32", "qwen3_8b_dspark_v6e": "v6e-32"}


@pytest.mark.parametrize("preset", sorted(SLICES))
def test_presets_name_the_slice_their_mesh_fills(preset):
    """`plan --compile` compiles a preset for the slice it names: its mesh must use every device
    (v5e / v6e / v5p: one device per chip)."""
    from dspark_jax.parallel.slices import parse_slice

    m = from_cli([preset]).mesh
    assert m.slice == SLICES[preset]
    assert parse_slice(m.slice).chips == m.data * m.fsdp * m.tensor


def test_mesh_slice_is_checked_when_the_config_loads():
    from dspark_jax.config import ConfigError

    assert from_cli(["micro"]).mesh.slice is None
    assert from_cli(["micro", "mesh.slice=v6e-8"]).mesh.slice == "v6e-8"
    with pytest.raises(ConfigError, match="unknown TPU slice 'v6e-7'.*v6e-8"):
        from_cli(["micro", "mesh.slice=v6e-7"])


def test_plan_help_names_the_topology_flag(capsys):
    from dspark_jax.commands.train_plan import main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--topology SLICE" in out and "mesh.slice" in out and "--hbm-gib" in out
