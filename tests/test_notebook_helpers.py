"""What the notebooks use besides training: the per-chip memory table's rows and text
(train/chip_memory.py), the pooled acceptance with its bootstrap interval (eval/metrics.py), a
config completed from its checkpoint (io/model_config.py) and the plain notebook output
(console.py: no machine paths, no progress bars). The TPU compiles themselves are in
tests/test_notebooks.py (the notebooks' own programs)."""

import io
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from dspark_jax import console
from dspark_jax.config import from_cli
from dspark_jax.config.loader import ConfigError
from dspark_jax.eval import metrics
from dspark_jax.eval.metrics import conditional_acceptance
from dspark_jax.io import model_config
from dspark_jax.train import chip_memory

GIB = 2 ** 30


def _traces(rows):
    """rows: (request, accepted, length, cut)."""
    r = np.asarray(rows)
    return {"request": r[:, 0], "accepted": r[:, 1], "length": r[:, 2], "cut": r[:, 3].astype(bool)}


def test_acceptance_pools_rounds_of_all_requests_and_resamples_requests():
    rng = np.random.default_rng(0)
    rows = []
    for req in range(20):
        p = 0.3 + 0.5 * (req % 2)  # two kinds of prompt: the interval must reflect that spread
        for _ in range(15):
            acc = 0
            while acc < 4 and rng.random() < p:
                acc += 1
            rows.append((req, acc, 4, 0))
    rows.append((3, 0, 4, 1))  # a cut round (stop token): left out
    tr = _traces(rows)
    out = metrics.acceptance_by_position(tr, 4)
    keep = ~tr["cut"]
    expect = conditional_acceptance(tr["accepted"][keep], tr["length"][keep], 4)
    np.testing.assert_allclose(out["rate"], expect)
    assert out["requests"] == 20 and out["position"] == [1, 2, 3, 4] and out["rounds"][0] == 300
    for lo, r, hi in zip(out["lo"], out["rate"], out["hi"]):
        assert lo <= r <= hi and hi - lo > 0.02
    # deterministic for a seed
    assert metrics.acceptance_by_position(tr, 4) == out


def test_acceptance_with_one_request_or_unreached_positions():
    out = metrics.acceptance_by_position(_traces([(0, 1, 3, 0), (0, 0, 3, 0)]), 4)
    assert out["rate"][0] == 0.5 and out["rounds"] == [2, 1, 0, 0]
    assert np.isnan(out["rate"][3]) and all(np.isnan(x) for x in out["lo"])  # one request: no interval


def test_memory_table_text():
    rows = [{"chip": "v5e-1", "hbm_gib": 16.0, "devices": 1, "train": 3 * 2 ** 20,
             "round": 20 * GIB, "compile_s": 40.0},
            {"chip": "v6e-1", "hbm_gib": 32.0, "devices": 1, "train": None,
             "train_refused": "needs 40G, 31.25G of HBM available",
             "round": int(1.5 * GIB), "compile_s": 41.0}]
    cfg = from_cli(["train.batch_size=4", "data.seq_len=128"])
    text = chip_memory.format_memory_table(rows, cfg, slots=8, context=128)
    lines = text.splitlines()
    assert lines[0].split() == ["program", "v5e-1", "peak", "v6e-1", "peak"]
    assert (lines[1].startswith("drafter train step (4 x 128 tokens)") and "3.0 MiB" in lines[1]
            and "does not fit (!)" in lines[1])
    assert (lines[2].startswith("engine round (8 slots x 128)") and "20.00 GiB (!)" in lines[2]
            and "1.50 GiB" in lines[2])
    assert lines[3].split() == ["chip", "HBM", "16", "GiB", "32", "GiB"]
    assert "v6e-1: the TPU compiler refused the drafter train step: needs 40G" in text
    assert "more than the chip's HBM" in text and "in 40 s (v5e-1), 41 s (v6e-1)" in text


