"""Exact greedy acceptance without speculative decoding (docs/method.md §5.1).

At T = 0 speculative decoding commits exactly the target's greedy continuation y of a prompt,
whatever the drafter, and a round anchored at position p accepts the longest prefix of its drafts
that equals y after p. Up to that first difference the drafter's inputs are y's own tokens, so
the drafts of every anchor come from one teacher-forced pass over prompt + y
(`DrafterKind.forced_drafts`), and the rounds follow by a scan: a round keeps its accepted drafts
and the target's next token, and the next anchor is the last token kept. One greedy generation
per prompt serves every drafter; the result is the engine's per-round trace, round by round.

At T > 0 the same pass over one sampled continuation gives, at every anchor, each slot's
acceptance probability 1 - TV(q_j, p_j) with the slots before it teacher forced (the soft label
of the training loss); for slot 0 that is exactly the engine's probability of accepting a draft
there. The expected accepted length of a block, sum_j prod_{i<=j} of them, averaged over anchors,
estimates tau (`expected_acceptance`): an estimate, since a round's later slots follow the drafts
it sampled rather than the continuation, and rounds start at some anchors and not others.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.decoding.sampling import SamplingParams, probs_from_params
from dspark_jax.drafter.losses import soft_label
from dspark_jax.drafter.registry import kind_of
from dspark_jax.engine import Engine, EngineConfig

__all__ = ["GREEDY", "greedy_continuations", "accepted_at", "forced_rounds", "forced_traces",
           "expected_acceptance"]

log = logging.getLogger(__name__)
GREEDY = SamplingParams(0.0, 0, 1.0)
_PAD = 32  # sequence and anchor counts are padded to multiples of this: few compiled shapes


def greedy_continuations(target, prompts, *, max_new_tokens: int, stop_ids=(), num_slots: int = 8,
                         sampling: SamplingParams = GREEDY, seed: int = 0, mesh=None) -> list[list[int]]:
    """The target's continuation of each prompt (a stop token ends it and is kept) by the engine
    without a drafter: at T = 0 the tokens greedy speculative decoding commits with any drafter;
    with `sampling` at T > 0, one draw per prompt."""
    s = max(len(p) for p in prompts) + max_new_tokens + 2
    eng = Engine(target, None, EngineConfig(num_slots=min(num_slots, len(prompts)), max_len=s), mesh=mesh)
    res = eng.generate(prompts, max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids, seed=seed)
    return [list(r.tokens) for r in res.results]


def accepted_at(drafts: np.ndarray, seq: np.ndarray, anchors: np.ndarray) -> np.ndarray:
    """[A]: how many of anchor p's drafts (drafts [A, G]) equal seq[p + 1], seq[p + 2], ... in a row
    (a draft past the end of seq never matches)."""
    a, g = drafts.shape
    idx = anchors[:, None] + 1 + np.arange(g)[None]
    truth = np.where(idx < len(seq), seq[np.minimum(idx, len(seq) - 1)], -1)
    return np.cumprod(drafts == truth, axis=1).sum(axis=1)


def forced_rounds(accepted: np.ndarray, n_new: int) -> dict[str, np.ndarray]:
    """The rounds of one request from `accepted` [n_new] (the accepted drafts of the round anchored
    at the i-th token before each new one: index 0 is the prompt's last token). A round keeps
    min(accepted + 1, tokens still to come); one that keeps fewer than it verified is `cut` (its
    discarded drafts are not rejections). -> {"start": index of each round's anchor, "accepted":
    drafts kept, "cut"}, as the engine records them."""
    start, kept_acc, cut = [], [], []
    i = 0
    while i < n_new:
        a = int(accepted[i])
        kept = min(a + 1, n_new - i)
        start.append(i)
        kept_acc.append(kept - 1)
        cut.append(kept < a + 1)
        i += kept
    return {"start": np.asarray(start, np.int64), "accepted": np.asarray(kept_acc, np.int64),
            "cut": np.asarray(cut, bool)}


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _drafts(kind, shape, graph, tparams, dparams, tokens, anchors):
    target = nnx.merge(graph, tparams)
    out = target(tokens, feature_layers=shape.feature_layers, return_logits=False)
    return kind.forced_drafts(dparams, shape, out, tokens, anchors)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 7))
def _rates(kind, shape, graph, tparams, dparams, tokens, anchors, sampling):
    """[B, A, G]: 1 - TV between the drafter's and the target's sampling distributions per slot."""
    target = nnx.merge(graph, tparams)
    out = target(tokens, feature_layers=shape.feature_layers, return_logits=True)
    q = probs_from_params(kind.forced_logits(dparams, shape, out, tokens, anchors), sampling)
    rows = anchors[..., None] + jnp.arange(shape.G)  # slot j of anchor p is checked on the target's row p + j
    p_logits = jnp.take_along_axis(out.logits, rows.reshape(rows.shape[0], -1)[..., None], axis=1)
    p = probs_from_params(p_logits.reshape(q.shape), sampling)
    return soft_label(q, p)


def _round_up(n: int) -> int:
    return -(-n // _PAD) * _PAD


def _parts(target, drafter, gamma, layer_ids):
    kind = kind_of(drafter)
    shape = kind.draft_shape(drafter, target.cfg, gamma, layer_ids)
    graph, tparams = nnx.split(target)
    return kind, shape, graph, tparams, drafter.arrays()


def _padded(r: int, prompt, seq: np.ndarray, m: int, G: int, kind):
    """The sequence and its m anchors (the prompt's last token and the new tokens but the last),
    padded to few shapes: pad tokens come after every token the anchors read, pad anchors repeat
    the last."""
    n = len(prompt)
    if n < max(kind.min_prompt_len, 2):
        raise ValueError(f"prompt {r} has {n} tokens; teacher-forced evaluation needs at least 2")
    anchors = n - 1 + np.arange(m)
    tok = np.zeros((1, _round_up(len(seq) + G)), np.int32)
    tok[0, : len(seq)] = seq
    anc = np.full((1, _round_up(m)), anchors[-1], np.int32)
    anc[0, :m] = anchors
    return jnp.asarray(tok), jnp.asarray(anc), anchors


def forced_traces(target, drafter, prompts, continuations, *, gamma: int | None = None, layer_ids=None,
                  progress=None) -> dict:
    """Per-round traces of greedy speculative decoding of `prompts` (each continued by its greedy
    continuation) with `drafter`, computed by teacher forcing: the arrays of `Traces.arrays()`
    (request, round, conf_logits, length, accepted, full, cut) plus per-request "accepted" and
    "rounds" totals, as `Engine.generate` reports them."""

    kind, shape, graph, tparams, dparams = _parts(target, drafter, gamma, layer_ids)
    rows = {k: [] for k in ("request", "round", "conf_logits", "length", "accepted", "cut")}
    per_req_acc, per_req_rounds = [], []
    for r, (prompt, cont) in enumerate(zip(prompts, continuations)):
        seq = np.asarray(list(prompt) + list(cont), np.int32)
        m = len(cont)
        tok, anc, anchors = _padded(r, prompt, seq, m, shape.G, kind)
        drafts, z = _drafts(kind, shape, graph, tparams, dparams, tok, anc)
        drafts, z = np.asarray(drafts[0, :m]), np.asarray(z[0, :m], np.float32)
        rounds = forced_rounds(accepted_at(drafts, seq, anchors), m)
        k = len(rounds["start"])
        rows["request"].append(np.full(k, r))
        rows["round"].append(np.arange(k))
        rows["conf_logits"].append(z[rounds["start"]])
        rows["length"].append(np.full(k, shape.G))
        rows["accepted"].append(rounds["accepted"])
        rows["cut"].append(rounds["cut"])
        per_req_acc.append(int(rounds["accepted"].sum()))
        per_req_rounds.append(k)
        if progress is not None:
            progress(1)
    out = {k: np.concatenate(v) if v else np.zeros((0,)) for k, v in rows.items()}
    out["full"] = (out["length"] == shape.G) & ~out["cut"]
    return {**out, "request_accepted": np.asarray(per_req_acc), "request_rounds": np.asarray(per_req_rounds),
            "gamma": shape.G}


def expected_acceptance(target, drafter, prompts, continuations, sampling: SamplingParams, *,
                        gamma: int | None = None, layer_ids=None, progress=None) -> dict:
    """Per request, along its continuation (drawn at `sampling`): "rates" [anchors, G] (each slot's
    acceptance probability with the slots before it teacher forced; NaN where the slot's token lies
    past the continuation), "expected_accepted" [anchors] (sum_j prod_{i<=j} rate_i over whole
    blocks) and "tau" (1 + their mean). See the module doc for what is exact and what estimated."""
    kind, shape, graph, tparams, dparams = _parts(target, drafter, gamma, layer_ids)
    out = []
    for r, (prompt, cont) in enumerate(zip(prompts, continuations)):
        seq = np.asarray(list(prompt) + list(cont), np.int32)
        m = len(cont)
        tok, anc, anchors = _padded(r, prompt, seq, m, shape.G, kind)
        c = np.asarray(_rates(kind, shape, graph, tparams, dparams, tok, anc, sampling)[0, :m], np.float64)
        inside = anchors[:, None] + 1 + np.arange(shape.G)[None] < len(seq)
        whole = inside.all(axis=1)
        acc = np.cumprod(c, axis=1).sum(axis=1)
        out.append({"rates": np.where(inside, c, np.nan), "expected_accepted": acc[whole],
                    "tau": float(1.0 + acc[whole].mean()) if whole.any() else float("nan")})
        if progress is not None:
            progress(1)
    return {"requests": out, "gamma": shape.G}
