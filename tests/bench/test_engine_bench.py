"""`python -m dspark_jax.bench engine --sections skip` runs on the tiny embedded target and reports
its figures (the timing itself is the benchmark's business, not the test's)."""

from __future__ import annotations

import json


def test_skip_section_reports_both_round_times(embedded_tiny_dir, tmp_path, capsys):
    from dspark_jax.bench.engine import main

    out = tmp_path / "engine.json"
    assert main(["--target", str(embedded_tiny_dir), "--sections", "skip", "--reps", "1", "--num-prompts", "4",
                 "--max-new-tokens", "8", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())["skip"]
    assert rec["slots"] == 4 and rec["rounds"] == 24
    assert rec["skipped_round_ms"] > 0 and rec["target_only_ms"] > 0
    assert abs(rec["ratio"] - rec["skipped_round_ms"] / rec["target_only_ms"]) < 1e-9
    assert "[skip] 4 slots decoding" in capsys.readouterr().out
