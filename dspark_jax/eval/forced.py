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
from dspark_jax.target.forward import ForwardOut

__all__ = ["GREEDY", "greedy_continuations", "accepted_at", "forced_rounds", "forced_traces",
           "expected_acceptance"]

log = logging.getLogger(__name__)
GREEDY = SamplingParams(0.0, 0, 1.0)
_PAD = 64  # sequence and anchor counts are padded to multiples of this: few compiled shapes


def greedy_continuations(target, prompts, *, max_new_tokens: int, stop_ids=(), num_slots: int = 32,
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


@functools.partial(jax.jit, static_argnums=(0, 2, 3))
def _target_pass(graph, tparams, feature_layers, return_logits, tokens):
    """The target's features (of every layer any drafter reads), hidden and logits over whole sequences."""
    return nnx.merge(graph, tparams)(tokens, feature_layers=feature_layers, return_logits=return_logits)


def _view(out, layers: tuple[int, ...], shape) -> ForwardOut:
    """The target pass as one drafter reads it: its own feature layers, in its order (traced inside
    the drafter's program, so the gather fuses there)."""
    idx = [layers.index(i) for i in shape.feature_layers]
    feats = out.features[:, :, jnp.asarray(idx)] if idx else None
    return ForwardOut(logits=out.logits, hidden=out.hidden, features=feats, cache=None)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _drafts(kind, shape, layers, dparams, out, tokens, anchors):
    return kind.forced_drafts(dparams, shape, _view(out, layers, shape), tokens, anchors)


@functools.partial(jax.jit, static_argnums=(1,))
def _target_probs(logits, sampling):
    """[B, L, V]: the target's sampling distribution at every position, once per prompt for every
    drafter and slot (each (anchor, slot) pair reads one of these rows; top-k / top-p sort the
    vocabulary, so normalising per pair would take about gamma times the work)."""
    return probs_from_params(logits, sampling)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 8))
def _rates(kind, shape, layers, dparams, out, p_all, tokens, anchors, sampling):
    """[B, A, G]: 1 - TV between the drafter's and the target's sampling distributions per slot."""
    out = _view(out, layers, shape)
    q = probs_from_params(kind.forced_logits(dparams, shape, out, tokens, anchors), sampling)
    rows = anchors[..., None] + jnp.arange(shape.G)  # slot j of anchor p is checked on the target's row p + j
    p = jnp.take_along_axis(p_all, rows.reshape(rows.shape[0], -1)[..., None], axis=1)
    return soft_label(q, p.reshape(q.shape))


