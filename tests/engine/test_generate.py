"""`python -m dspark_jax generate` end to end on a tiny saved target + tokenizer + drafter, and the Python API."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from dspark_jax.commands.generate import main, read_prompts
from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.engine import Engine, EngineConfig, measure_accepted_length
from dspark_jax.io.drafter_dir import save as save_drafter
from dspark_jax.io.hf import save_target
from dspark_jax.testing.tiny import tiny_config, tiny_drafter, tiny_target
from dspark_jax.text.tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    texts = ["What is 12 plus 7? The answer is 19.", "def add(a, b): return a + b", "hello world"] * 50
    tok = train_tokenizer(texts, vocab_size=300, save_path=root / "target")
    cfg = tiny_config(vocab_size=tok.vocab_size, hidden_size=32, num_layers=2)
    t = tiny_target(cfg, logit_scale=1.0)
    save_target(t, root / "target")
    d = tiny_drafter("dspark", t, gamma=3)
    save_drafter(d, root / "drafter")
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"turns": [q]}) for q in ["What is 2 plus 2?", "hello", "def f"]) + "\n")
    return root, t, d


def test_generate_cli_jsonl(dirs, capsys):
    root, _, _ = dirs
    rc = main(["--target", str(root / "target"), "--drafter", str(root / "drafter"), "--prompts",
               str(root / "prompts.jsonl"), "--max-new-tokens", "8", "--batch", "2", "--json",
               "--traces", str(root / "tr.jsonl")])
    out = capsys.readouterr()
    assert rc == 0, out.err
    recs = [json.loads(x) for x in out.out.splitlines()]
    assert len(recs) == 3 and all(r["new_tokens"] <= 8 and r["rounds"] >= 1 and r["tau"] >= 1 for r in recs)
    summary = json.loads(out.err.strip().splitlines()[-1])
    assert summary["mode"] == "dspark" and summary["requests"] == 3
    assert (root / "tr.jsonl").read_text().count("\n") == sum(r["rounds"] for r in recs)


def test_generate_npz_traces_record_kind_and_sampling(dirs, capsys):
    """`--traces F.npz` records the drafter kind and the sampling setting (calibration stores its
    STS fit under that setting; an unlabelled file was read as T = 1 before)."""
    from dspark_jax.calibration.traces import load_traces

    root, _, _ = dirs
    rc = main(["--target", str(root / "target"), "--drafter", str(root / "drafter"), "--prompts",
               str(root / "prompts.jsonl"), "--max-new-tokens", "8", "--batch", "2", "--json", "--temperature", "0",
               "--traces", str(root / "tr.npz")])
    out = capsys.readouterr()
    assert rc == 0, out.err
    recs = [json.loads(x) for x in out.out.splitlines()]
    ts = load_traces(root / "tr.npz")
    assert ts.key == "T0_k0_p1" and ts.meta["drafter_kind"] == "dspark" and ts.gamma == 3
    assert len(ts) == sum(r["rounds"] for r in recs)


def test_generate_cli_kv_pages(dirs, capsys):
    """`--kv-pages NUM,SIZE`: the dense run's completions (sampled, same seed) from a pool smaller
    than the dense caches; a pool too small for a request, or a malformed value, is one line."""
    root, _, _ = dirs
    base = ["--target", str(root / "target"), "--drafter", str(root / "drafter"), "--prompts",
            str(root / "prompts.jsonl"), "--max-new-tokens", "8", "--batch", "2", "--json", "--temperature", "1",
            "--policy", "fixed"]  # (scheduled, each layout's own cost table could pick other lengths)

    def completions(extra):
        rc = main(base + extra)
        out = capsys.readouterr()
        assert rc == 0, out.err
        return [json.loads(x)["completion"] for x in out.out.splitlines()]

    assert completions(["--kv-pages", "8,8"]) == completions([])
    assert main(base + ["--kv-pages", "1,4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "more than the whole pool of 1" in err and "--kv-pages" in err
    with pytest.raises(SystemExit):
        main(base + ["--kv-pages", "4x8"])
    assert "give NUM_PAGES,PAGE_SIZE" in capsys.readouterr().err


def test_generate_cli_stdin_target_only(dirs, capsys, monkeypatch):
    root, _, _ = dirs
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n\nWhat is 2 plus 2?\n"))
    rc = main(["--target", str(root / "target"), "--max-new-tokens", "5", "--temperature", "0.7", "--top-p", "0.9"])
    out = capsys.readouterr().out
    assert rc == 0 and out.count("=== request") == 2 and '"tau": 1.0' in out


def test_generate_cli_mode_needs_drafter(dirs, capsys):
    root, _, _ = dirs
    assert main(["--target", str(root / "target"), "--mode", "dspark", "--prompts", str(root / "prompts.jsonl")]) == 2
    assert "needs --drafter" in capsys.readouterr().err


def test_read_prompts_conversations(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps({"conversations": [{"role": "user", "content": "hi"}]}) + "\n")
    assert read_prompts(str(f)) == [[{"role": "user", "content": "hi"}]]


def test_measure_accepted_length(dirs):
    _, t, d = dirs
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 200, n).tolist() for n in (5, 9, 3)]
    tau = measure_accepted_length(t, d, prompts, max_new_tokens=6, num_slots=3)
    assert 1.0 <= tau <= 4.0
    # its one full bucket gives what an engine with the scheduler's buckets gives
    S = max(map(len, prompts)) + 6 + d.gamma + 2
    engine = Engine(t, d, EngineConfig(policy="fixed", num_slots=2, max_len=S))
    assert len(engine.buckets) > 1
    res = engine.generate(prompts, max_new_tokens=6, seed=0, sampling=SamplingParams(1.0, 0, 1.0))
    assert measure_accepted_length(t, d, prompts, max_new_tokens=6, num_slots=2) == res.tau


def test_generate_cli_scheduler_costs_and_sts(dirs, capsys):
    """--policy production with a cost table (its buckets become the engine's) and --calibrated
    STS temperatures; missing temperatures, a missing table and another backend's table fail
    with one message each (exit 2)."""
    from dspark_jax.calibration.calibrate import save_temperatures
    from dspark_jax.scheduler.costs import save_cost_file

    root, _, _ = dirs
    drafter = root / "drafter_sts"
    save_drafter(dirs[2], drafter)
    table = root / "costs.json"
    save_cost_file(table, [2, 4, 8], [1e-3, 1.1e-3, 3e-3], 2e-4, backend="cpu", device_kind="cpu", provenance="test")
    base = ["--target", str(root / "target"), "--drafter", str(drafter), "--prompts", str(root / "prompts.jsonl"),
            "--max-new-tokens", "6", "--batch", "2", "--json", "--temperature", "1.0"]
    assert main(base) == 0  # by default: the production scheduler on a table the engine measured itself
    summary = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert summary["policy"] == "production, skip rule known" and summary["cost_table"] == "own (measured)"
    assert main(base + ["--policy", "production", "--costs", str(table), "--calibrated"]) == 2
    assert "no STS temperatures" in capsys.readouterr().err
    save_temperatures(drafter, {"temperature": 1.0, "top_k": 0, "top_p": 1.0}, {"temperatures": [1.0, 0.5, 2.0]})
    rc = main(base + ["--policy", "production", "--costs", str(table), "--calibrated", "--skip-drafting",
                      "--traces", str(root / "sched.jsonl")])
    out = capsys.readouterr()
    assert rc == 0, out.err
    lengths = [json.loads(x)["length"] for x in (root / "sched.jsonl").read_text().splitlines()]
    assert max(lengths) <= 3 and len(set(lengths)) > 1  # scheduled: not a fixed gamma
    other = root / "tpu_costs.json"
    save_cost_file(other, [2, 4, 8], [1e-3, 1.1e-3, 3e-3], 2e-4, backend="tpu", device_kind="TPU v5e", provenance="t")
    assert main(base + ["--policy", "early_stop", "--costs", str(other)]) == 2
    assert "measured on backend 'tpu'" in capsys.readouterr().err
