"""`bench round` (commands/bench/round.py over engine/round_price.py): every program of a round
compiled for a slice, beside its read-once price, HBM floor and collectives, every figure marked
predicted."""

import json

import pytest

from dspark_jax.commands.bench.round import main

pytest.importorskip("libtpu", reason="the TPU compiler ships in libtpu: pip install -e '.[aot]'")


def test_round_against_its_floors(tmp_path, capsys):
    out = tmp_path / "round.json"
    assert main(["micro", "--topology", "v6e-1", "--slots", "2", "--context", "64", "--top", "3",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "predicted (XLA:TPU cost model" in text and "HBM floor at the datasheet's 1638 GB/s" in text
    for name in ("target-only step", "draft", "skipped round", "where the draft's time goes"):
        assert name in text
    doc = json.loads(out.read_text())["slots"][0]
    assert doc["slots"] == 2 and doc["full_bucket"] == max(int(b) for b in doc["rounds"])
    for p in [doc["step"], doc["draft"], doc["skip"], *doc["rounds"].values()]:
        assert p["seconds"] > 0 and p["read_once_s"] > 0 and p["hbm_s"] == pytest.approx(p["bytes"] / 1638e9)
    full = doc["rounds"][str(doc["full_bucket"])]
    # the round reads at least what the step and the draft read
    assert full["bytes"] >= doc["step"]["bytes"] + doc["draft"]["bytes"]
    assert doc["summary"]["round_full / step"] == pytest.approx(full["seconds"] / doc["step"]["seconds"])


def test_unknown_slice_is_one_line(capsys):
    assert main(["micro", "--topology", "v9z-3"]) != 0
    err = capsys.readouterr().err
    assert "unknown TPU slice" in err and "Traceback" not in err