def _round_up(n: int) -> int:
    return -(-n // _PAD) * _PAD


def _parts(target, drafters: dict, gamma, layer_ids):
    """Per drafter (kind, shape, arrays), the target's graph and weights, and the union of the
    drafters' feature layers (one target pass serves them all)."""
    parts = {}
    for name, d in drafters.items():
        kind = kind_of(d)
        parts[name] = (kind, kind.draft_shape(d, target.cfg, gamma, layer_ids), d.arrays())
    graph, tparams = nnx.split(target)
    layers = tuple(sorted({i for _, shape, _ in parts.values() for i in shape.feature_layers}))
    return parts, graph, tparams, layers


def _padded(r: int, prompt, seq: np.ndarray, m: int, G: int, min_prompt_len: int):
    """The sequence and its m anchors (the prompt's last token and the new tokens but the last),
    padded to few shapes: pad tokens come after every token the anchors read, pad anchors repeat
    the last."""
    n = len(prompt)
    if n < max(min_prompt_len, 2):
        raise ValueError(f"prompt {r} has {n} tokens; teacher-forced evaluation needs at least 2")
    anchors = n - 1 + np.arange(m)
    tok = np.zeros((1, _round_up(len(seq) + G)), np.int32)
    tok[0, : len(seq)] = seq
    anc = np.full((1, _round_up(m)), anchors[-1], np.int32)
    anc[0, :m] = anchors
    return jnp.asarray(tok), jnp.asarray(anc), anchors


def _sequences(prompts, continuations, parts: dict):
    """(request, seq, tokens, anchors padded, anchors) per prompt, padded for the widest block."""
    G = max(shape.G for _, shape, _ in parts.values())
    need = max(kind.min_prompt_len for kind, _, _ in parts.values())
    for r, (prompt, cont) in enumerate(zip(prompts, continuations)):
        seq = np.asarray(list(prompt) + list(cont), np.int32)
        yield (r, seq, *_padded(r, prompt, seq, len(cont), G, need))


def forced_traces(target, drafters: dict, prompts, continuations, *, gamma: int | None = None, layer_ids=None,
                  progress=None) -> dict[str, dict]:
    """{name: per-round traces} of greedy speculative decoding of `prompts` (each continued by its
    greedy continuation) with each of `drafters` ({name: drafter}), by teacher forcing, one target
    pass per prompt for all of them: the arrays of `Traces.arrays()` (request, round, conf_logits,
    length, accepted, full, cut) plus per-request "request_accepted" and "request_rounds" totals,
    as `Engine.generate` reports them, and "gamma"."""
    parts, graph, tparams, layers = _parts(target, drafters, gamma, layer_ids)
    keys = ("request", "round", "conf_logits", "length", "accepted", "cut", "request_accepted", "request_rounds")
    rows = {name: {k: [] for k in keys} for name in drafters}
    for r, seq, tok, anc, anchors in _sequences(prompts, continuations, parts):
        m = len(anchors)
        out = _target_pass(graph, tparams, layers, False, tok)
        for name, (kind, shape, dparams) in parts.items():
            drafts, z = _drafts(kind, shape, layers, dparams, out, tok, anc)
            drafts, z = np.asarray(drafts[0, :m]), np.asarray(z[0, :m], np.float32)
            rounds = forced_rounds(accepted_at(drafts, seq, anchors), m)
            k, into = len(rounds["start"]), rows[name]
            for key, v in (("request", np.full(k, r)), ("round", np.arange(k)), ("conf_logits", z[rounds["start"]]),
                           ("length", np.full(k, shape.G)), ("accepted", rounds["accepted"]), ("cut", rounds["cut"]),
                           ("request_accepted", [int(rounds["accepted"].sum())]), ("request_rounds", [k])):
                into[key].append(np.asarray(v))
        if progress is not None:
            progress(1)
    out = {}
    for name, (_, shape, _) in parts.items():
        t = {k: np.concatenate(v) for k, v in rows[name].items()}
        out[name] = {**t, "full": (t["length"] == shape.G) & ~t["cut"], "gamma": shape.G}
    return out


def expected_acceptance(target, drafters: dict, prompts, continuations, sampling: SamplingParams, *,
                        gamma: int | None = None, layer_ids=None, progress=None) -> dict[str, dict]:
    """{name: {"requests": [...], "gamma"}}: per request, along its continuation (drawn at
    `sampling`), "rates" [anchors, G] (each slot's acceptance probability with the slots before it
    teacher forced; NaN where the slot's token lies past the continuation), "expected_accepted"
    [anchors] (sum_j prod_{i<=j} rate_i over whole blocks) and "tau" (1 + their mean). One target
    pass per prompt serves every drafter. See the module doc for what is exact and what estimated."""
    parts, graph, tparams, layers = _parts(target, drafters, gamma, layer_ids)
    res = {name: {"requests": [], "gamma": shape.G} for name, (_, shape, _) in parts.items()}
    for r, seq, tok, anc, anchors in _sequences(prompts, continuations, parts):
        m = len(anchors)
        out = _target_pass(graph, tparams, layers, True, tok)
        p_all = _target_probs(out.logits, sampling)
        for name, (kind, shape, dparams) in parts.items():
            c = np.asarray(_rates(kind, shape, layers, dparams, out, p_all, tok, anc, sampling)[0, :m], np.float64)
            inside = anchors[:, None] + 1 + np.arange(shape.G)[None] < len(seq)
            whole = inside.all(axis=1)
            acc = np.cumprod(c, axis=1).sum(axis=1)
            res[name]["requests"].append({"rates": np.where(inside, c, np.nan), "expected_accepted": acc[whole],
                                          "tau": float(1.0 + acc[whole].mean()) if whole.any() else float("nan")})
        if progress is not None:
            progress(1)
    return res
