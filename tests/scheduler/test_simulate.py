import json
from pathlib import Path

import numpy as np
import pytest

from dspark_jax.calibration.sts import fit_sts
from dspark_jax.calibration.traces import TraceSet, synthetic_traces
from dspark_jax.scheduler.costs import load_cost_file, roofline_table
from dspark_jax.scheduler.simulate import (
    Method,
    SimResult,
    default_methods,
    headline,
    matched_throughput,
    replay_rows,
    run_sweep,
    simulate_method,
)
from tests.scheduler import prefix_reference as numpy_ref

G = 7
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def synth():
    tr = {k: synthetic_traces(64, 32, G, kind=k, seed=i) for i, k in enumerate(("dspark", "dflash", "mtp1"))}
    d = tr["dspark"]
    return tr, fit_sts(d.conf_logits, d.accepted)


@pytest.fixture(scope="module")
def accel():
    return load_cost_file(ROOT / "configs/costs/accelerator_synthetic.json")


def flat_cost(t=1e-2, top=2048):
    return {"buckets": [1, top], "t_verify": [t, t], "t_draft": 1e-3}


def test_replay_rows_walks_one_request_in_order():
    ts = synthetic_traces(5, 9, 3, seed=0)
    perm = np.random.default_rng(0).permutation(len(ts))
    ts = ts.select(perm)  # storage order must not matter
    rows = replay_rows(ts, 4, 20, np.random.default_rng(1), turnover=None)
    for c in range(4):
        assert len(set(ts.request[rows[:, c]])) == 1
        assert np.all(np.diff(ts.round[rows[:, c]]) % 9 == 1)  # consecutive rounds, wrapping
    rows = replay_rows(ts, 64, 20, np.random.default_rng(1), turnover=5)
    for seg in range(4):  # churn: a new request every 5 rounds, walked in order
        blk = rows[5 * seg: 5 * seg + 5]
        assert all(len(set(ts.request[blk[:, c]])) == 1 for c in range(64))
        assert np.all(np.diff(ts.round[blk], axis=0) % 9 == 1)
    assert np.mean(ts.request[rows[0]] != ts.request[rows[5]]) > 0.5


def test_target_only_one_token_per_round(synth, accel):
    tr, temps = synth
    r = simulate_method(Method("ar", "ar", None), 16, accel, tr, temps, n_rounds=10, keep_rounds=True)
    assert np.all(r.rounds["tokens"] == 16) and np.all(r.rounds["lengths"] == 0) and r.tau == 1.0
    t16 = np.interp(16, accel["buckets"], accel["t_verify"])
    assert r.per_user_tps == pytest.approx(1.0 / t16) and r.budget == 1.0


def test_accepts_min_k_l_and_fixed_lengths(synth, accel):
    tr, temps = synth
    for m in (Method("f3", "fixed", "dspark", gamma=3), Method("th", "threshold", "dspark", threshold=0.6)):
        r = simulate_method(m, 8, accel, tr, temps, n_rounds=20, keep_rounds=True)
        ro = r.rounds
        np.testing.assert_array_equal(ro["accepted"], np.minimum(ro["k"], ro["lengths"]))
        np.testing.assert_array_equal(ro["tokens"], (ro["accepted"] + 1).sum(1))
        np.testing.assert_array_equal(ro["B"], (1 + ro["lengths"]).sum(1))
    assert np.all(simulate_method(Method("f3", "fixed", "dspark", gamma=3), 8, accel, tr, temps, n_rounds=5,
                                  keep_rounds=True).rounds["lengths"] == 3)


