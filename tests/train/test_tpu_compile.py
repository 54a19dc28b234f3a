"""The real train and eval steps compiled by the TPU compiler for a 4-chip v5e slice, no TPU
present (parallel/topology.py): a reduced Qwen3-8B (its head counts and head_dim, two layers, a
narrow hidden / MLP / vocabulary, 1024-token sequences) on the v5e presets' fsdp x tensor mesh.
The target's attention is the splash kernel, chosen because the program is compiled for TPU
(not because this host is one), and the per-chip memory fits the chip. Also the plan command's
answers: the fit line, and bad input (unknown slice, wrong mesh size, no libtpu, too little HBM)."""

import dataclasses

import pytest

from dspark_jax.commands.train_plan import main as plan_command
from dspark_jax.config import from_cli
from dspark_jax.parallel.tpu_cost import program_cost
from dspark_jax.train import compiled as C
from dspark_jax.train import plan as train_plan

pytest.importorskip("libtpu", reason="the TPU compiler ships in libtpu: pip install -e '.[aot]'")

V5E_HBM = 16 * 2**30
# Qwen3-8B's attention (32 q heads, 8 kv heads, head_dim 128), the rest small enough to compile
# in about two minutes on two cores; micro-batch: one sequence per (data x fsdp) shard
REDUCED = ["qwen3_8b_dspark_v5e", "mesh.slice=v5e-4", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2",
           "target.model.num_layers=2", "target.model.hidden_size=512", "target.model.intermediate_size=1024",
           "target.model.vocab_size=4096", "drafter.num_layers=1", "drafter.target_layer_ids=[0]",
           "drafter.num_target_features=1", "drafter.mask_token_id=4095", "drafter.markov_rank=64",
           "data.seq_len=1024", "data.num_anchors=64", "train.batch_size=2", "train.grad_accum=1"]


@pytest.fixture(scope="module")
def programs():
    cfg = from_cli(REDUCED)
    assert cfg.target.attention == "auto" and cfg.target.model.num_heads == 32
    slc, mesh = train_plan.topology_mesh(cfg, cfg.mesh.slice)
    return slc, mesh, C.compile_programs(cfg, mesh=mesh)


def test_train_and_eval_steps_compile_for_tpu_with_splash(programs):
    slc, mesh, progs = programs
    assert slc.name == "v5e-4" and mesh.devices.size == 4 and dict(mesh.shape) == {"data": 1, "fsdp": 2, "tensor": 2}
    assert train_plan.device_hbm_gib(slc, mesh.devices.size) == 16
    assert set(progs) == {"train", "eval"}
    for step, (compiled, seconds) in progs.items():
        text = compiled.as_text()
        # the frozen target's attention is the Mosaic splash kernel, not the dense XLA path
        assert "tpu_custom_call" in text and "splash" in text, step
        mem = C._memory(compiled)
        assert mem["arguments"] > 0 and mem["temporaries"] > 0 and mem["generated_code"] > 0, (step, mem)
        assert 0 < C.peak(mem) < V5E_HBM, (step, mem)
        assert seconds > 0
    # the train step donates its state: the updated state is written over it
    assert C._memory(progs["train"][0])["aliased"] > 0
    # the compiler prices the step with the target's two layers scanned as they run
    cost = program_cost(progs["train"][0], mesh.devices.flat[0])
    assert cost.seconds > 0 and any(n == 2 for _, n in cost.loops) and not cost.unknown_loops


def _memory(progs, device):
    """What `compile_steps` returns for these programs."""
    return {step: {**C._memory(c), "compile_seconds": s, "kernels": c.as_text().count("tpu_custom_call"),
                   "predicted": dataclasses.asdict(program_cost(c, device))}
            for step, (c, s) in progs.items()}


def test_plan_prints_the_tpu_figures_and_the_fit(programs, capsys, monkeypatch):
    """The preset's slice (mesh.slice) is compiled for without --topology; the compiled figures
    are the fixture's (the command's own compile is the same call)."""
    _, mesh, progs = programs
    seen = {}
    mem = _memory(progs, mesh.devices.flat[0])

    def fake_compile(cfg, steps=("train", "eval"), mesh=None):
        seen["mesh"] = mesh
        return mem

    monkeypatch.setattr(C, "compile_steps", fake_compile)
    code = plan_command([*REDUCED, "--compile"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert seen["mesh"].devices.flat[0].platform == "tpu" and seen["mesh"].devices.size == 4
    assert "v5e-4, 4 devices, XLA:TPU" in out.out and "16 GiB HBM: margin" in out.out and "compiled in" in out.out
    assert "Mosaic kernel call(s)" in out.out
    # the compiler's time of the step, as tokens/s and hours: batch 2 x 1024 tokens per step
    t = train_plan.predicted_time(from_cli(REDUCED), mem["train"], train_plan.topology_mesh(
        from_cli(REDUCED), "v5e-4")[0], 4)
    assert t["tokens_per_s"] == pytest.approx(2 * 1024 / mem["train"]["predicted"]["seconds"])
    assert 0 < t["utilisation"] < 1 and t["hours"] == pytest.approx(1000 * t["step_s"] / 3600)
    assert t["chip_hours"] == pytest.approx(4 * t["hours"])
    assert "predicted train step on v5e-4 (XLA:TPU cost model, not measured)" in out.out
    assert f"{t['tokens_per_s']:,.0f} tokens/s" in out.out and "per 1000 steps" in out.out

    code = plan_command([*REDUCED, "--compile", "--hbm-gib", "0.01"])
    out = capsys.readouterr()
    assert code == 1
    lines = out.err.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("error: the ") for line in lines), out.err
    assert "train step needs" in out.err and "eval step needs" in out.err
    assert "more than the 0.01 GiB of HBM of a v5e-4 device" in lines[0]


def _main(capsys, *argv):
    code = plan_command([*REDUCED, *argv])
    return code, capsys.readouterr()


def test_plan_refuses_unknown_slice(capsys):
    code, out = _main(capsys, "--topology", "v6e-3")
    assert code == 2 and out.err.count("\n") == 1 and out.err.startswith("error: ")
    assert "unknown TPU slice 'v6e-3'" in out.err and "v6e-8" in out.err


def test_plan_refuses_mesh_of_wrong_size(capsys):
    code, out = _main(capsys, "--topology", "v6e-8")
    assert code == 2 and out.err.count("\n") == 1
    assert "= 4 devices, but slice v6e-8 has 8" in out.err


def test_plan_without_libtpu_names_the_extra(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real(name, *a))
    code, out = _main(capsys, "--compile")
    assert code == 2 and out.err.count("\n") == 1
    assert "needs libtpu" in out.err and ".[aot]" in out.err
    assert "mesh.slice=null" in out.err  # the preset's slice: how to compile on fake CPU devices instead
