"""`bench vs-torch`: the baseline worker really runs the older commit's code; the whole command runs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_jax.commands.bench import vs_torch

REPO = Path(__file__).resolve().parents[2]
needs_git = pytest.mark.skipif(not (REPO / ".git").exists(), reason="not a git checkout")


@needs_git
def test_baseline_worker_imports_the_extracted_commit(tmp_path):
    tree = vs_torch.extract_ref("HEAD", tmp_path)
    assert (tree / "dspark_jax" / "__init__.py").exists() and (tree / "configs" / "bench_cpu.yaml").exists()
    base, ours = vs_torch.Worker("base", "probe", str(tree)), vs_torch.Worker("ours", "probe", str(REPO))
    try:
        assert Path(base.origin) == tree and Path(ours.origin) == REPO
    finally:
        base.close()
        ours.close()


@needs_git
def test_unknown_commit_is_named(tmp_path):
    with pytest.raises(SystemExit, match="cannot read commit 'no-such-ref'"):
        vs_torch.extract_ref("no-such-ref", tmp_path)


def test_command_times_every_region_beside_transformers(tmp_path):
    pytest.importorskip("torch", reason="torch not installed: the test extra installs it on Python 3.11 only")
    out = tmp_path / "t.json"
    proc = subprocess.run([sys.executable, "-m", "dspark_jax", "bench", "vs-torch", "--baseline-ref", "none",
                           "--rounds", "1", "--repeats", "1", "--json", str(out)], capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    times = json.loads(out.read_text())["times"]
    assert set(times) >= {"transformers|target forward", "ours|target forward", "ours|train step (online)",
                          "ours|draft round", "ours|verify 8 + rejection"}
    assert all(len(v) == 1 and v[0] > 0 for v in times.values())
    assert "ours / transformers" in proc.stdout and "target forward" in proc.stdout