@pytest.mark.parametrize("kind", ["early_stop", "static", "production"])
def test_schedulers_respect_buckets_and_prefixes(synth, kind):
    tr, temps = synth
    cost = {"buckets": [4, 8, 12, 16, 20], "t_verify": [1e-3, 1.3e-3, 1.9e-3, 2.6e-3, 3.4e-3], "t_draft": 2e-4}
    r = simulate_method(Method(kind, kind, "dspark"), 4, cost, tr, temps, n_rounds=40, keep_rounds=True, R_pad=8)
    ro = r.rounds
    assert np.all(ro["B"] <= 20) and np.all((ro["lengths"] >= 0) & (ro["lengths"] <= G))
    assert ro["lengths"].std() > 0  # it actually adapts per request / round
    if kind == "static":  # never exceeds the bucket it rounds up to, and fills it when candidates remain
        bk = np.asarray(cost["buckets"])
        assert np.all(ro["B"] <= bk[np.searchsorted(bk, ro["B"])])


def test_flat_table_perfect_acceptance_longer_is_never_worse():
    n = 4 * 8
    perfect = TraceSet(np.full((n, G), 8.0), np.full(n, G), np.full(n, G), np.ones(n, bool),
                       np.arange(n) // 8, np.arange(n) % 8, meta={"drafter_kind": "dspark"})
    tr = {"dspark": perfect}
    cost = flat_cost()
    tps = [simulate_method(Method(f"g{g}", "fixed", "dspark", gamma=g), 8, cost, tr, None, n_rounds=5).total_tps
           for g in range(G + 1)]
    assert np.all(np.diff(tps) > 0)
    for kind in ("early_stop", "static", "production"):
        r = simulate_method(Method(kind, kind, "dspark", skip="stale"), 8, cost, tr, None, n_rounds=5)
        assert r.budget == G + 1 and r.total_tps == pytest.approx(tps[-1])


def test_headline_on_accelerator_table(synth, accel):
    tr, temps = synth
    methods = [m for m in default_methods() if m.kind != "threshold"]
    res = run_sweep(methods, [1, 64, 256], accel, tr, temps, n_rounds=40, seed=0)
    hl = headline(res)
    at = hl["at_max_concurrency"]
    for name in ("DSpark early-stop", "DSpark static-shape", "DSpark production"):
        assert hl["min_over_concurrency"][name] >= 1.0 - 1e-9, hl  # never below target-only
    assert at["DSpark gamma=7"] < 0.8 and at["DFlash gamma=7"] < 0.8  # fixed gamma 7 collapses
    low = {r.method: r.per_user_tps for r in res if r.concurrency == 1}
    assert low["DSpark production"] > 1.5 * low["MTP-1"] > 1.5 * low["target-only"]
    budget = {r.concurrency: r.budget for r in res if r.method == "DSpark production"}
    assert budget[1] > budget[64] > budget[256] == 1.0  # the budget falls as concurrency grows


def test_matched_throughput_interpolates():
    res = [SimResult("A", 1, 100.0, 100.0, 1, 1, 0, 1), SimResult("A", 4, 400.0, 100.0, 1, 1, 0, 1),
           SimResult("B", 1, 50.0, 50.0, 2, 2, 0, 1), SimResult("B", 4, 200.0, 50.0, 2, 2, 0, 1),
           SimResult("B", 16, 800.0, 50.0, 2, 2, 0, 1)]
    m = matched_throughput(res, "A", "B")
    assert [p["baseline_concurrency"] for p in m] == [4]  # only B's point inside A's range
    assert m[0]["per_user"] == pytest.approx(100.0) and m[0]["gain"] == pytest.approx(1.0)


def test_cli_synthetic(tmp_path):
    from dspark_jax.commands.simulate import main

    cost = tmp_path / "c.json"
    cost.write_text(json.dumps(roofline_table()))
    assert main(["--costs", str(cost), "--synthetic-traces", "--concurrency", "1,256", "--rounds", "8",
                 "--out", str(tmp_path / "o")]) == 0
    s = json.loads((tmp_path / "o/summary.json").read_text())
    assert "SYNTHETIC" in s["traces"] and s["concurrency"] == [1, 256]
    for f in ("sweep.csv", "throughput_vs_per_user.png", "budget_vs_concurrency.png"):
        assert (tmp_path / "o" / f).stat().st_size > 0


def test_known_skip_probes_and_matches_the_engine_rule():
    """The simulator's "known" rule is the engine's: the same decision as
    scheduler.known_speculation_pays on the last drafted round's survivals, the same gain as
    scheduler.drafting_gain; with survivals that never pay it probes at doubling intervals
    (probe_every, 2x, ... up to probe_max) while the credit earlier drafted rounds saved covers
    each probe's loss, until survivals say no by more than their sampling error
    (scheduler.settled_no)."""
    from dspark_jax.scheduler import prefix as scheduler
    from dspark_jax.scheduler.simulate import _drafting_gain, _known_skip, _stale_skip

    tab = scheduler.make_table([8, 16, 32, 64], t_verify=[1.0, 1.2, 2.0, 4.0], t_draft=0.5, as_numpy=True)
    jtab = scheduler.make_table([8, 16, 32, 64], t_verify=[1.0, 1.2, 2.0, 4.0], t_draft=0.5)
    rng = np.random.default_rng(0)
    for i in range(30):
        a = np.cumprod(rng.uniform(0, 1, (8, G)) ** rng.uniform(0.2, 3), axis=1)
        for mode in ("latency", "sps"):
            assert bool(_stale_skip(a[None], 8, tab, 0.5, "step", mode)[0]) == (
                not numpy_ref.known_speculation_pays_np(a, np.ones(8, bool), tab, mode=mode, cost="step"))
            if i < 6:
                want = scheduler.drafting_gain(a, np.ones(8, bool), jtab, mode=mode)
                np.testing.assert_allclose(_drafting_gain(a, 8, tab, 0.5, "step", mode), want, rtol=1e-4, atol=1e-5)
    # one request whose drafts never pay: after round 0 (nothing known) nothing covers a probe
    hopeless = np.full((200, 1, G), 0.01)
    assert np.flatnonzero(~_known_skip(hopeless, True, 1, tab, 0.5, "step", 4, 32)).tolist() == [0]
    # a round that paid (perfect drafts: 6.5 s saved) funds probes at doubling intervals (here 8, up
    # to probe_max 8), 0.43 s each, until the credit is spent: 14 probes
    paid = np.concatenate([np.ones((1, 1, G)), hopeless])
    skip = _known_skip(paid, True, 1, tab, 0.5, "step", probe_every=4, probe_max=8)
    assert np.flatnonzero(~skip).tolist() == [0, 1, *range(9, 114, 8)]
    # eight requests saying no beyond their sampling error settle it: no probe after the first round,
    # none at all when the round before the first (`seed`) said so
    hopeless = np.full((200, 8, G), 0.01)
    assert np.flatnonzero(~_known_skip(hopeless, True, 8, tab, 0.5, "step", 4, 32)).tolist() == [0]
    assert _known_skip(hopeless, True, 8, tab, 0.5, "step", 4, 32, seed=hopeless[0]).all()
    assert not _known_skip(np.ones((40, 8, G)), True, 8, tab, 0.5, "step", 8).any()
    assert _known_skip(np.ones((40, 8, G)), False, 8, tab, 0.5, "step", 8).all()


def test_best_case_rule_matches_the_scheduler():
    """The simulator's best-case rule is scheduler.speculation_pays (numpy reference) on the interpolated table."""
    from dspark_jax.scheduler import prefix as scheduler
    from dspark_jax.scheduler.simulate import _best_case_pays

    for tv, t_draft in (((1.0, 1.0, 1.05, 1.2), 0.1), ((1.0, 8.0, 16.0, 64.0), 0.0), ((1.0, 1.0, 1.0, 1.0), 5.0)):
        for mode in ("latency", "sps"):
            tab = scheduler.make_table([1, 8, 16, 64], t_verify=tv, t_draft=t_draft, as_numpy=True)
            for R in (1, 4, 8, 60):
                want = numpy_ref.speculation_pays_np(R, tab, R * G, mode=mode, cost="interp")
                assert _best_case_pays(R, tab, t_draft, R * G, mode) == want, (tv, mode, R)


def test_carried_stale_is_the_engines_a_hist():
    """Round t's stale survivals are those of the last drafted round <= t - 2 (the engine's
    a_hist[1] with survivals carried through skipped rounds)."""
    from dspark_jax.scheduler.simulate import _carried_stale

    a_all = np.arange(8, dtype=float)[:, None, None] * np.ones((8, 1, 1))  # round index as value
    skip = np.array([False, True, True, False, True, True])  # rounds 0..5 (a_all rows 2..7)
    got = _carried_stale(a_all, skip)[:, 0, 0].tolist()
    # rows: t=0 -> row 0, t=1 -> 1, t=2 -> 2 (round 0 drafted), t=3 -> 2 (round 1 skipped), t=4 -> 2, t=5 -> 5
    assert got == [0, 1, 2, 2, 2, 5]


def test_skipped_rounds_cost_the_tables_skipped_round():
    """A drafter whose drafting never pays (expensive verification of drafts): the scheduled
    method skips nearly every round, so its time per round is the table's skipped round
    (`t_skip`, or no less than the target-only step where only that is priced), not t_verify(R)."""
    from dspark_jax.calibration.profiles import parse_profile, profile_traces
    from dspark_jax.scheduler.simulate import skipped_round_cost

    R = 8
    base = {"buckets": [R, 2 * R, 8 * R], "t_verify": [1e-2, 1.0, 1.0], "t_draft": 0.5,
            "engine": {"num_slots": R}}
    traces = {"dspark": profile_traces(parse_profile("tau:1.2", gamma=G))}
    # the best-case rule keeps the drafter's context in every skipped round
    m = Method("DSpark scheduled", "production", "dspark", skip="best_case")
    for extra, want in (({"t_skip": 3e-2}, 3e-2), ({"t_target_step": 2e-2}, 2e-2), ({}, 1e-2),
                        ({"t_target_step": 5e-3}, 1e-2)):
        cost = {**base, **extra}
        assert skipped_round_cost(cost, R) == pytest.approx(want)
        res = simulate_method(m, R, cost, traces, None, n_rounds=400)
        assert res.skip_frac > 0.8
        skipped = want * res.skip_frac  # what the skipped rounds add to the mean round
        assert 1e3 * skipped - 1e-9 <= res.round_ms <= 1e3 * (skipped + (1 - res.skip_frac) * 1.6) + 1e-9
    # the "known" rule's settled rounds (here the best case does not pay) are the target-only step
    cost = {**base, "t_skip": 3e-2, "t_target_step": 2e-2}
    res = simulate_method(Method("s", "production", "dspark", skip="known"), R, cost, traces, None, n_rounds=40)
    assert res.skip_frac == 1.0 and res.round_ms == pytest.approx(20.0)
    # another R: t_verify(2R) plus what the skipped round costs beyond t_verify at the table's own R
    assert skipped_round_cost({**base, "t_skip": 3e-2}, 2 * R) == pytest.approx(1.0 + 2e-2)


# the predicted tables on v6e-8 (docs/tpu_predictions.md), one per concurrency
V6E = {t: [ROOT / f"docs/tpu_predictions_figures/grid-v6e-8-{t}_dspark-r{r}.json" for r in (1, 8, 64, 256)]
       for t in ("qwen3_4b", "qwen3_8b")}
V6E_8B = V6E["qwen3_8b"]


def test_priced_concurrency_of_each_kind_of_table(accel):
    from dspark_jax.scheduler.simulate import priced_concurrency

    assert priced_concurrency(load_cost_file(ROOT / "configs/costs/cpu_micro.json")) == [2 ** i for i in range(9)]
    assert priced_concurrency(load_cost_file(ROOT / "configs/costs/cpu_smollm2_135m_r4.json")) == [4]
    assert [priced_concurrency(load_cost_file(p)) for p in V6E_8B] == [[1], [8], [64], [256]]
    assert priced_concurrency(accel) == [2 ** i for i in range(9)]  # no engine: full blocks fit 2048 tokens


def test_scheduled_dspark_is_never_below_target_only_with_mt_bench_on_a_kept_table():
    """DeepSpec's mt-bench acceptance for the Qwen3-8B drafter (tau 3.72, the lowest of its five
    sets) on the predicted v6e-8 Qwen3-4B and Qwen3-8B tables: at every concurrency the tables
    price, scheduled DSpark is at least target-only. R = 256 sits at break-even for Qwen3-8B
    (the survivals' best throughput is 0.96-1.0 of plain decoding's, within their sampling
    error): a rule that probes there on each verdict alone, with nothing to pay for the probes,
    gave 0.9997; the credit that drafted rounds earn (scheduler.drafting_gain) must cover what a
    probe may lose, so it does not probe there. With plain decoding priced at t_verify(R) and
    unsettled probes the tables gave 0.88 (Qwen3-4B) and 0.85 (Qwen3-8B) at R = 256."""
    from dspark_jax.calibration.profiles import parse_profile, profile_traces
    from dspark_jax.scheduler.simulate import priced_concurrency, versus_target_only

    ts = profile_traces(parse_profile("deepspec-8b-mt-bench-dspark"))
    full = ts.full_gamma()
    temps = fit_sts(full.conf_logits, full.accepted)
    points = {}
    for target, paths in V6E.items():
        for path in paths:
            cost = load_cost_file(path)
            points.update({(target, r["concurrency"]): r["ratio"]
                           for r in versus_target_only(cost, {"dspark": ts}, temps, priced_concurrency(cost))})
    assert len(points) == 8
    assert all(ratio >= 1.0 for ratio in points.values()), points


def test_vs_target_only_command(tmp_path):
    """`simulate --vs-target-only`: a directory of tables and a table file, two profiles, one
    ratio per (table, concurrency, profile) in ratios.csv, the markdown table in ratios.md."""
    import csv

    from dspark_jax.commands.simulate import main

    d = tmp_path / "tables"
    d.mkdir()
    (d / "r8.json").write_text(V6E_8B[1].read_text())
    (d / "notes.json").write_text("{}")  # not a cost table: left out
    micro = ROOT / "configs/costs/cpu_smollm2_135m_r4.json"
    assert main(["--vs-target-only", "--costs", f"{d},{micro}", "--acceptance",
                 "deepspec-8b-gsm8k-dspark,deepspec-8b-mt-bench-dspark", "--rounds", "16",
                 "--out", str(tmp_path / "o")]) == 0
    rows = list(csv.DictReader((tmp_path / "o/ratios.csv").open()))
    assert sorted((r["table"], r["concurrency"], r["profile"]) for r in rows) == [
        ("cpu_smollm2_135m_r4", "4", "gsm8k"), ("cpu_smollm2_135m_r4", "4", "mt-bench"),
        ("r8", "8", "gsm8k"), ("r8", "8", "mt-bench")]
    assert {r["origin"] for r in rows} == {"predicted (XLA:TPU cost model, v6e-8)", "measured (cpu)"}
    md = (tmp_path / "o/ratios.md").read_text()
    assert "| r8 | predicted (XLA:TPU cost model, v6e-8) | 8 |" in md and "Lowest of 4 points" in md


def test_the_acceptance_rule_is_the_engines():
    """The simulator's "acceptance" rule (fixed-length drafters without a confidence head) makes
    the engine's decisions: the same rounds drafted and settled as `round._skip_decision` /
    `_count_acceptance` / `_probe_schedule` stepped on the same accepted counts, for a drafter
    that never pays (its first three rounds only), one that always pays (every round) and mixed ones; and in a
    simulation the hopeless drafter's fixed method then costs about target-only."""
    import jax.numpy as jnp

    from dspark_jax.decoding.sampling import SamplingParams
    from dspark_jax.engine import Engine, EngineConfig
    from dspark_jax.engine import round as round_mod
    from dspark_jax.scheduler import prefix
    from dspark_jax.scheduler.simulate import _acceptance_rounds
    from dspark_jax.testing.tiny import tiny_config, tiny_drafter, tiny_target

    buckets, gamma, R = (3, 6, 12), 3, 3
    target = tiny_target(tiny_config(vocab_size=16, hidden_size=32, num_layers=2))
    eng = Engine(target, tiny_drafter("dflash", target, gamma=gamma),
                 EngineConfig(num_slots=R, max_len=40, buckets=buckets, prefill_buckets=(20,), probe_every=4))
    assert eng.spec.skip_drafting == "acceptance"
    table = prefix.make_table(buckets, t_verify=(1.0, 1.15, 2.2), t_draft=0.6)
    assert numpy_ref.speculation_pays_np(R, prefix.make_table(buckets, t_verify=(1.0, 1.15, 2.2), t_draft=0.6,
                                                              as_numpy=True), R * gamma, mode="latency")
    ctl = eng.control(SamplingParams(0.0, 0, 1.0), table=table)
    act = jnp.ones(R, bool)
    rng = np.random.default_rng(0)
    drop = np.concatenate([np.full((20, R), gamma), np.zeros((40, R))]).astype(np.int64)  # pays, then not
    cases = {"never": np.zeros((60, R), np.int64), "always": np.full((60, R), gamma, np.int64), "drop": drop,
             **{f"mixed{i}": rng.binomial(gamma, p, (60, R)) for i, p in enumerate((0.5, 0.6, 0.8))}}
    drafted_counts = {}
    for name, k in cases.items():
        skip, settled = _acceptance_rounds(k, gamma, True, R, table, "step", 4, 64, "latency")
        st = eng.init_state()._replace(active=act)
        for t in range(k.shape[0]):
            pays, final = (bool(x) for x in round_mod._skip_decision(eng.spec, st, act, ctl, R * gamma))
            assert (pays, final) == (not skip[t], bool(settled[t])), (name, t)
            if pays:
                lengths, acc = jnp.full(R, gamma, jnp.int32), jnp.asarray(np.minimum(k[t], gamma), jnp.int32)
                counts = round_mod._count_acceptance(st.run_counts, lengths, acc, act)
                since, gap, credit = round_mod._probe_schedule(eng.spec, st, st.a_hist[0], act, ctl, 0.0, 0.0, counts)
                st = st._replace(run_counts=counts, since_draft=since, probe_gap=gap, probe_credit=credit)
            else:
                st = st._replace(since_draft=st.since_draft + 1)
        drafted_counts[name] = int((~skip).sum())
    # the hopeless drafter drafts until 8 rows are known (3, 5.94, 8.82 after 1, 2, 3 rounds), then stops
    assert drafted_counts["never"] == 3 and drafted_counts["always"] == 60
    assert 20 < drafted_counts["drop"] < 60, drafted_counts  # drafts while it pays, stops after the drop
    # simulated: the hopeless DFlash-like method skips all but its first round
    cost = {"buckets": list(buckets), "t_verify": [1.0, 1.15, 2.2], "t_draft": 0.6}
    hopeless = TraceSet(conf_logits=np.zeros((80, G), np.float32), accepted=np.zeros(80, np.int64),
                        verify_len=np.full(80, G), full=np.ones(80, bool), request=np.repeat(np.arange(8), 10),
                        round=np.tile(np.arange(10), 8), meta={"sampling": {"temperature": 0.0}})
    res = simulate_method(Method("DFlash", "fixed", "dflash", gamma=gamma, skip="acceptance"), R, cost,
                          {"dflash": hopeless}, None, n_rounds=100)
    assert res.skip_frac == pytest.approx(0.97)
