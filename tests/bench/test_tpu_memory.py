"""The TPU memory report: its entries, its tables from cached figures, its place in the doc."""

import json

from dspark_jax.commands.bench import tpu_memory


def test_entries_cover_every_qwen3_preset_and_the_serving_slices(tmp_path):
    configs = tmp_path / "configs"
    configs.mkdir()
    for name in ("qwen3_4b_dspark", "qwen3_8b_dflash", "micro"):
        (configs / f"{name}.yaml").write_text("{}")
    keys = [e["key"] for e in tpu_memory.entries(configs, "all")]
    assert keys[:2] == ["train-qwen3_4b_dspark", "train-qwen3_8b_dflash"]  # Qwen3 presets only
    serve = [k for k in keys if k.startswith("serve-")]
    assert len(serve) == len(tpu_memory.SERVE_TARGETS) * len(tpu_memory.SERVE_SLICES) * 2
    assert "serve-qwen3_8b_dspark-v7x-8-paged" in serve


def test_render_uses_cached_figures_and_marks_the_rest(tmp_path):
    configs, cache = tmp_path / "configs", tmp_path / "cache"
    configs.mkdir(), cache.mkdir()
    (configs / "qwen3_4b_dspark.yaml").write_text("{}")
    (configs / "qwen3_8b_dspark.yaml").write_text("{}")
    gib = 2 ** 30
    (cache / "train-qwen3_4b_dspark.json").write_text(json.dumps(
        {"slice": "v5p-32", "chips": 16, "devices": 16, "mesh": [2, 8, 1], "remat": None, "hbm_gib": 95.0,
         "compile_s": 120.0, "train": 10 * gib, "eval": 5 * gib}))
    (cache / "serve-qwen3_8b_dspark-v6e-8-dense.json").write_text(json.dumps(
        {"slice": "v6e-8", "devices": 8, "hbm_gib": 32.0, "state": 6 * gib, "round": 7 * gib, "prefill": 35 * gib,
         "compile_s": 300, "kernels": 0}))
    text = tpu_memory.render(configs, cache)
    assert "| qwen3_4b_dspark | v5p-32 (16) | 2 x 8 x 1 | none | 10.00 GiB | 5.00 GiB | 95 GiB | 85.00 GiB |" in text
    assert "| qwen3_8b_dspark | not compiled yet |" in text
    assert "| qwen3_8b_dspark | v6e-8 | dense | 6.00 GiB | 7.00 GiB | 35.00 GiB (over) | 32 GiB | 0 | 300 s |" in text
    assert "| qwen3_8b_dspark | v6e-8 | paged | not compiled yet |" in text


def test_write_doc_replaces_only_between_markers(tmp_path):
    doc = tmp_path / "tpu_memory.md"
    doc.write_text(f"# Title\nbefore\n{tpu_memory.BEGIN}\nold table\n{tpu_memory.END}\nafter\n")
    tpu_memory.write_doc(doc, "new table")
    assert doc.read_text() == f"# Title\nbefore\n{tpu_memory.BEGIN}\nnew table\n{tpu_memory.END}\nafter\n"
