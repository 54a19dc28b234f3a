"""The scheduling an engine gets by default (the drafter kind's, engine/config.py) and the cost
table it measures on its own programs, keeps and reads back (engine/own_costs.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.engine import Engine, EngineConfig, EngineError, own_costs
from dspark_jax.engine.state import PIN_SKIP
from dspark_jax.engine.timing import prefilled_state
from dspark_jax.scheduler.costs import FLOOR_S
from dspark_jax.scheduler.prefix import make_table
from dspark_jax.testing.tiny import tiny_drafter

GREEDY = SamplingParams(0.0, 0, 1.0)
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [3, 3]]


@pytest.fixture(scope="module")
def dspark(target):
    return tiny_drafter("dspark", target, gamma=3)


@pytest.fixture
def tables(tmp_path, monkeypatch):
    monkeypatch.setenv(own_costs.TABLES_ENV, str(tmp_path))
    return tmp_path


@pytest.fixture
def measured(monkeypatch):
    """Counts the engines that time their programs."""
    calls, real = [], own_costs.measure_engine
    monkeypatch.setattr(own_costs, "measure_engine", lambda eng, **kw: calls.append(eng) or real(eng, **kw))
    return calls


@pytest.mark.parametrize("kind,policy,skip", [("dspark", "production", "known"), ("dflash", "fixed", "acceptance"),
                                              ("mtp1", "fixed", "acceptance")])
def test_the_default_scheduling_is_the_drafter_kinds(target, kind, policy, skip):
    eng = Engine(target, tiny_drafter(kind, target), EngineConfig(num_slots=2, max_len=48))
    assert (eng.policy_name, eng.spec.skip_drafting, eng.needs_table) == (policy, skip, True)
    assert eng.scheduling == f"{policy}, skip rule {skip}"


def test_explicit_settings_and_target_only_keep_their_meaning(target, dspark):
    assert Engine(target, None, EngineConfig(num_slots=2, max_len=48)).scheduling == "fixed, no skip rule"
    fixed = Engine(target, dspark, EngineConfig(num_slots=2, max_len=48, policy="fixed"))
    assert fixed.scheduling == "fixed, no skip rule" and not fixed.needs_table and fixed.table_source == "none"
    cfg = EngineConfig(num_slots=2, max_len=48, policy="fixed", skip_drafting="known")
    assert Engine(target, dspark, cfg).scheduling == "fixed, skip rule known"
    cfg = EngineConfig(num_slots=2, max_len=48, skip_drafting=None)  # the kind's policy, no skip rule
    assert Engine(target, dspark, cfg).scheduling == "production, no skip rule"


def test_without_own_costs_a_scheduled_engine_asks_for_a_table(target, dspark):
    eng = Engine(target, dspark, EngineConfig(num_slots=2, max_len=48, own_costs=False))
    with pytest.raises(EngineError, match="none was given.*own_costs"):
        eng.control()


def test_a_pinned_round_verifies_what_it_is_told_or_skips(target, dspark):
    """`Control.pin` (how the tables are timed) overrides the production scheduler and the skip rule."""
    eng = Engine(target, dspark, EngineConfig(num_slots=2, max_len=48, own_costs=False))
    table = make_table(eng.priced_buckets, t_verify=np.ones(len(eng.priced_buckets)), t_draft=1.0)
    st = prefilled_state(eng, 2)
    for g in range(eng.G + 1):
        st, out = eng.step(st, eng.control(GREEDY, pin=g, table=table))
        assert bool(out.drafted) and np.asarray(out.lengths).tolist() == [g, g]
    st, out = eng.step(st, eng.control(GREEDY, pin=PIN_SKIP, table=table))
    assert not bool(out.drafted) and np.asarray(out.lengths).tolist() == [0, 0]
    with pytest.raises(EngineError, match="pin 9"):
        eng.control(GREEDY, pin=9, table=table)


def test_timed_states_forward_no_long_context(target, dspark, tables, monkeypatch):
    """Dense caches: every timed state prefills one-token prompts and is then moved to the timing
    length (no slot's context is forwarded for the table); with paged KV the prompt is forwarded."""
    eng = Engine(target, dspark, EngineConfig(num_slots=2, max_len=48))
    forwarded, lengths, real = [], [], eng.prefill_slots

    def prefill_slots(st, slots, prompts, *rest):
        forwarded.extend(len(p) for p in prompts)
        return real(st, slots, prompts, *rest)

    monkeypatch.setattr(eng, "prefill_slots", prefill_slots)
    real_measure = own_costs.measure_engine

    def measure(e, **kw):
        from dspark_jax.engine.timing import prefilled_state as ps

        lengths.append(int(ps(e, e.R, **kw["state"]).cache.lengths[0]))
        return real_measure(e, **kw)

    monkeypatch.setattr(own_costs, "measure_engine", measure)
    eng.control()
    assert forwarded and max(forwarded) <= 2, forwarded  # the drafter kind's shortest prompt at most
    assert lengths == [own_costs._timing_prompt(eng)] and lengths[0] > 8  # rounds read about half the cache


def test_the_table_is_measured_written_read_back_and_keyed(target, dspark, tables, measured, monkeypatch):
    cfg = EngineConfig(num_slots=2, max_len=48)
    eng = Engine(target, dspark, cfg)
    assert eng.table_source.startswith(f"own, measured at start-up ({own_costs.DEFAULT_REPEATS} timed sweeps")
    ref = Engine(target, None, EngineConfig(num_slots=2, max_len=48)).generate(PROMPTS, max_new_tokens=6,
                                                                             sampling=GREEDY)
    res = eng.generate(PROMPTS, max_new_tokens=6, sampling=GREEDY)
    assert [r.tokens for r in res.results] == [r.tokens for r in ref.results]  # lossless on its own table
    own = eng.own_table
    repeats = own_costs.DEFAULT_REPEATS
    assert (own.source, own.path.parent, own.repeats, len(measured)) == ("measured", tables, repeats, 1)
    saved = json.loads(own.path.read_text())
    assert saved["key"] == own_costs.table_key(eng, SamplingParams())
    assert saved["buckets"] == list(eng.priced_buckets) and len(saved["t_verify"]) == len(eng.priced_buckets)
    assert saved["t_skip"] > 0 and saved["measure"]["repeats"] == repeats and "start-up" in saved["provenance"]

    again = Engine(target, dspark, cfg)  # the same key: read back, not timed
    assert again.table_source.startswith("own, read back from")
    again.control()
    assert (again.own_table.source, again.own_table.path, len(measured)) == ("read back", own.path, 1)
    np.testing.assert_allclose(np.asarray(again.table.t_verify), np.asarray(eng.table.t_verify))

    longer = Engine(target, dspark, EngineConfig(num_slots=2, max_len=64))  # other shapes: its own table
    longer.control()
    assert longer.own_table.source == "measured" and longer.own_table.path != own.path and len(measured) == 2

    saved["key"]["device_kind"] = "another chip"  # a file under this key's name but written for another
    own.path.write_text(json.dumps(saved))
    third = Engine(target, dspark, cfg)
    third.control()
    assert third.own_table.source == "measured" and len(measured) == 3
    assert json.loads(own.path.read_text())["key"] == own_costs.table_key(third, SamplingParams())


def test_the_draft_is_priced_at_what_skipping_it_saves(target, dspark, tables, monkeypatch):
    """Under a skip rule no draft program is compiled for the table: t_draft is the round with every
    slot active and no draft verified minus the skipped round, so that bucket's t_verify is the
    skipped round's time; each program is called once untimed, then the timed sweeps."""
    eng = Engine(target, dspark, EngineConfig(num_slots=2, max_len=48))
    monkeypatch.setattr(eng, "draft", lambda *a: pytest.fail("the table timed the draft program apart"))
    eng.control()
    saved = json.loads(eng.own_table.path.read_text())
    full = next(p["bucket"] for p in saved["plan"] if (p["active_slots"], p["verify_len"]) == (eng.R, 0))
    i = saved["buckets"].index(full)
    assert saved["measure"]["draft"] == "skip" and "what skipping the draft saves" in saved["provenance"]
    # the first calls (the compiles) are told apart from the timing they precede
    assert 0 < saved["measure"]["first_calls_seconds"] < saved["measure"]["seconds"]
    assert "s timing after" in eng.own_table.describe()
    assert saved["t_draft"] == pytest.approx(max(saved["t_round"][i] - saved["t_skip"], FLOOR_S))
    # (unless a larger bucket's round measured cheaper in every sweep and repriced it)
    assert saved["t_verify"][i] == pytest.approx(saved["t_round"][i] - saved["t_draft"]) or full in saved["repriced"]


def test_the_key_names_backend_dtype_and_package(target, dspark, monkeypatch):
    eng = Engine(target, dspark, EngineConfig(num_slots=2, max_len=48, own_costs=False))
    key = own_costs.table_key(eng, SamplingParams())
    path = own_costs.table_path(key)
    assert {"backend", "device_kind", "package", "target", "drafter", "slots", "max_len", "buckets"} <= set(key)
    for field, value in (("backend", "gpu"), ("package", "0.0.0"), ("slots", 3)):
        assert own_costs.table_path({**key, field: value}) != path
    half = [[name, shape, "bfloat16"] for name, shape, _ in key["target"]]
    assert own_costs.table_path({**key, "target": half}) != path
    assert own_costs.table_path(own_costs.table_key(eng, GREEDY)) != path  # timed at another sampling


def test_a_drafter_that_cannot_pay_is_skipped_and_tokens_stay_the_targets(target, dspark):
    """With the default scheduling, a table on which drafting never pays (the draft costs ten
    target steps) leaves the drafter out of every round after the first, whose survivals say
    no; tokens are the target's at temperature 0. (With `policy="fixed"`, the old default,
    every round drafts.)"""
    eng = Engine(target, dspark, EngineConfig(num_slots=2, max_len=48))
    table = make_table(eng.priced_buckets, t_verify=np.asarray(eng.priced_buckets, np.float32) * 1e-3,
                       t_draft=2e-2)
    ref = Engine(target, None, EngineConfig(num_slots=2, max_len=48))
    st = eng.start(eng.init_state(), eng.control(GREEDY, table=table), [0, 1], PROMPTS[:2],
                   np.zeros((2, 2), np.uint32), [20, 20], [GREEDY] * 2, [(), ()])[0]
    ctl = eng.control(GREEDY, table=table)
    drafted = []
    for _ in range(12):
        st, out = eng.step(st, ctl)
        drafted.append(bool(out.drafted))
    assert sum(drafted) <= 1, drafted
    res = eng.generate(PROMPTS, max_new_tokens=10, sampling=GREEDY, table=table)
    want = ref.generate(PROMPTS, max_new_tokens=10, sampling=GREEDY)
    assert [r.tokens for r in res.results] == [r.tokens for r in want.results]