def test_refusal_is_recorded_not_raised():
    row = {}
    with chip_memory._refused(row, "train"):
        raise ValueError("the train step does not fit on the chip, the TPU compiler refused it: Ran out of memory "
                         "on HBM, the total memory required for HLO temporaries (17.79G) "
                         "exceeds available HBM (15.75G).")
    assert row == {"train": None, "train_refused": "needs 17.79G, 15.75G of HBM available"}
    with pytest.raises(ValueError, match="something else"), chip_memory._refused(row, "round"):
        raise ValueError("something else")


def test_chip_memory_needs_the_model_and_libtpu(monkeypatch):
    with pytest.raises(ValueError, match="with_checkpoint_model"):
        chip_memory.chip_memory(from_cli([]), slots=1, context=8)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real(name, *a))
    assert not chip_memory.tpu_compiler_available()
    micro = from_cli([str(Path(__file__).resolve().parent.parent / "configs" / "micro.yaml")])
    assert micro.target.model is not None
    with pytest.raises(ValueError, match=r"\.\[aot\]"):
        chip_memory.chip_memory(micro, slots=1, context=8)


def test_with_checkpoint_model_reads_config_and_mask(embedded_tiny_dir, tmp_path):
    from dspark_jax.io.hf import load_target, read_config

    cfg = model_config.with_checkpoint_model(from_cli([f"target.path={embedded_tiny_dir}"]))
    assert cfg.target.model == read_config(embedded_tiny_dir)[1]
    assert cfg.drafter.mask_token_id == load_target(embedded_tiny_dir).tokenizer.mask_id
    bare = tmp_path / "bare"  # no tokenizer (as Qwen3's has no <|mask|>): the fallback, else a clear error
    bare.mkdir()
    shutil.copy(Path(embedded_tiny_dir) / "config.json", bare / "config.json")
    with pytest.raises(ConfigError, match="151669"):
        model_config.with_checkpoint_model(from_cli([f"target.path={bare}"]))
    assert model_config.with_checkpoint_model(from_cli([f"target.path={bare}"]),
                                     fallback_mask_token_id=7).drafter.mask_token_id == 7
    given = model_config.with_checkpoint_model(from_cli([f"target.path={bare}", "drafter.mask_token_id=5"]))
    assert given.drafter.mask_token_id == 5


def test_scrub_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    home = str(Path.home())
    text = f"checkpoint: {tmp_path}/out/run/3\ntarget `{home}/.cache/x` and {sys.prefix}/lib/site.py; cwd {tmp_path}"
    out = console.scrub_paths(text)
    assert "checkpoint: out/run/3" in out and "target `~/.cache/x`" in out and "<python>/lib/site.py" in out
    assert str(tmp_path) not in out and home + "/" not in out


def test_plain_output_drops_bars_and_scrubs_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    buf, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", buf)
    monkeypatch.setattr(sys, "stderr", err)
    with console.plain_output():
        print(f"drafter export:  {tmp_path}/q/run/drafter")
        sys.stderr.write("\rtrain:   0%|          | 0/12 [00:00<?, ?step/s]")
        sys.stderr.write("\rtrain: 100%|##########| 12/12 [00:13<00:00,  1.11s/step, loss=2.89]\n")
        sys.stderr.write("regenerate: 100%|\u2588\u2588\u2588\u2588\u2588\u2588| 48/48 [00:05<00:00, 9.1sample/s]\n")
        print("held-out measured accepted length: 1.2", end="")
    assert buf.getvalue() == "drafter export:  q/run/drafter\nheld-out measured accepted length: 1.2\n"
    assert err.getvalue() == ""
    assert console.is_progress_bar("train:  40%|####      | 4/10 [00:02<00:03, 2.0step/s]")
    assert not console.is_progress_bar("phase | time | share")
    assert not console.is_progress_bar("acceptance 40% of rounds")
