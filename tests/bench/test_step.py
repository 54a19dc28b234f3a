"""`bench step` (commands/bench/step.py over engine/step_price.py): the target-only step compiled
for a slice, beside its read-once price and its instruction breakdown, every figure marked
predicted; the compiler-chosen weight layouts compile too."""

import importlib.metadata
import json

import pytest

from dspark_jax.commands.bench.step import main

pytest.importorskip("libtpu", reason="the TPU compiler ships in libtpu: pip install -e '.[aot]'")


@pytest.mark.parametrize("layouts", ["fixed", "auto"])
def test_step_against_its_floor(layouts, tmp_path, capsys):
    out = tmp_path / "step.json"
    assert main(["micro", "--topology", "v6e-1", "--slots", "8", "--context", "64", "--top", "5",
                 "--weight-layouts", layouts, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "predicted (XLA:TPU cost model)" in text and f"weight layouts {layouts}" in text
    doc = json.loads(out.read_text())
    # the compiler that priced the step is named beside its figures
    assert doc["libtpu"] == importlib.metadata.version("libtpu") and f"libtpu {doc['libtpu']}" in text
    step = doc["steps"][0]
    assert step["slots"] == 8 and step["step_s"] > 0 and len(step["breakdown"]) == 5
    floor = step["read_once"]
    assert floor["total"] == pytest.approx(floor["weights"] + floor["kv"])
    assert {"q/k/v", "gate/up", "o_proj", "down_proj", "lm_head"} == set(floor["products"])
    assert step["ratio"] == pytest.approx(step["step_s"] / floor["total"])
    # the breakdown lists the step's own instructions: its groups cannot cost more than the step
    # with every branch of its conditionals counted once more
    assert 0 < sum(s for s, _, _ in step["breakdown"]) <= 2 * step["step_s"]


def test_unknown_slice_is_one_line(capsys):
    assert main(["micro", "--topology", "v9z-3"]) != 0
    err = capsys.readouterr().err
    assert "unknown TPU slice" in err and "Traceback" not in err
