"""`python -m dspark_jax bench accelerator`: the first-contact run end to end on this CPU at the tiny
shapes (every section, sane figures, the JSON), the budget's cut-off line, a failed stage reported
while the run goes on, the GPU kernel's comparison with the reference (in Pallas interpret mode
here) catching a kernel that reads one key too few, and one-line errors for bad input."""

from __future__ import annotations

import contextlib
import io
import json
import math

import jax
import jax.numpy as jnp
import pytest

from dspark_jax.bench import accelerator as acc
from dspark_jax.commands.bench.accelerator import main
from dspark_jax.testing.tiny import tiny_config

TINY = ["tiny", "--slots", "1", "--context", "64", "--gamma", "3", "--buckets", "4", "--repeats", "2",
        "--copy-mib", "4", "--matmul-n", "64", "--dtype", "float32"]


def _finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _run(argv) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(argv)
    return status, out.getvalue()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("accel") / "accel.json"
    status, text = _run(TINY + ["--json", str(path)])
    return status, text, json.loads(path.read_text())


def _section(text: str, title: str) -> list[str]:
    """The lines of the section that starts with `== title`, up to the next section."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"== {title}"))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("== ")), len(lines))
    return [ln for ln in lines[start + 1:end] if ln.strip()]


def test_every_section_with_sane_figures(tiny_run):
    status, text, doc = tiny_run
    assert status == 0
    env = _section(text, "environment")
    assert env[0].startswith("backend        cpu: 1 x ")
    assert f"jax {jax.__version__}, jaxlib {doc['environment']['jaxlib']}" in env[1]
    assert doc["environment"]["backend"] == "cpu" and doc["environment"]["jax"] == jax.__version__
    assert any(ln.startswith("model          tiny: random weights, float32") for ln in env)

    rates = doc["rates"]
    assert _finite_positive(rates["bandwidth"]) and _finite_positive(rates["flop_rate"])
    assert rates["matmul_dtype"] == "float32" and rates["matmul_n"] == 64 and rates["copy_bytes"] == 4 * 2 ** 20
    assert any("GB/s read + written" in ln for ln in _section(text, "device rates"))

    kernel = _section(text, "cache attention")
    assert kernel[0] == "no GPU: the GPU kernel skipped; the reference timed alone"
    assert kernel[-1].split()[:3] == ["1", str(4 * 2), str(64 - 3 - 2)]  # slots, queries x heads, keys
    assert kernel[-1].endswith("no GPU: skipped")
    (k,) = doc["kernel"]
    assert k["kernel"] is None and _finite_positive(k["reference"]["ms"]) and _finite_positive(k["reference"]["ratio"])

    # the target-only step, the round at its bucket, the draft: each timed against its roofline
    table = [ln.split() for ln in _section(text, "decode programs")[2:]]
    assert [(r[0], r[1], r[2]) for r in table] == [("target_step", "1", "1"), ("round", "1", "4"), ("draft", "1", "-")]
    assert [r["program"] for r in doc["programs"]] == ["target_step", "round", "draft"]
    for row, line in zip(doc["programs"], table):
        assert all(_finite_positive(row[key]) for key in ("ms", "bytes", "flops", "roofline_ms", "ratio"))
        assert row["ratio"] == pytest.approx(row["ms"] / row["roofline_ms"])
        assert float(line[-1]) == pytest.approx(row["ratio"], rel=1e-2)
    assert doc["programs"][1]["tokens"] == 4 and doc["programs"][2]["tokens"] == 3  # 1 x (1 + 3); the block of 3

    # every compiled program's memory and compile seconds
    compiled = {e["program"]: e for e in doc["compiled"]}
    assert set(compiled) == {"attention_reference", "target_step", "round", "draft"}
    for e in compiled.values():
        m = e["memory"]
        assert m["arguments"] > 0 and m["total"] == m["arguments"] + m["outputs"] + m["temporaries"] - m["aliased"]
        assert _finite_positive(e["compile_s"])
    listed = [ln.split()[0] for ln in _section(text, "compiled programs")[1:]]
    assert sorted(listed) == sorted(compiled)

    stages = {s["stage"]: s for s in doc["stages"]}
    assert list(stages) == ["environment", "models", "rates", "kernel", "target_step@1", "engine@1"]
    assert all(s["status"] == "done" for s in stages.values())
    assert _finite_positive(stages["engine@1"]["compile_s"]) and stages["engine@1"]["compile_s"] <= \
        stages["engine@1"]["seconds"]
    assert [ln.split()[0] for ln in _section(text, "stages")[1:len(stages) + 1]] == list(stages)
    # the models' arrays alone stay alive: each stage's engines, states and buffers are freed
    models = stages["models"]["live_bytes"]
    assert models > 0 and all(stages[name]["live_bytes"] == models for name in list(stages)[2:])
    assert doc["skipped"] == [] and "0 stage(s) failed, 0 item(s) skipped" in text
    assert doc["command"].startswith("python -m dspark_jax bench accelerator tiny --slots 1")


def test_a_spent_budget_skips_the_rest_with_a_line(tmp_path):
    path = tmp_path / "a.json"
    status, text = _run(["tiny", "--budget", "0.001", "--json", str(path)])
    assert status == 0
    assert text.splitlines()[1] == "== environment"  # the environment is always reported
    assert "budget: 0.001 s spent (" in text and "s elapsed): skipped stage models" in text
    doc = json.loads(path.read_text())
    assert doc["stages"][0] == {**doc["stages"][0], "stage": "environment", "status": "done"}
    later = ["models", "rates", "kernel", "target_step@1", "target_step@64", "engine@1", "engine@64"]
    assert [(s["stage"], s["status"]) for s in doc["stages"][1:]] == [(name, "skipped") for name in later]
    assert doc["skipped"] == [f"stage {name}" for name in later]
    assert doc["programs"] == [] and doc["compiled"] == []


def test_a_failed_stage_is_reported_and_the_run_goes_on(monkeypatch, tmp_path):
    def no_memory(self):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory while trying to allocate 172.34GiB\nmore")

    monkeypatch.setattr(acc._Run, "load_models", no_memory)
    path = tmp_path / "f.json"
    status, text = _run(["tiny", "--slots", "1", "--copy-mib", "1", "--matmul-n", "16", "--json", str(path)])
    assert status == 1
    assert "FAILED models: RuntimeError: RESOURCE_EXHAUSTED: out of memory while trying to allocate 172.34GiB" in text
    assert "skipped kernel: no models" in text and "skipped engine@1: no models" in text
    doc = json.loads(path.read_text())
    status_of = {s["stage"]: s["status"] for s in doc["stages"]}
    assert status_of["models"] == "failed" and status_of["rates"] == "done"  # the stage after it still ran
    assert _finite_positive(doc["rates"]["bandwidth"])


@pytest.fixture(scope="module")
def kernel_case():
    cfg = tiny_config()  # head dim 16: the GPU kernel takes it
    return dict(cfg=cfg, dtype=jnp.float32, slots=2, context=64, tokens=4, fill=40, repeats=1)


def test_kernel_equals_the_reference_in_interpret_mode(kernel_case):
    k = acc.kernel_against_reference(**kernel_case, gpu=True, interpret=True)
    assert k["equal"] is True and k["max_diff"] < 1e-4 and k["kernel_name"] == "triton"
    assert _finite_positive(k["kernel"]["best_s"]) and k["kernel"]["memory"]["arguments"] > 0
    assert k["shape"] == {"slots": 2, "queries": 4, "heads": 2, "kv_heads": 1, "head_dim": 16, "context": 64,
                          "keys": 40, "dtype": "float32"}


def test_a_kernel_reading_one_key_too_few_is_not_equal(kernel_case, monkeypatch):
    from dspark_jax.target import paged_kernel

    right = paged_kernel.dense_attention_lse

    def short(q, k, v, kv_len, q_start, **kw):
        return right(q, k, v, kv_len - 1, q_start, **kw)

    monkeypatch.setattr(acc, "dense_attention_lse", short)
    k = acc.kernel_against_reference(**kernel_case, gpu=True, interpret=True)
    assert k["equal"] is False and k["max_diff"] > k["tolerance"]


@pytest.mark.parametrize("heads,kv_heads,head_dim,dtype,call", [
    (2, 1, 16, jnp.float32, "__gpu$xla.gpu.triton"),  # the tiny shapes: Triton
    (32, 8, 128, jnp.bfloat16, "mosaic_gpu_v2"),  # Qwen3-8B's in bf16 on an H100: Mosaic GPU
], ids=["tiny-float32-triton", "qwen3-bf16-mosaic"])
def test_the_timed_kernel_lowers_for_an_h100_as_one_kernel_call(heads, kv_heads, head_dim, dtype, call):
    """What the GPU branch times, lowered for CUDA on this CPU host for an abstract H100: one call
    of the kernel target/gpu_kernel.py chooses for the shape, reading the cache in place."""
    from dspark_jax.target import gpu_kernel

    r, t, s = 2, 8, 256
    q = jax.ShapeDtypeStruct((r, t, heads, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((1, r, kv_heads, s, head_dim), dtype)
    kv_len = jax.ShapeDtypeStruct((r,), jnp.int32)
    with gpu_kernel.abstract_gpu():
        assert gpu_kernel.choose_gpu_kernel(dtype, head_dim, s, dense=True) == \
            ("mosaic" if call.startswith("mosaic") else "triton")
        text = jax.jit(acc.gpu_kernel_call).trace(q, kv, kv, kv_len).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(call) == 1 and "gather" not in text


@pytest.mark.parametrize("argv,msg", [
    (["tiny", "--slots", "0"], "--slots: an engine needs at least 1 slot"),
    (["tiny", "--budget", "0"], "--budget 0.0: give a positive number of seconds"),
    (["tiny", "--fill", "1.5"], "--fill 1.5: give a share in (0, 1]"),
])
def test_bad_input_is_one_line(argv, msg, capsys):
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == f"error: {msg}"
