"""The engine's output distribution equals the target's (docs/method.md §5), checked by a chi-square test.

Tiny target with vocabulary 8, one 4-token prompt, N = 50,000 independent requests run
as N slots of one engine (each with its own key; 2e5 would quadruple the CPU time). Cells: the
first two generated tokens (64 cells; cells of zero target probability must stay empty). Reference: exact
enumeration of the target's (transformed) next-token distributions. Test: Pearson
chi-square at significance alpha = 1e-4 (df = non-zero cells - 1). Power: for a
deviation of total variation d, the noncentrality is >= N * (2d)^2 (Cauchy-Schwarz), so
TV 0.02 gives lambda >= 80 and, at df 63, power >= 0.9 (computed in `test_power`).
Deliberately broken verifiers (no residual resampling; q not filtered as sampled) must
fail the same test.
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


def test_broken_no_residual_fails(target, drafters):
    sp = SETTINGS["t1"]
    pv = chi2_pvalue(sample_cells(target, drafters["dspark"], sp, verifier="no_residual"), reference(target, sp))
    assert pv < ALPHA, f"resampling from p instead of the residual went undetected (p-value {pv:.3f})"


def test_broken_unfiltered_q_fails(target, drafters):
    sp = SETTINGS["t07_p08_k3"]
    pv = chi2_pvalue(sample_cells(target, drafters["dspark"], sp, verifier="unfiltered_q"), reference(target, sp))
    assert pv < ALPHA, f"verifying with the unfiltered q went undetected (p-value {pv:.3f})"
