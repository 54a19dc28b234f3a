"""The arithmetic of docs/tpu_predictions.md (bench/tpu_report.py): the overhead model fitted to
sglang-jax's published points recovers a known truth, and the report says which numbers were
fitted and which are checks."""

import json
from pathlib import Path

import pytest

from dspark_jax.bench.tpu_report import PUBLISHED, Overhead, fit_overhead, fixed_speedup, write_report

G = 7
KEPT = Path(__file__).resolve().parents[2] / "docs" / "tpu_predictions_figures"  # the predicted tables in the repo
TRUTH = Overhead(h0=7e-3, h1=1.2e-4, h2=2e-5, tau=6.0)


def _table(c: int, step: float, round_: float, draft: float = 1e-3) -> dict:
    buckets = [c, 2 * c, 4 * c, 8 * c]
    return {"format": "dspark_cost_table/1", "backend": "tpu", "device_kind": "v7x-8", "buckets": buckets,
            "t_verify": [round_ - draft] * 4, "t_draft": draft, "t_target_step": step,
            "engine": {"num_slots": c, "gamma": G}, "provenance": "a test table", "predicted_on": "xla_tpu_cost_model"}


def _consistent(c: int) -> dict:
    """A compiler table for concurrency c whose published speeds TRUTH reproduces exactly."""
    pub = PUBLISHED["sglang-jax"]
    t_ar = 1 / pub["target_only_tps_c1"] if c == 1 else 128 / (pub["dspark_tps_c128"] / pub["speedup"][128])
    h = TRUTH.h0 + TRUTH.h1 * c
    return _table(c, t_ar - h, TRUTH.tau * t_ar / pub["speedup"][c] - h - TRUTH.h2 * G * c)


def test_the_fit_recovers_the_overhead_and_tau_that_made_the_published_points():
    fit = fit_overhead({1: _consistent(1), 128: _consistent(128)})
    for name in ("h0", "h1", "h2", "tau"):
        assert getattr(fit, name) == pytest.approx(getattr(TRUTH, name), rel=1e-6), name
    # and the fitted model reproduces the points it was fitted to
    for c in (1, 128):
        speedup = fixed_speedup(fit.apply(_consistent(c)), fit.tau, 8)
        assert speedup == pytest.approx(PUBLISHED["sglang-jax"]["speedup"][c])


def test_without_the_large_table_only_a_fixed_overhead_is_fitted():
    fit = fit_overhead({1: _consistent(1), 128: None})
    assert fit.h1 == 0 and fit.h2 == 0
    assert fixed_speedup(fit.apply(_consistent(1)), fit.tau, 8) == pytest.approx(5.03)


def test_applied_overhead_charges_drafting_rounds_per_drafted_token():
    d = _table(8, 2e-3, 4e-3)
    o = TRUTH.apply(d)
    assert o["t_target_step"] == pytest.approx(2e-3 + TRUTH.h0 + 8 * TRUTH.h1)
    assert o["t_draft"] == pytest.approx(1e-3 + TRUTH.h2 * 8 * G)
    assert o["t_verify"][0] == pytest.approx(3e-3 + TRUTH.h0 + 8 * TRUTH.h1)


def test_the_report_names_what_was_fitted_and_what_is_checked(tmp_path):
    cache = tmp_path / "figures"
    cache.mkdir()
    for c in (1, 8, 128):
        (cache / f"sglang-v7x-8-qwen3_8b_dspark-r{c}.json").write_text(json.dumps(_consistent(c) if c != 8 else
                                                                                 _table(8, 3e-3, 5e-3)))
    out = tmp_path / "report.md"
    out.write_text("# head\n")
    write_report(out, cache, [], rounds=10)
    text = out.read_text()
    assert text.startswith("# head\n") and "tau = **6.00**" in text
    rows = {ln.split("|")[1].strip(): ln for ln in text.splitlines() if ln.startswith("| ") and "x |" in ln}
    assert "(fitted)" in rows["1"] and "(fitted)" in rows["128"] and "(fitted)" not in rows["8"]
    assert "not predicted yet" in rows["32"]
    assert "tpu-inference --only" not in text and "tpu-predict --only tpu-inference" in text
    # the tables carry no libtpu field here: the report says so rather than name a compiler
    assert "by libtpu unknown (the tables' `libtpu` field)" in text


def _fitted_cache(tmp_path):
    """A table cache holding the comparison tables the overhead fit needs (TRUTH's)."""
    cache = tmp_path / "figures"
    cache.mkdir()
    for c in (1, 8, 128):
        (cache / f"sglang-v7x-8-qwen3_8b_dspark-r{c}.json").write_text(json.dumps(_consistent(c)))
    return cache


def test_the_grid_shows_the_one_token_step_beside_two_tokens_and_plots_every_method(tmp_path):
    cache = _fitted_cache(tmp_path)
    key = "grid-v6e-8-qwen3_8b_dspark-r1"
    d = json.loads((KEPT / f"{key}.json").read_text())
    (cache / f"{key}.json").write_text(json.dumps(d))
    entry = dict(key=key, preset="qwen3_8b_dspark", slice="v6e-8", slots=1, context=2048)
    out = tmp_path / "report.md"
    write_report(out, cache, [entry], rounds=10)
    text = out.read_text()
    section = text[text.index("## One token per program"):]
    row = next(ln for ln in section.splitlines() if ln.startswith("| qwen3_8b | v6e-8 | "))
    t1, t2 = 1e3 * d["t_target_step"], 1e3 * d["t_verify"][d["buckets"].index(2)]
    assert row == f"| qwen3_8b | v6e-8 | {t1:.2f} | {t2:.2f} | {t1 / t2:.2f} |"
    assert f"by libtpu {d['libtpu']}, unknown (the tables' `libtpu` field)" in text
    assert (cache / "tpu_predicted_qwen3_8b_dspark.png").stat().st_size > 10_000
    assert "![qwen3_8b_dspark](figures/tpu_predicted_qwen3_8b_dspark.png)" in text


def test_paged_tables_sit_beside_their_dense_twins(tmp_path):
    cache = _fitted_cache(tmp_path)
    dense = json.loads((KEPT / "grid-v6e-8-qwen3_8b_dspark-r8.json").read_text())
    paged = json.loads(json.dumps(dense))
    paged["t_target_step"] *= 1.5
    paged["programs"][f"round@{paged['buckets'][-1]}"]["kernels"] = 37
    (cache / "grid-v6e-8-qwen3_8b_dspark-r8.json").write_text(json.dumps(dense))
    (cache / "paged-v6e-8-qwen3_8b_dspark-r8.json").write_text(json.dumps(paged))
    entries = [dict(key=k, preset="qwen3_8b_dspark", slice="v6e-8", slots=8, context=2048)
               for k in ("grid-v6e-8-qwen3_8b_dspark-r8", "paged-v6e-8-qwen3_8b_dspark-r8")]
    out = tmp_path / "report.md"
    write_report(out, cache, entries, rounds=10)
    section = out.read_text().split("## Paged KV")[1]
    row = next(ln for ln in section.splitlines() if ln.startswith("| qwen3_8b | v6e-8 | 8 |"))
    t = 1e3 * dense["t_target_step"]
    assert f"| {t:.2f} / {1.5 * t:.2f} |" in row and row.endswith("| 37 |")
