"""`python -m dspark_jax bench roofline`: the bytes and FLOPs each decode program must at least
read and do, against a hand count on the micro preset (whole and one chip's on a 2 x 2 mesh); the
measured command end to end on the tiny shapes; the TPU-predicted table marked as predicted; one-
line errors for bad input."""

from __future__ import annotations

import json

import pytest

from dspark_jax.bench import roofline_model as rm
from dspark_jax.commands.bench.roofline import main

# micro: V 512, H 64, I 192, 2 layers, 4 heads, 2 KV heads, head dim 16, tied, Qwen3 (q/k norms);
# drafter: 1 layer, gamma 4, one feature layer, Markov rank 16, confidence head; float32
LAYER_PRODUCTS = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 192  # q, o; k, v; gate, up, down = 49152
LAYER_NORMS = 64 + 64 + 16 + 16  # input, post, q, k
LM_HEAD = 64 * 512
TARGET_BYTES = 4 * (2 * (LAYER_PRODUCTS + LAYER_NORMS) + 64 + LM_HEAD)  # the embedding is looked up, not read
# the draft: its layer, final norm, Markov W2 [16, 512], confidence kernel [80, 1] and bias, the LM head
DRAFT_PRODUCTS = LAYER_PRODUCTS + 16 * 512 + 80 + LM_HEAD
DRAFT_ELEMS = DRAFT_PRODUCTS + LAYER_NORMS + 64 + 1
# the context update: fc [64, 64], hidden norm, the layer's k / v projections and k norm
UPDATE_PRODUCTS = 64 * 64 + 2 * 64 * 32
UPDATE_ELEMS = UPDATE_PRODUCTS + 64 + 16
SHARED = 2 * 64 * 32 + 16  # k_proj, v_proj, k_norm: read once by a round that uses them twice
KV, DKV = 2 * 2 * 2 * 16 * 4, 1 * 2 * 2 * 16 * 4  # per row per token: layers x (K, V) x KV heads x D x 4 B
ROW, DROW = 64 * 4, 64 * 4 + 16 * 4  # looked-up rows per token: target embed; drafter embed + Markov W1
ATTN, DATTN = 4 * 4 * 16 * 2, 4 * 4 * 16 * 1  # FLOPs per (query, key) pair: 4 x heads x D x layers


@pytest.fixture(scope="module")
def micro_shapes():
    from dspark_jax.bench.roofline_predict import _shapes
    from dspark_jax.config import from_cli
    from dspark_jax.engine.config import EngineConfig
    from dspark_jax.engine.plan import abstract_engine, plan_mesh

    cfg = from_cli(["micro"])
    one = abstract_engine(cfg, plan_mesh((1, 1, 1)), EngineConfig(policy="fixed", num_slots=2, max_len=64))
    return _shapes(one), cfg


def test_round_reads_every_weight_once_and_the_filled_kv(micro_shapes):
    m, _ = micro_shapes
    k, g, fill, G = 2, 4, 50, 4
    fp = rm.round_footprint(m, k, g, fill, "round@10")
    n = k * (1 + g)
    weights = TARGET_BYTES + 4 * (DRAFT_ELEMS + UPDATE_ELEMS - SHARED)
    assert fp.parts == {"weights": weights, "kv": k * fill * (KV + DKV), "rows": n * ROW + k * G * DROW}
    assert fp.bytes == weights + k * fill * (KV + DKV) + n * ROW + k * G * DROW
    flops = (2 * n * (2 * LAYER_PRODUCTS + LM_HEAD) + 2 * k * G * DRAFT_PRODUCTS + 2 * n * UPDATE_PRODUCTS
             + ATTN * k * ((g + 1) * fill + (g + 1) * (g + 2) / 2) + DATTN * k * G * (fill + G))
    assert fp.flops == flops and fp.tokens == n
    assert (fp.chip_bytes, fp.chip_flops) == (fp.bytes, fp.flops)  # one device


def test_target_step_draft_and_prefill(micro_shapes):
    m, _ = micro_shapes
    step = rm.target_step(m, 2, 30)
    assert step.bytes == TARGET_BYTES + 2 * 30 * KV + 2 * ROW
    assert step.flops == 2 * 2 * (2 * LAYER_PRODUCTS + LM_HEAD) + ATTN * 2 * 31
    draft = rm.draft_footprint(m, 2, 30)
    assert draft.bytes == 4 * DRAFT_ELEMS + 2 * 30 * DKV + 2 * 4 * DROW
    assert draft.flops == 2 * 8 * DRAFT_PRODUCTS + DATTN * 8 * 34
    pre = rm.prefill_footprint(m, 2, 17, "prefill@32")  # 16 tokens a row forwarded, no LM head, no KV read
    assert pre.tokens == 32
    assert pre.bytes == TARGET_BYTES - 4 * LM_HEAD + 4 * UPDATE_ELEMS + 32 * ROW
    assert pre.flops == 2 * 32 * (2 * LAYER_PRODUCTS + UPDATE_PRODUCTS) + ATTN * 2 * 16 * 17 / 2


