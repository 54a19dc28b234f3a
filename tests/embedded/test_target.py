"""The embedded default target: HF layout, provenance, cache verification/rebuild, held-out quality."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest

from dspark_jax.commands.embedded import main as embedded_main
from dspark_jax.embedded import report as report_mod
from dspark_jax.embedded import target as E

# Margins (bigram nats/token minus target nats/token) recorded in docs/embedded_target.md.
TINY_MATH_MARGIN = 0.5
# Full target (measured: code +0.004, math +1.446, prose -0.077): math and the token-weighted mean.
FULL_MATH_MARGIN, FULL_MEAN_MARGIN = 1.0, 0.2


@pytest.fixture(scope="module")
def tiny_dir(embedded_tiny_dir):
    """The tiny embedded target, built once per cache (see docs/embedded_target.md)."""
    return embedded_tiny_dir


def test_loads_like_a_checkpoint_and_records_provenance(tiny_dir):
    from dspark_jax.io.hf import load_target

    lt = load_target(tiny_dir)
    cfg, hf, tok = lt.cfg, lt.hf_config, lt.tokenizer
    assert cfg.arch == "qwen3" and cfg.num_layers >= 8 and cfg.vocab_size == tok.vocab_size
    # the Python that wrote the corpus (the cache is shared by every Python on the machine, so not
    # necessarily this one), as the corpus's own manifest records it
    info = hf["dspark_embedded"]
    assert re.fullmatch(r"3\.\d+\.\d+\S* .+", hf["corpus_python_version"]) and len(hf["corpus_sha256"]) == 64
    assert hf["corpus_python_version"] == info["corpus"]["python_version"]
    assert info["preset"]["name"] == "tiny" and info["corpus"]["sha256"] == hf["corpus_sha256"]
    assert tok.eos_id == tok.token_to_id("<|im_end|>") == cfg.eos_token_id and tok.mask_id is not None
    assert lt.chat_template and "<|im_start|>" in lt.chat_template
    assert E.verify_target_dir(tiny_dir) is None
    assert (tiny_dir / "train_log.jsonl").is_file()


def test_tiny_target_beats_bigram_on_math(tiny_dir):
    rep = report_mod.heldout_report(tiny_dir)
    assert set(rep) == {"code", "math", "prose"}
    assert rep["math"]["bigram"] - rep["math"]["model"] > TINY_MATH_MARGIN, report_mod.format_report(rep)


@pytest.mark.slow
def test_full_target_beats_bigram():
    try:
        d = E.embedded_target_dir(build=False)
    except FileNotFoundError:
        pytest.skip("full embedded target not built (python -m dspark_jax embedded build)")
    rep = report_mod.heldout_report(d)
    n = sum(r["tokens"] for r in rep.values())
    mean = sum((r["bigram"] - r["model"]) * r["tokens"] for r in rep.values()) / n
    assert rep["math"]["bigram"] - rep["math"]["model"] > FULL_MATH_MARGIN, report_mod.format_report(rep)
    assert mean > FULL_MEAN_MARGIN, report_mod.format_report(rep)


def test_bigram_kn_is_a_distribution():
    rng = np.random.default_rng(0)
    stream = rng.integers(0, 7, size=300)
    bg = report_mod.BigramKN(stream, vocab_size=9)
    for a in range(9):  # 7 and 8 are unseen as contexts and as continuations
        p = np.exp(bg.logprob(np.full(9, a), np.arange(9)))
        assert p.sum() == pytest.approx(1.0, abs=1e-9) and np.all(p > 0)
    # A seen bigram is more likely than under the continuation distribution alone.
    a, b = int(stream[0]), int(stream[1])
    assert bg.logprob([a], [b])[0] > np.log(bg.pcont[b]) - 1.0


def _cached_copy(src, root, monkeypatch):
    """A copy of the tiny target at the place the cache looks for it, under a temp cache root."""
    monkeypatch.setenv("DSPARK_JAX_CACHE", str(root))
    d = root / E._cache_name(E.get_preset("tiny"), 0)
    shutil.copytree(src, d)
    return d


@pytest.mark.parametrize("damage", ["truncate_weights", "delete_tokenizer", "flip_config_byte", "no_manifest"])
def test_corrupt_cache_is_detected_and_rebuilt(tiny_dir, tmp_path, monkeypatch, damage):
    d = _cached_copy(tiny_dir, tmp_path / "cache", monkeypatch)
    assert E.embedded_target_dir(preset="tiny", build=False) == d
    if damage == "truncate_weights":
        with open(d / "model.safetensors", "r+b") as f:
            f.truncate(100)
    elif damage == "delete_tokenizer":
        (d / "tokenizer.json").unlink()
    elif damage == "flip_config_byte":
        raw = bytearray((d / "config.json").read_bytes())
        raw[-3] ^= 1
        (d / "config.json").write_bytes(bytes(raw))
    else:
        (d / "manifest.json").unlink()
    assert E.verify_target_dir(d) is not None
    with pytest.raises(FileNotFoundError, match="python -m dspark_jax embedded build"):
        E.embedded_target_dir(preset="tiny", build=False)

    calls = []

    def fake_build(out_dir, *, preset, seed, progress):  # stands in for the (tested) real build
        calls.append(out_dir)
        shutil.rmtree(out_dir)
        shutil.copytree(tiny_dir, out_dir)
        return out_dir

    monkeypatch.setattr(E, "build_embedded_target", fake_build)
    assert E.embedded_target_dir(preset="tiny", progress=False) == d
    assert calls == [d] and E.verify_target_dir(d) is None
    assert E.embedded_target_dir(preset="tiny", progress=False) == d and len(calls) == 1  # valid: no rebuild


def test_manifest_lists_every_weight_file(tiny_dir):
    man = json.loads((tiny_dir / "manifest.json").read_text())
    assert set(man["files"]) == set(E.WEIGHT_FILES)


def test_cli_verify(tiny_dir, tmp_path, monkeypatch, capsys):
    _cached_copy(tiny_dir, tmp_path / "c", monkeypatch)
    assert embedded_main(["verify", "--preset", "tiny"]) == 0
    assert "ok" in capsys.readouterr().out
    assert embedded_main(["verify", "--preset", "full", "--cache-dir", str(tmp_path / "empty")]) == 1


def test_unknown_preset_is_named():
    with pytest.raises(ValueError, match="tiny"):
        E.get_preset("huge")
