"""The engine's output distribution equals the target's (docs/method.md §5), checked by a chi-square test.

Tiny target with vocabulary 8, one 4-token prompt, N = 50,000 independent requests run
as N slots of one engine (each with its own key; 2e5 would quadruple the CPU time). Cells: the
first two generated tokens (64 cells; cells of zero target probability must stay empty). Reference: exact
enumeration of the target's (transformed) next-token distributions. Test: Pearson
chi-square at significance alpha = 1e-4 (df = non-zero cells - 1). Power: for a
deviation of total variation d, the noncentrality is >= N * (2d)^2 (Cauchy-Schwarz), so
TV 0.02 gives lambda >= 80 and, at df 63, power >= 0.9 (computed in `test_power`).
Deliberately broken verifiers (no residual resampling; q not filtered as sampled) must
fail the same test. The default scheduling (production lengths, a round that skips drafting; for
a drafter without a confidence head, its fixed length and the "acceptance" skip rule) is tested the
same way on the second and third tokens, which mix both sources.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dspark_jax.decoding.sampling import SamplingParams, sampling_probs
from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.testing.tiny import tiny_config, tiny_drafter, tiny_target
from tests import broken

N = 50_000
ALPHA = 1e-4
PROMPT = [2, 2, 7, 5]
G = 2
SETTINGS = {
    "t1": SamplingParams(1.0, 0, 1.0),
    "t07_p08_k20": SamplingParams(0.7, 20, 0.8),
    "t07_p08_k3": SamplingParams(0.7, 3, 0.8),
}


@pytest.fixture(scope="module")
def target():
    # logit scale 0.5: peaked enough to differ from the drafters, flat enough that top-p 0.8 keeps several tokens
    return tiny_target(tiny_config(vocab_size=8, hidden_size=16, num_layers=2), logit_scale=0.5)


@pytest.fixture(scope="module")
def drafters(target):
    return {"dspark": tiny_drafter("dspark", target, gamma=G),
            "bad": tiny_drafter("dspark", target, gamma=G, bad=True, seed=5),
            "rnn": tiny_drafter("dspark", target, gamma=G, head_type="rnn", seed=7),
            "dflash": tiny_drafter("dflash", target, gamma=G),
            "eagle3": tiny_drafter("eagle3", target),
            "mtp1": tiny_drafter("mtp1", target)}


_ENGINES = {}


def engine(target, drafter, verifier="exact"):
    """One engine per parameter structure and verifier; drafters of the same structure swap weights."""
    key = (type(drafter).__name__, getattr(drafter, "head_type", None), getattr(drafter, "mode", None),
           getattr(getattr(drafter, "dcfg", None), "kind", None), verifier)
    if key not in _ENGINES:
        kw = {}
        if verifier == "no_residual":
            kw["verify"] = broken.verify_no_residual
        elif verifier == "unfiltered_q":
            kw["kind"] = broken.UnfilteredQ()
        cfg = dict(gamma=G, layer_ids=(0,)) if type(drafter).__name__ == "Eagle3Drafter" else {}
        config = EngineConfig(policy="fixed", num_slots=N, max_len=len(PROMPT) + 2 + G + 2, buckets=(N * (G + 1),),
                              prefill_buckets=(len(PROMPT),), **cfg)
        _ENGINES[key] = Engine(target, drafter, config, **kw)
    eng = _ENGINES[key]
    eng.dp = drafter.arrays()
    return eng


def reference(target, sp: SamplingParams) -> np.ndarray:
    """Exact P(x1, x2) [V, V] under the target with the sampling transform."""
    V = target.cfg.vocab_size
    seqs = jnp.asarray([PROMPT + [a] for a in range(V)])
    logits = target(seqs).logits
    p1 = sampling_probs(logits[0, len(PROMPT) - 1], *sp)
    p2 = sampling_probs(logits[:, len(PROMPT)], *sp)
    return np.asarray(p1[:, None] * p2, np.float64)


def sample_cells(target, drafter, sp, verifier="exact", seed=0) -> np.ndarray:
    eng = engine(target, drafter, verifier)
    res = eng.generate([PROMPT] * N, max_new_tokens=2, sampling=sp, seed=seed)
    toks = np.asarray([r.tokens for r in res.results])
    assert toks.shape == (N, 2)
    V = target.cfg.vocab_size
    return np.bincount(toks[:, 0] * V + toks[:, 1], minlength=V * V).reshape(V, V)


def chi2_pvalue(counts, probs) -> float:
    p, c = probs.ravel(), counts.ravel()
    if np.any(c[p <= 0] > 0):
        return 0.0  # an impossible pair occurred
    nz = p > 0
    if nz.sum() < 2:
        raise AssertionError("degenerate reference (one possible outcome): the test would prove nothing")
    exp = p[nz] * c.sum()
    x2 = float(np.sum((c[nz] - exp) ** 2 / exp))
    return float(stats.chi2.sf(x2, int(nz.sum()) - 1))


def test_power():
    """The stated design: N = 5e4, alpha = 1e-4, TV 0.02 over 63 df is detected with power >= 0.9."""
    df, lam = 63, N * (2 * 0.02) ** 2
    crit = stats.chi2.isf(ALPHA, df)
    assert stats.ncx2.sf(crit, df, lam) > 0.9


CASES = [("dspark", "t1"), ("bad", "t1"), ("dflash", "t1"), ("eagle3", "t1"), ("mtp1", "t1"),
         ("dspark", "t07_p08_k20"), ("mtp1", "t07_p08_k20"),
         ("dspark", "t07_p08_k3"), ("bad", "t07_p08_k3"), ("eagle3", "t07_p08_k3"), ("rnn", "t07_p08_k3")]


@pytest.mark.parametrize("kind,setting", CASES)
def test_distribution_matches_target(target, drafters, kind, setting):
    sp = SETTINGS[setting]
    counts = sample_cells(target, drafters[kind], sp)
    pv = chi2_pvalue(counts, reference(target, sp))
    assert pv > ALPHA, f"{kind} @ {setting}: p-value {pv:.2e}"


# The default scheduling (`EngineConfig(policy="auto")`: DSpark's production scheduler on its
# survivals and the "known" skip rule) on a table where a draft costs 1.2 target steps and
# verifying every slot's block costs 5 % more than one token a slot, so that all-accepted drafts
# would pay (3 tokens for 2.25 steps) and these drafters' survivals do not. Round 0 drafts (nothing
# is known yet; the production scheduler's capacity before any survival is known admits every
# block: admission that varies is tests/engine/test_lossless_scheduler.py's), and later rounds skip
# drafting (target-only steps). Of the 3 new tokens, a request takes x2 and x3 from round 0, x3
# from a skipped step, or both from skipped steps, by how many drafts round 0 accepted: the
# cells (x2, x3) mix all three.
DEFAULT_BUCKETS = (N, N * (G + 1))
DEFAULT_T_VERIFY = (1.0, 1.05)


def default_engine(target, drafter, verifier="exact"):
    key = ("default", id(drafter), verifier)
    if key not in _ENGINES:
        kw = {"verify": broken.verify_no_residual} if verifier == "no_residual" else {}
        config = EngineConfig(num_slots=N, max_len=len(PROMPT) + 3 + G + 2, buckets=DEFAULT_BUCKETS,
                              prefill_buckets=(len(PROMPT),))
        _ENGINES[key] = Engine(target, drafter, config, **kw)
    return _ENGINES[key]


def reference_x2_x3(target, sp: SamplingParams) -> np.ndarray:
    """Exact P(x2, x3) [V, V] under the target with the sampling transform (x1 summed out)."""
    V = target.cfg.vocab_size
    p1 = sampling_probs(target(jnp.asarray([PROMPT])).logits[0, -1], *sp)
    p2 = sampling_probs(target(jnp.asarray([PROMPT + [a] for a in range(V)])).logits[:, -1], *sp)  # [x1, x2]
    seqs = jnp.asarray([PROMPT + [a, b] for a in range(V) for b in range(V)])
    p3 = sampling_probs(target(seqs).logits[:, -1], *sp).reshape(V, V, V)  # [x1, x2, x3]
    return np.asarray(jnp.einsum("a,ab,abc->bc", p1, p2, p3), np.float64)


def sample_default_cells(target, drafter, sp, verifier="exact", t_draft=1.2) -> tuple[np.ndarray, np.ndarray, dict]:
    """(x2, x3) counts [V, V], the rounds each request took, and the traces, under the default
    scheduling on the table above (a draft priced `t_draft` target steps)."""
    from dspark_jax.scheduler.prefix import make_table

    eng = default_engine(target, drafter, verifier)
    table = make_table(DEFAULT_BUCKETS, t_verify=DEFAULT_T_VERIFY, t_draft=t_draft)
    res = eng.generate([PROMPT] * N, max_new_tokens=3, sampling=sp, seed=0, table=table, traces=True)
    toks = np.asarray([r.tokens for r in res.results])
    assert toks.shape == (N, 3)
    V = target.cfg.vocab_size
    counts = np.bincount(toks[:, 1] * V + toks[:, 2], minlength=V * V).reshape(V, V)
    return counts, np.asarray([r.rounds for r in res.results]), res.traces.arrays()


def test_default_scheduling_with_a_skipped_round_matches_target(target, drafters):
    sp = SETTINGS["t1"]
    counts, rounds, tr = sample_default_cells(target, drafters["dspark"], sp)
    drafted = {int(r) for r in np.unique(tr["round"]) if (tr["conf_logits"][tr["round"] == r] != 0).any()}
    assert drafted == {0} and len(np.unique(tr["round"])) == 3  # round 0 drafted, rounds 1 and 2 skipped
    assert np.all(tr["length"][tr["round"] > 0] == 0)
    # informative: every mix of sources is common (1 round: all from round 0; 2: x3 skipped; 3: x2, x3 skipped)
    share = np.bincount(rounds, minlength=4)[1:] / N
    assert np.all(share > 0.05), share
    pv = chi2_pvalue(counts, reference_x2_x3(target, sp))
    assert pv > ALPHA, f"default scheduling @ t1: p-value {pv:.2e}"


def test_default_scheduling_of_a_drafter_without_confidence_matches_target(target, drafters):
    """DFlash's default: its fixed length and the "acceptance" skip rule, which decides on the
    acceptance of the rounds verified so far. A draft priced 1.8 steps: all-accepted drafts would
    pay (3 tokens for 2.85 steps), this drafter's acceptance does not (its two drafts would have to
    be accepted 1.85 times a round). Round 0 drafts (no acceptance known), rounds 1 and 2 skip on
    round 0's acceptance; the cells mix both sources as above. (With the verifier that resamples
    from p instead of the residual, the same sampling gives a p-value of about 1e-93.)"""
    sp = SETTINGS["t1"]
    counts, rounds, tr = sample_default_cells(target, drafters["dflash"], sp, t_draft=1.8)
    eng = default_engine(target, drafters["dflash"])
    assert eng.scheduling == "fixed, skip rule acceptance"
    assert np.all(tr["length"][tr["round"] == 0] == G) and len(np.unique(tr["round"])) == 3
    assert np.all(tr["length"][tr["round"] > 0] == 0)  # rounds 1 and 2 skipped drafting
    share = np.bincount(rounds, minlength=4)[1:] / N
    assert np.all(share > 0.05), share
    pv = chi2_pvalue(counts, reference_x2_x3(target, sp))
    assert pv > ALPHA, f"default scheduling of DFlash @ t1: p-value {pv:.2e}"


def test_default_scheduling_with_the_broken_verifier_fails(target, drafters):
    sp = SETTINGS["t1"]
    counts, _, _ = sample_default_cells(target, drafters["dspark"], sp, verifier="no_residual")
    pv = chi2_pvalue(counts, reference_x2_x3(target, sp))
    assert pv < ALPHA, f"resampling from p instead of the residual went undetected (p-value {pv:.3f})"


def test_broken_no_residual_fails(target, drafters):
    sp = SETTINGS["t1"]
    pv = chi2_pvalue(sample_cells(target, drafters["dspark"], sp, verifier="no_residual"), reference(target, sp))
    assert pv < ALPHA, f"resampling from p instead of the residual went undetected (p-value {pv:.3f})"


def test_broken_unfiltered_q_fails(target, drafters):
    sp = SETTINGS["t07_p08_k3"]
    pv = chi2_pvalue(sample_cells(target, drafters["dspark"], sp, verifier="unfiltered_q"), reference(target, sp))
    assert pv < ALPHA, f"verifying with the unfiltered q went undetected (p-value {pv:.3f})"