def test_one_chip_of_a_two_by_two_mesh(micro_shapes):
    """data 2 x tensor 2: a chip reads half of each split weight (norms whole) and a quarter of the
    KV, and does half the tokens through its half of the products."""
    pytest.importorskip("libtpu", reason="the slice's devices come from libtpu")
    from dspark_jax.bench.roofline_predict import _shapes
    from dspark_jax.engine.config import EngineConfig
    from dspark_jax.engine.plan import abstract_engine, plan_mesh

    _, cfg = micro_shapes
    m = _shapes(abstract_engine(cfg, plan_mesh((2, 1, 2), "v6e-4"), EngineConfig(policy="fixed",
                                                                                 num_slots=2, max_len=64)))
    assert m.kv == (KV, KV / 4) and m.data_frac == 0.5
    step = rm.target_step(m, 2, 30)
    assert step.chip_bytes == (4 * (2 * (LAYER_PRODUCTS // 2 + LAYER_NORMS) + 64 + LM_HEAD // 2)
                               + 2 * 30 * KV / 4 + 2 * ROW / 2)
    assert step.chip_flops == 2 * 2 * 0.5 * (LAYER_PRODUCTS + LM_HEAD // 2) + ATTN * 2 * 31 / 4


def test_bf16_drafter_counted_in_its_compute_dtype(micro_shapes):
    """Served in bfloat16, the drafter's frozen LM head (stored float32 in the abstract engine) is
    counted as the engine holds it: cast once to bfloat16 when the Engine is built."""
    import dataclasses

    from dspark_jax.bench.roofline_predict import _shapes
    from dspark_jax.engine.config import EngineConfig
    from dspark_jax.engine.plan import abstract_engine, plan_mesh

    _, cfg = micro_shapes
    cfg = dataclasses.replace(cfg, target=dataclasses.replace(cfg.target, dtype="bfloat16"))
    m = _shapes(abstract_engine(cfg, plan_mesh((1, 1, 1)), EngineConfig(policy="fixed", num_slots=2, max_len=64),
                                drafter_in_target_dtype=True))
    assert m.drafter["lm_head"].nbytes == 2 * LM_HEAD and m.drafter["embed"].row_bytes == 2 * 64
    assert m.target["lm_head"].nbytes == 2 * LM_HEAD and m.kv == (KV / 2, KV / 2)


def test_roofline_is_the_longer_bound():
    assert rm.roofline(2e9, 1e9, 1e9, 1e12) == (2.0, "memory")
    assert rm.roofline(1e6, 4e12, 1e9, 1e12) == (4.0, "compute")


def _table_lines(out: str) -> list[str]:
    """The rows of the (first) table: between its rule and the blank line after it."""
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("-----")) + 1
    return lines[start:lines.index("", start)]


def test_measured_command_on_the_tiny_shapes(tmp_path, capsys):
    out = tmp_path / "roofline.json"
    assert main(["--target", "tiny", "--slots", "1", "--context", "64", "--gamma", "3", "--repeats", "2",
                 "--copy-mib", "16", "--matmul-n", "128", "--dtype", "float32", "--json", str(out)]) == 0
    text = capsys.readouterr()
    programs = ["target_step@1", "round@1", "round@2", "round@4", "draft", "prefill@64"]
    table = [ln.split() for ln in _table_lines(text.out)]
    assert [row[0] for row in table] == programs
    assert all(float(row[-1]) > 0 for row in table)  # measured / roofline
    for name in programs:
        assert f"[roofline] {name}: best " in text.err
    d = json.loads(out.read_text())
    assert d["command"].startswith("python -m dspark_jax bench roofline --target tiny")
    assert {"jax", "backend", "device_kind", "rates", "runs", "source"} <= set(d)
    assert d["source"].startswith("measured on cpu")
    r = d["rates"]
    assert r["copy_traffic"] == pytest.approx(2 * r["copy_rate"]) and r["bandwidth"] >= r["copy_traffic"]
    assert r["flop_rate"] > 0 and r["matmul_dtype"] == "float32"
    run = d["runs"][0]
    assert run["fill"] == 64 - 3 - 2 and run["buckets"] == [1, 2, 4]
    assert [row["program"] for row in run["rows"]] == programs
    for row in run["rows"]:
        assert row["ms"] > 0 and row["bytes"] > 0 and row["flops"] > 0 and row["roofline_ms"] > 0
        assert row["ratio"] == pytest.approx(row["ms"] / row["roofline_ms"])
    assert set(run["memory"]) == {"target_step", "round", "draft", "prefill"}
    assert all(m["arguments"] > 0 for m in run["memory"].values())


def test_topology_table_is_marked_predicted(tmp_path, capsys):
    pytest.importorskip("libtpu", reason="the TPU compiler ships in libtpu: pip install -e '.[aot]'")
    out = tmp_path / "predicted.json"
    assert main(["micro", "--topology", "v5e-1", "--slots", "1", "--context", "64", "--gamma", "1",
                 "--json", str(out)]) == 0
    rows = _table_lines(capsys.readouterr().out)
    assert [ln.split()[0] for ln in rows] == ["target_step@1", "round@1", "round@2", "draft", "prefill@64"]
    assert all(ln.endswith("predicted (XLA:TPU cost model)") for ln in rows)
    d = json.loads(out.read_text())
    assert d["source"].startswith("predicted (XLA:TPU cost model), v5e-1")
    run = d["runs"][0]
    assert all(r["source"] == "predicted (XLA:TPU cost model)" and r["ratio"] > 0 for r in run["rows"])
    assert run["rates"]["bandwidth"] > 1e11 and run["rows"][0]["cost"]["cycles"] > 0


@pytest.mark.parametrize("argv,message", [
    (["no_such_preset", "--slots", "1"], "config file 'no_such_preset' not found"),
    (["micro", "--slots", "0"], "--slots 0: an engine needs at least 1 slot"),
    (["micro", "--target", "tiny"], "give a preset"),
    (["--target", "tiny", "--topology", "v5e-1"], "give a preset"),
    (["micro", "--topology", "v9z-3"], "unknown TPU slice"),
])
def test_bad_input_is_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
