"""`python -m dspark_jax bench engine --sections skip` runs on the tiny embedded target and reports
its figures (the timing itself is the benchmark's business, not the test's)."""

from __future__ import annotations

import json


def test_skip_section_reports_both_round_times(embedded_tiny_dir, tmp_path, capsys):
    from dspark_jax.commands.bench.engine import main

    out = tmp_path / "engine.json"
    assert main(["--target", str(embedded_tiny_dir), "--sections", "skip", "--repeats", "1", "--num-prompts", "4",
                 "--max-new-tokens", "8", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())["skip"]
    assert rec["slots"] == 4 and rec["rounds"] == 24
    assert rec["skipped_round_ms"] > 0 and rec["target_only_ms"] > 0
    assert abs(rec["ratio"] - rec["skipped_round_ms"] / rec["target_only_ms"]) < 1e-9
    assert "[skip] 4 slots decoding" in capsys.readouterr().out


def test_speed_section_times_scheduled_dspark_on_a_table_for_its_batch(embedded_tiny_dir, tmp_path, capsys):
    """`--costs 1=TABLE`: batch 1 gets a scheduled row (alternating with the other two); a bad
    --costs names the R=TABLE form."""
    import jax
    import pytest

    from dspark_jax.commands.bench.engine import main

    table = tmp_path / "r1.json"
    table.write_text(json.dumps({"format": "dspark_cost_table/1", "backend": jax.default_backend(),
                                 "buckets": [1, 2, 4, 8], "t_verify": [1.0, 1.1, 1.3, 1.8], "t_draft": 0.6,
                                 "provenance": "a test table"}))
    out = tmp_path / "engine.json"
    assert main(["--target", str(embedded_tiny_dir), "--sections", "speed", "--repeats", "1", "--num-prompts", "8",
                 "--max-new-tokens", "6", "--temperature", "0", "--batch-sizes", "1", "--costs", f"1={table}",
                 "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    b1 = rec["speed_b1"]
    assert b1["scheduled_tok_s"] > 0 and b1["scheduled_tau"] >= 1.0 and not b1["scheduled_calibrated"]
    # one run: the ratio of its medians
    assert abs(b1["scheduled_speedup"] - b1["scheduled_tok_s"] / b1["ar_tok_s"]) < 1e-9
    assert "speed_b8" not in rec and rec["dtype"] == "float32"
    assert "[speed] batch 1, T 0: scheduled dspark" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--target", str(embedded_tiny_dir), "--sections", "speed", "--costs", str(table)])
    assert "give R=TABLE" in capsys.readouterr().err
