"""The compiled pieces: prefill (per prompt-length bucket), one round, and a `lax.while_loop` of rounds.

One round for the whole batch is ONE jitted call. A round that drafts: draft -> prefix
survival -> length policy -> bucket choice -> packed verification (`lax.switch` over the
compiled buckets, so the program is compiled once and only the chosen bucket's branch runs) ->
rejection sampling with per-row keys -> stop / max-length per slot -> KV rollback (a `lengths`
move) -> drafter update (`drafting_round`). A round that does not (`plain_round`) is the
target-only engine's round: each anchor verified alone and its next token sampled from the
target. With `Spec.skip_drafting` the skip rule (`round_choice`: the cost table says no
speculation pays) picks one: a host loop runs the chosen round's own program (`chosen_rounds`),
the compiled loop of rounds one program holding them all (`round_step`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax.decoding.rejection import PackedProbs
from dspark_jax.decoding.sampling import sample, sampling_path, sampling_probs
from dspark_jax.engine.spec import Spec
from dspark_jax.engine.state import (
    FINISH_CONTEXT,
    FINISH_LENGTH,
    FINISH_STOP,
    PIN_POLICY,
    Control,
    DecodeState,
    RoundOut,
)
from dspark_jax.engine.verify import Chunk, verify_forward, write_block
from dspark_jax.scheduler import prefix

__all__ = ["prefill", "prefill_group", "admit", "prefilling", "round_step", "plain_round", "drafting_round",
           "round_choice", "chosen_rounds", "ROUND_PLAIN", "ROUND_SETTLED", "ROUND_DRAFTING", "run_rounds",
           "row_round_keys", "draft", "draft_part"]


# ------------------------------------------------------------------ keys, draft


def row_round_keys(keys, rounds):
    """Per row and round: (draft key, verify key), from the request's key and its own round count."""
    k = jax.vmap(jax.random.fold_in)(keys, rounds.astype(jnp.uint32))
    return jax.vmap(jax.random.fold_in, in_axes=(0, None))(k, 0), jax.vmap(jax.random.fold_in, in_axes=(0, None))(k, 1)


def draft(spec: Spec, drafter_params, st: DecodeState, keys, sampling):
    """The kind's draft -> (tokens [R, G], q [R, G, V], z [R, G], dcache). The sampling path is
    chosen once for the batch, outside the kinds' per-row vmaps (else every row would run all
    of `sampling_probs`' paths, the full-vocabulary sort included)."""
    path = sampling_path(*sampling, spec.tcfg.vocab_size)
    return spec.kind.draft(spec, drafter_params, st.dcache, st.last, st.anchor, st.pos, keys, sampling, path)


def draft_part(spec: Spec, drafter_params, st: DecodeState, sampling):
    """The round's draft alone, with the round's own keys: (tokens [R, G], q [R, G, V], z [R, G])."""
    draft_keys, _ = row_round_keys(st.keys, st.rounds)
    return draft(spec, drafter_params, st, draft_keys, sampling)[:3]


# ------------------------------------------------------------------ prefill


def _join(st: DecodeState, join, plen, anchor, pos, keys, max_new) -> DecodeState:
    """The per-request fields of the slots where `join` [R] is True, for a new request."""
    z = lambda a: jnp.where(join, 0, a)
    return st._replace(
        anchor=jnp.where(join, anchor, st.anchor), pos=jnp.where(join, pos, st.pos),
        active=jnp.where(join, max_new > 0, st.active), keys=jnp.where(join, keys, st.keys),
        rounds=z(st.rounds), acc_sum=z(st.acc_sum), n_gen=z(st.n_gen), finish=z(st.finish),
        max_new=jnp.where(join, max_new, st.max_new), out=jnp.where(join[:, None], 0, st.out),
        plen=jnp.where(join, plen, st.plen), joined=jnp.where(join, st.step, st.joined))


def prefill_group(rows: int, prompt_len: int, max_tokens: int) -> int:
    """Rows a prefill forwards at once: the largest divisor of `rows` whose prompts hold at most
    `max_tokens` tokens (at least one row), so its activations and attention stay a group's,
    not the whole batch's (64 slots x 2048 tokens in one forward asked XLA for 18 GiB a chip)."""
    return max(k for k in range(1, rows + 1) if rows % k == 0 and (k == 1 or k * prompt_len <= max_tokens))


def prefill(spec: Spec, tmodel_apply, target_params, drafter_params, st: DecodeState,
            tokens, plen, join, keys, max_new) -> DecodeState:
    """Start requests in the slots where `join` [R] is True: prompt tokens [R, P] (right padded), lengths plen [R].

    The target forwards x_0..x_{n-2} (the last prompt token becomes the first anchor, forwarded
    by the first round's verification), the drafter context is written from its features. The
    rows go in groups of `prefill_group` rows, one forward each in a loop that skips groups with
    no joining slot; the caches ride in its carry (written in place).
    """
    r, n = tokens.shape
    group = prefill_group(r, n, spec.prefill_tokens)
    col = jnp.arange(n, dtype=jnp.int32)[None]
    valid = (col < plen[:, None] - 1) & join[:, None]
    lengths = jnp.where(join, plen - 1, 0)

    def forward_rows(cache, dcache, last, slots):
        """Rows `slots` [K] (None: all R) forwarded into the caches."""
        pick = (lambda a: a) if slots is None else (lambda a: a[slots])
        tok = pick(tokens)
        k = tok.shape[0]
        fo = tmodel_apply(tok, jnp.broadcast_to(col, (k, n)), pick(valid), cache, spec.feature_layers, slots)
        if spec.kind is not None:
            rows = jnp.arange(r, dtype=jnp.int32) if slots is None else slots
            dcache, last = spec.kind.prefill(spec, drafter_params, dcache, last, fo.features, fo.hidden, tok,
                                             jnp.zeros((k,), jnp.int32), pick(lengths), rows)
        return fo.cache, dcache, last

    if group == r:
        cache, dcache, last = forward_rows(st.cache, st.dcache, st.last, None)
    else:
        def one_group(g, carry):
            slots = g * group + jnp.arange(group, dtype=jnp.int32)
            return jax.lax.cond(join[slots].any(), lambda c: forward_rows(*c, slots), lambda c: c, carry)

        cache, dcache, last = jax.lax.fori_loop(0, r // group, one_group, (st.cache, st.dcache, st.last))
    cache = cache.with_lengths(jnp.where(join, plen - 1, st.cache.lengths))
    anchor = tokens[jnp.arange(r), jnp.clip(plen - 1, 0, n - 1)]
    st = st._replace(cache=cache, dcache=dcache, last=last)
    return _join(st, join, plen, anchor, plen - 1, keys, max_new)


def admit(st: DecodeState, tokens, plen, join, keys, max_new) -> DecodeState:
    """Start requests in the slots where `join` is True without forwarding them: their prompts
    (tokens [R, S] int32, right padded, the state's `prompt` shape) go into the state, and the
    rounds forward them in chunks beside the other slots' verification (`prefill_chunk`), so a
    long prompt stalls nobody."""
    r, n = tokens.shape
    anchor = tokens[jnp.arange(r), jnp.clip(plen - 1, 0, n - 1)]
    st = st._replace(prompt=jnp.where(join[:, None], tokens, st.prompt),
                     cache=st.cache.with_lengths(jnp.where(join, 0, st.cache.lengths)))
    return _join(st, join, plen, anchor, jnp.zeros_like(plen), keys, max_new)


def prefilling(st: DecodeState):
    """Slots whose prompt is still being forwarded in chunks (the last prompt token is the
    first anchor: a slot decodes once pos == plen - 1)."""
    return st.active & (st.pos < st.plen - 1)


def _chunk(spec: Spec, st: DecodeState, filling):
    """This round's prompt chunks: up to `prefill_rows` prefilling slots, the earliest joined
    first, take up to `prefill_chunk` tokens in all (the compiled buckets always hold a whole
    chunk beside a full verification block: `engine.with_chunk_room`) -> (Chunk, tokens taken
    per row [K])."""
    r, s = st.prompt.shape
    k, c = spec.prefill_rows, spec.prefill_chunk
    order = jnp.argsort(jnp.where(filling, st.joined, jnp.iinfo(jnp.int32).max), stable=True)[:k].astype(jnp.int32)
    live = filling[order]
    want = jnp.where(live, jnp.minimum(st.plen[order] - 1 - st.pos[order], c), 0)
    take = jnp.clip(c - (jnp.cumsum(want) - want), 0, want).astype(jnp.int32)
    start = st.pos[order]
    col = jnp.arange(c, dtype=jnp.int32)[None]
    tokens = st.prompt[order[:, None], jnp.minimum(start[:, None] + col, s - 1)]
    return Chunk(tokens, start, col < take[:, None], jnp.where(live, order, r)), take


# ------------------------------------------------------------------ one round


def _stop_truncate(out, n_out, stop_ids):
    pos = jnp.arange(out.shape[1])[None]
    is_stop = jnp.any(out[..., None] == stop_ids[:, None, :], axis=-1) & (pos < n_out[:, None])  # per-row stop ids
    hit = jnp.any(is_stop, axis=1)
    return jnp.where(hit, jnp.argmax(is_stop, axis=1) + 1, n_out).astype(jnp.int32), hit


def _known(a, act):
    """Survivals exist (>= 0) for every active slot."""
    return jnp.all((a >= 0.0) | ~act[:, None])


def _borrowed(a, act):
    """Survivals [R, G] for the skip rule: an active slot without its own yet (it joined since the
    last drafted round) takes the mean of the active slots that have them, so a join at a load
    where drafting does not pay forces no drafting round (one that also carries the other joins'
    prompt chunks in a large bucket: docs/serving.md, the SmolLM2 section). With no slot known
    the survivals stay unknown (-1) and the round drafts to learn them."""
    has = jnp.all(a >= 0.0, axis=1) & act
    mean = jnp.sum(jnp.where(has[:, None], a, 0.0), axis=0) / jnp.maximum(jnp.sum(has), 1)
    return jnp.where((act & ~has)[:, None] & jnp.any(has), mean[None], a)


def _settled(st: DecodeState, act):
    """A settled "no" holds: the last probe's survivals said no by more than their sampling error
    (`probe_gap` = -n, n the slots then decoding) and at least as many slots decode now."""
    return (st.probe_gap < 0) & (jnp.sum(act) >= -st.probe_gap)


def _verdict(spec: Spec, a, act, ctl: Control) -> prefix.Verdict:
    """Every skip verdict on survivals `a` from one pass (`prefix.verdict`)."""
    return prefix.verdict(jnp.maximum(a, 0.0), act, ctl.table, mode=spec.theta, cost="step")


def _skip_decision(spec: Spec, st: DecodeState, act, ctl: Control, max_tokens: int):
    """(drafts, settled) for this round. "best_case": draft when some admission count beats plain
    decoding even with every draft accepted. "known": also on the last known survivals (past
    rounds only, so lossless), except after `probe_gap` skipped rounds (or with no survivals yet),
    when the round drafts to refresh them (a slot that joined since takes the others' survivals:
    `_borrowed`); no probe while a settled "no" holds (`_settled`, or
    the known survivals scaled by the most the realised acceptance may be say no at this load). A
    round that may lose (the lower bound of its gain on the known survivals, `prefix.drafting_gain`,
    is negative: a probe, or a "yes" within its sampling error) drafts only while `probe_credit`,
    what earlier drafted rounds saved, covers that loss; a round where no slot has survivals yet
    drafts.
    "acceptance": the same on the survivals of the past rounds' acceptance (`_running_verdict`),
    for drafters without a confidence head; known once `prefix.RUNNING_MIN_ROWS` rows verified.
    `settled` (rules on survivals): the round skips and expects no draft at this load (the best
    case does not pay, a settled "no" holds, or the credit does not cover the next draft), so it
    need not keep the drafter's context. Plain decoding is priced as what a round without a draft
    costs (`prefix.plain_time`)."""
    best = prefix.speculation_pays(jnp.sum(act), ctl.table, max_tokens, mode=spec.theta, cost="interp")
    if not spec.reads_survivals:
        return best, jnp.bool_(False)
    if spec.skip_drafting == "acceptance":
        known = st.run_counts[0, 0] >= prefix.RUNNING_MIN_ROWS
        settled = _settled(st, act)
        v = _running_verdict(spec, st.run_counts, act, ctl)
    else:
        a_known = _borrowed(st.a_hist[0], act)
        known = _known(a_known, act)
        # a "no" on the realised acceptance holds at any load where the known survivals, scaled by
        # the most it may be, still say no (`_probe_schedule`): no probe needs to ask again
        most = _acceptance_ratio(st.calib_expected, st.calib_accepted, prefix.SETTLE_Z)
        settled = _settled(st, act) | ((most < 1.0) & ~_verdict(spec, a_known * most, act, ctl).pays)
        v = _verdict(spec, a_known * _calibration(st), act, ctl)
    funded = (v.low >= 0.0) | (st.probe_credit + v.low >= 0.0)
    probe = (st.since_draft + 1 >= st.probe_gap) & ~settled
    pays = best & (~known | (funded & (probe | v.pays)))
    return pays, ~pays & (~best | settled | ~funded)


def _running_verdict(spec: Spec, counts, act, ctl: Control) -> prefix.Verdict:
    """The verdict on a round of the fixed length (`Control.gamma`) at this load, on the survivals
    of the drafted rounds' acceptance (`prefix.running_survivals`): the "acceptance" rule's. From
    past rounds only, it cannot bias the output (docs/method.md §3)."""
    s, rows = prefix.running_survivals(counts)
    return prefix.fixed_verdict(s, rows, jnp.sum(act), jnp.minimum(ctl.gamma, spec.G), ctl.table, mode=spec.theta,
                                cost="step")


def _count_acceptance(counts, lengths, acc, act):
    """The running counts (`DecodeState.run_counts`) after a drafted round: decayed by
    `prefix.RUNNING_DECAY`, plus per draft position the rows at risk there (verified it, every
    draft before it accepted) and the rows whose draft there was accepted."""
    k = jnp.arange(counts.shape[1])[None]
    at_risk = (k < lengths[:, None]) & (k <= acc[:, None]) & act[:, None]
    accepted = at_risk & (k < acc[:, None])
    return prefix.RUNNING_DECAY * counts + jnp.stack([jnp.sum(at_risk, 0), jnp.sum(accepted, 0)]).astype(jnp.float32)


CALIBRATION_DECAY = 0.9  # weight of a drafted round's counts in the next one's (`_calibration`)


def _acceptance_ratio(expected, accepted, z: float = 0.0):
    """Drafts accepted over drafts the confidence head's survivals expected, with one draft of
    prior each, at most 1; with `z` > 0 the accepted count raised by `z` of its (Poisson)
    standard errors, sqrt(accepted + 1): the most the realised acceptance may be."""
    return jnp.minimum((accepted + 1.0 + z * jnp.sqrt(accepted + 1.0)) / (expected + 1.0), 1.0)


def _calibration(st: DecodeState):
    """The factor (<= 1) the skip rule scales survivals by: drafts accepted over drafts the
    confidence head's survivals expected among those verified, decayed sums over the rounds that
    drafted, with one draft of prior each (1 with no rounds yet). A head trained briefly, or not
    calibrated (no STS fit), can promise several accepted drafts a round where none is accepted:
    the skip rule would then keep drafting at a loss. The length policies read the head's own
    survivals (the paper's scheduler). From past rounds only, it cannot bias the output
    (docs/method.md §3)."""
    return _acceptance_ratio(st.calib_expected, st.calib_accepted)


def _probe_schedule(spec: Spec, st: DecodeState, a, act, ctl: Control, expected, accepted, counts=None):
    """(since_draft, probe_gap, probe_credit) after a round that drafted, on its fresh survivals
    `a` scaled by the realised acceptance (`_acceptance_ratio` of the decayed counts `expected`,
    `accepted`, this round's included): the gap resets when they say speculation pays and
    doubles (up to `probe_max`) when they say it does not. It becomes -n, n the slots decoding
    (no probe while at least n slots decode), when they say no by more than their sampling error
    over the slots (`prefix.settled_no`, two slots or more), or when the drafted rounds accepted
    significantly fewer drafts than the head expected and the survivals scaled by the most the
    acceptance may be (`SETTLE_Z` standard errors above it) still say no: evidence over rounds
    (and requests), which one slot can give. The credit gains what the round saved by its
    scaled survivals (`prefix.drafting_gain`; negative: what it cost). The "acceptance" rule
    reads the running counts `counts` (this round's included; None: the state's) instead: their
    verdict's "no" by more than the estimate's error settles."""
    if not spec.reads_survivals:
        return st.since_draft, st.probe_gap, st.probe_credit
    n = jnp.sum(act).astype(jnp.int32)
    if spec.skip_drafting == "acceptance":
        v = _running_verdict(spec, st.run_counts if counts is None else counts, act, ctl)
        settles = v.settled_no
    else:
        v = _verdict(spec, a * _acceptance_ratio(expected, accepted), act, ctl)
        most = _acceptance_ratio(expected, accepted, prefix.SETTLE_Z)
        settles = v.settled_no | ((most < 1.0) & ~_verdict(spec, a * most, act, ctl).pays)
    backoff = jnp.minimum(2 * jnp.maximum(st.probe_gap, spec.probe_every // 2), spec.probe_max)
    gap = jnp.where(v.pays, spec.probe_every, jnp.where(settles, -n, backoff))
    credit = st.probe_credit + v.gain
    return jnp.zeros_like(st.since_draft), gap.astype(jnp.int32), credit.astype(jnp.float32)


def _width_index(widths, act, lengths):
    """The attention view's width: the narrowest compiled one that holds every row's block."""
    w_need = jnp.max(jnp.where(act, 1 + lengths, 1))
    return jnp.minimum(jnp.searchsorted(jnp.asarray(widths, jnp.int32), w_need, side="left"), len(widths) - 1)


def _widen(vo, t: int):
    """A verification of a narrower [R, w] view, shaped as the full [R, t] block (what the round
    and the drafter read): columns >= w are invalid (zeros; packed index = not packed)."""
    r, w = vo.hidden.shape[:2]
    if w == t:
        return vo
    pad = lambda x, axis: jnp.pad(x, [(0, t - w) if a == axis else (0, 0) for a in range(x.ndim)])
    b = vo.packing.slot.shape[0]
    dest = jnp.pad(vo.packing.dest.reshape(r, w), ((0, 0), (0, t - w)), constant_values=b).reshape(-1)
    return vo._replace(hidden=pad(vo.hidden, 1), features=pad(vo.features, 1), k_new=pad(vo.k_new, 2),
                       v_new=pad(vo.v_new, 2), packing=vo.packing._replace(dest=dest))


def _target_probs(logits, pk, samp, path, r: int, t: int):
    """Target probabilities on the packed rows (logits [B, V], each with its slot's settings) ->
    (p [B, V], dest [R, t]: the packed row of each row's verified tokens)."""
    b = logits.shape[0]  # the bucket's first rows: the block's tokens are packed first
    slot = jnp.minimum(pk.slot[:b], r - 1)  # padding rows take a real slot's settings (never read)
    p = sampling_probs(logits, samp.temperature[slot], samp.top_k[slot], samp.top_p[slot], path=path)  # [B, V]
    return p, jnp.clip(pk.dest, 0, b - 1).reshape(r, t)


def _sample_and_reject(spec: Spec, logits, pk, samp, path, verify_keys, drafts, q, lengths):
    """Per-row rejection of the drafts against the target's probabilities, with per-row keys ->
    (accepted, out tokens [R, G + 1], n_out). Row r reads its own packed rows (`pk.dest`, handed
    over as `PackedProbs`: rejection gathers the probabilities of the drafts and the one row it
    samples from, never `[R, G + 1, V]`); rows beyond its verified length are never read."""
    p, dest = _target_probs(logits, pk, samp, path, lengths.shape[0], spec.G + 1)
    # the drafts' distributions likewise left in place, flat (a row's own [1, G, V] under the vmap
    # had XLA:TPU relay all of q out every round: 1.1 ms of a 64-slot Qwen3-8B round on v6e-8)
    r, g, v = q.shape
    q_flat, q_dest = q.reshape(r * g, v), jnp.arange(r * g, dtype=jnp.int32).reshape(r, g)

    def verify_row(key, d, dest_r, q_dest_r, l_r):  # per-row keys: a request's verification is its own
        acc, out, n = spec.verify(key, d[None], PackedProbs(q_flat, q_dest_r[None]), PackedProbs(p, dest_r[None]),
                                  l_r[None])
        return acc[0], out[0], n[0]

    return jax.vmap(verify_row)(verify_keys, drafts, dest, q_dest, lengths)


def _sample_anchor(logits, pk, samp, path, verify_keys, r: int):
    """Each row's next token drawn from the target at its anchor, with its own key -> [R, 1]."""
    p, dest = _target_probs(logits, pk, samp, path, r, 1)
    return jax.vmap(sample)(verify_keys, p[dest[:, 0]])[:, None]


def _decoding(spec: Spec, st: DecodeState):
    """(filling, act): slots still forwarding their prompt in chunks (they neither draft nor
    verify this round) and the slots that decode."""
    filling = prefilling(st) if spec.prefill_chunk else jnp.zeros_like(st.active)
    return filling, st.active & ~filling


def _bucket(spec: Spec, st: DecodeState, act, lengths, filling, table=None):
    """(chunk, tokens it takes per row, bucket index): the verification's tokens, with prompt
    chunks of prefilling slots filling what the largest bucket leaves. With a cost `table`, the
    compiled bucket it prices cheapest among those that hold them (`prefix.holding_cost`); buckets
    it does not price (chunk-only) only when no priced one holds them."""
    n_tok = jnp.sum(jnp.where(act, 1 + lengths, 0))
    chunk = take = None
    if spec.prefill_chunk:
        chunk, take = _chunk(spec, st, filling)
        n_tok = n_tok + jnp.sum(take)
    buckets = jnp.asarray(spec.buckets, jnp.int32)
    b_idx = jnp.minimum(jnp.searchsorted(buckets, n_tok, side="left"), len(spec.buckets) - 1).astype(jnp.int32)
    if table is not None and len(spec.buckets) > 1:
        priced = jnp.asarray(table.buckets, jnp.int32)
        at = jnp.minimum(jnp.searchsorted(priced, buckets, side="left"), priced.shape[0] - 1)
        t = jnp.where(priced[at] == buckets, jnp.asarray(table.t_verify, jnp.float32)[at], jnp.inf)
        t = jnp.where(buckets >= n_tok, t, jnp.inf)
        b_idx = jnp.where(jnp.isfinite(jnp.min(t)), jnp.argmin(t), b_idx).astype(jnp.int32)
    return chunk, take, b_idx


def _commit(spec: Spec, st: DecodeState, ctl: Control, act, vo, valid, out, n_out, acc, chunk, take):
    """After verification: write the block's (and the chunk's) K / V, keep what each slot may
    keep of `out` [R, T] (stop tokens, max_new), end slots, move positions (the KV rollback is
    a `lengths` move) -> (state fields, acc, done, n_keep, acc_kept, cut)."""
    r, t = out.shape
    S = spec.max_len
    cache = write_block(st.cache, vo.k_new, vo.v_new, st.pos, valid)
    if chunk is not None:
        cache = write_block(cache, vo.chunk_k, vo.chunk_v, chunk.start, chunk.valid, rows=chunk.rows)
    n_verified = n_out  # accepted drafts + the correction / bonus token
    n_out, stopped = _stop_truncate(out, n_out, ctl.stop_ids)
    acc = jnp.minimum(acc, n_out)
    room = jnp.maximum(st.max_new - st.n_gen, 0)
    n_keep = jnp.where(act, jnp.minimum(n_out, room), 0)
    # a round cut by a stop token or by max_new keeps fewer tokens than it verified: it counts
    # only what it kept (tau = kept tokens per round) and is marked, so calibration does not
    # read the discarded drafts as rejections
    cut = act & (n_keep < n_verified)
    acc_kept = jnp.where(act, jnp.clip(jnp.minimum(acc, n_keep - 1), 0, None), 0).astype(jnp.int32)
    cols = st.n_gen[:, None] + jnp.arange(t)[None]
    write = jnp.where(jnp.arange(t)[None] < n_keep[:, None], cols, S)
    out_buf = st.out.at[jnp.arange(r)[:, None], write].set(out, mode="drop")
    n_gen = st.n_gen + n_keep
    new_pos = st.pos + acc + 1
    new_anchor = out[jnp.arange(r), jnp.clip(n_out - 1, 0, t - 1)]
    by_length = n_gen >= st.max_new
    by_context = new_pos + spec.G + 1 > S  # room for the next round's whole block
    done = act & (stopped | by_length | by_context)
    reason = jnp.where(stopped, FINISH_STOP, jnp.where(by_length, FINISH_LENGTH, FINISH_CONTEXT))
    pos = jnp.where(act, new_pos, st.pos)
    if chunk is not None:
        pos = pos.at[chunk.rows].add(take, mode="drop")
    fields = dict(cache=cache.with_lengths(pos), anchor=jnp.where(act, new_anchor, st.anchor), pos=pos,
                  active=st.active & ~done, rounds=st.rounds + act, acc_sum=st.acc_sum + acc_kept, n_gen=n_gen,
                  out=out_buf, step=st.step + 1, finish=jnp.where(done, reason, st.finish).astype(jnp.int32))
    return fields, acc, done, n_keep, acc_kept, cut


def _chunk_to_drafter(spec: Spec, drafter_params, dcache, last, vo, chunk, take):
    """The drafter reads a prompt chunk forwarded beside the verification as it reads a prefill,
    in a round where some slot takes prompt tokens (a loop of zero or one iteration: the drafter's
    pass over a whole chunk of padding cost a served round at one slot on this CPU as much as
    the rest of a skipped round; a loop, not a `lax.cond`, keeps the caches written in place)."""
    if chunk is None:
        return dcache, last

    def read(c):
        d, l_, n = c
        d, l_ = spec.kind.prefill(spec, drafter_params, d, l_, vo.chunk_features, vo.chunk_hidden, chunk.tokens,
                                  chunk.start, take, chunk.rows)
        return d, l_, n + 1

    dcache, last, _ = jax.lax.while_loop(lambda c: jnp.any(take > 0) & (c[2] < 1), read,
                                         (dcache, last, jnp.int32(0)))
    return dcache, last


def plain_round(spec: Spec, target_params, drafter_params, st: DecodeState, ctl: Control, keep_drafter: bool = True):
    """A round without a draft: every decoding slot's anchor is verified alone (one query per
    row) and its next token drawn from the target -> (DecodeState, RoundOut). This is the round
    of a target-only engine (`spec.G == 0`), and the round an engine with a drafter runs when its
    skip rule says no slot drafts: the same target program and the skip rule's round count, plus,
    with `keep_drafter`, the drafter's context for the one verified position (`kind.skip`, the
    target's features, `kind.plain`) and the prompt chunks of joining slots. Without it (the
    settled rounds of a rule on survivals, which expect no draft at this load) the round is the
    target-only engine's and the drafter's state is left as it is: positions those rounds commit,
    prompt chunks included, are missing from its context when drafting resumes (lossless; only
    acceptance can suffer)."""
    r = st.anchor.shape[0]
    filling, act = _decoding(spec, st)
    _, verify_keys = row_round_keys(st.keys, st.rounds)
    samp = ctl.sampling
    lengths = jnp.zeros((r,), jnp.int32)
    chunk, take, b_idx = _bucket(spec, st, act, lengths, filling, ctl.table)
    # without prompt chunks a round of one token a slot fits the smallest bucket holding R rows:
    # larger ones are not compiled into it (each branch adds to the program's launch cost)
    buckets = spec.buckets if spec.prefill_chunk else spec.buckets[: 1 + sum(b < r for b in spec.buckets)]
    b_idx = jnp.minimum(b_idx, len(buckets) - 1)
    toks, valid = st.anchor[:, None], act[:, None]
    path = sampling_path(*samp, spec.tcfg.vocab_size)
    # the drafter reads the target's features of the verified positions and of prompt chunks
    features = spec.feature_layers if keep_drafter else ()

    def branch(bk):
        def run(cache):
            vo = verify_forward(target_params, spec.tcfg, cache, toks, st.pos, valid, bucket=bk,
                                feature_layers=features, packed_logits=True, chunk=chunk, logit_rows=r)
            out = _sample_anchor(vo.logits, vo.packing, samp, path, verify_keys, r)
            return vo._replace(logits=None, packing=None), out

        return run

    vo, out = jax.lax.switch(b_idx, [branch(b) for b in buckets], st.cache)
    fields, acc, done, n_keep, acc_kept, cut = _commit(spec, st, ctl, act, vo, valid, out, jnp.ones((r,), jnp.int32),
                                                       jnp.zeros((r,), jnp.int32), chunk, take)
    new = st._replace(**fields)
    if spec.G:
        dcache, last = st.dcache, st.last
        if keep_drafter:
            dcache = spec.kind.skip(spec, drafter_params, dcache, last, st.anchor, st.pos, act)
            dcache, last = spec.kind.plain(spec, drafter_params, dcache, last, vo.features, vo.hidden, st.pos,
                                           act & ~done)
            dcache, last = _chunk_to_drafter(spec, drafter_params, dcache, last, vo, chunk, take)
        # no survivals of its own: the last known ones are carried (-1 = none yet)
        since = st.since_draft + 1 if spec.reads_survivals else st.since_draft
        new = new._replace(dcache=dcache, last=last, a_hist=jnp.stack([st.a_hist[0], st.a_hist[0]]),
                           since_draft=since.astype(jnp.int32))
    z = jnp.zeros((r, spec.Gs), jnp.float32)
    return new, RoundOut(z, lengths, acc_kept, n_keep, act, b_idx, cut, jnp.bool_(False))


def drafting_round(spec: Spec, target_params, drafter_params, st: DecodeState, ctl: Control):
    """A round that drafts: draft + confidence -> prefix survival -> length policy -> bucket ->
    packed verification (`lax.switch` over the compiled buckets and attention views) ->
    rejection sampling with per-row keys -> commit -> drafter update -> (DecodeState, RoundOut)."""
    r = st.anchor.shape[0]
    G = spec.G
    filling, act = _decoding(spec, st)
    draft_keys, verify_keys = row_round_keys(st.keys, st.rounds)
    samp = ctl.sampling

    drafts, q, z, dcache = draft(spec, drafter_params, st, draft_keys, samp)
    a = prefix.prefix_survival(z, ctl.sts[:G])
    stale_valid = (st.step >= 2) & _known(st.a_hist[1], act)
    lengths = spec.policy(a, act, ctl, st.a_hist[1], stale_valid)
    lengths = jnp.where(ctl.pin >= 0, ctl.pin, lengths)  # a timed round's verification length
    lengths = jnp.where(act, jnp.clip(lengths, 0, G), 0).astype(jnp.int32)

    chunk, take, b_idx = _bucket(spec, st, act, lengths, filling, ctl.table)
    widths = spec.widths
    w_idx = _width_index(widths, act, lengths)
    toks = jnp.concatenate([st.anchor[:, None], drafts], axis=1)  # [R, G+1]
    valid = (jnp.arange(G + 1)[None] <= lengths[:, None]) & act[:, None]
    path = sampling_path(*samp, spec.tcfg.vocab_size)  # chosen over the batch's settings, as the draft's

    def branch(bk, w):
        def run(cache):
            vo = verify_forward(target_params, spec.tcfg, cache, toks[:, :w], st.pos, valid[:, :w], bucket=bk,
                                feature_layers=spec.feature_layers, packed_logits=True, chunk=chunk,
                                logit_rows=r * w)
            vo = _widen(vo, G + 1)
            acc, out, n_out = _sample_and_reject(spec, vo.logits, vo.packing, samp, path,
                                                 verify_keys, drafts, q, lengths)
            return vo._replace(logits=None, packing=None), acc, out, n_out

        return run

    # the branches only read the cache; the block's K / V are written after the switch (in place:
    # written inside the branches, the cache was copied whole). Sampling and rejection run inside
    # the branch, on the bucket's packed rows: the vocabulary-wide work scales with B, not R (G + 1)
    branches = [branch(b, w) for w in widths for b in spec.buckets]
    vo, acc, out, n_out = jax.lax.switch(w_idx * len(spec.buckets) + b_idx, branches, st.cache)
    fields, acc, done, n_keep, acc_kept, cut = _commit(spec, st, ctl, act, vo, valid, out, n_out, acc, chunk, take)
    dcache, last = spec.kind.update(spec, drafter_params, dcache, st.last, vo.features, vo.hidden, st.pos, drafts,
                                    acc, act & ~done)
    dcache, last = _chunk_to_drafter(spec, drafter_params, dcache, last, vo, chunk, take)
    verified = (jnp.arange(G)[None] < lengths[:, None]) & act[:, None]
    expected = CALIBRATION_DECAY * st.calib_expected + jnp.sum(jnp.where(verified, a, 0.0))
    accepted = CALIBRATION_DECAY * st.calib_accepted + jnp.sum(jnp.where(act, acc, 0)).astype(jnp.float32)
    counts = _count_acceptance(st.run_counts, lengths, acc, act)
    since_draft, probe_gap, probe_credit = _probe_schedule(spec, st, a, act, ctl, expected, accepted, counts)
    new = st._replace(**fields, dcache=dcache, last=last, a_hist=jnp.stack([a, st.a_hist[0]]),
                      since_draft=since_draft, probe_gap=probe_gap, probe_credit=probe_credit,
                      calib_expected=expected, calib_accepted=accepted, run_counts=counts)
    return new, RoundOut(z[:, : spec.Gs].astype(jnp.float32), lengths, acc_kept, n_keep, act, b_idx, cut,
                         jnp.bool_(True))


# which round a skip rule runs (`round_choice`): the plain round (drafter context kept), the plain
# round that leaves the drafter as it is (settled rounds of a rule on survivals), the drafting round
ROUND_PLAIN, ROUND_SETTLED, ROUND_DRAFTING = 0, 1, 2


def round_choice(spec: Spec, st: DecodeState, ctl: Control):
    """Which round the skip rule (`spec.skip_drafting`) runs on `st` -> int32 ROUND_*. A pinned
    control (`Control.pin`, timing) drafts for a pinned length and runs the plain round for
    `PIN_SKIP`. From past rounds only, so the choice cannot bias the output (docs/method.md §3)."""
    r = st.anchor.shape[0]
    _, act = _decoding(spec, st)
    pays, settled = _skip_decision(spec, st, act, ctl, r * spec.G)
    pays = jnp.where(ctl.pin == PIN_POLICY, pays, ctl.pin >= 0)
    settled = settled & (ctl.pin == PIN_POLICY)
    return jnp.where(pays, ROUND_DRAFTING, jnp.where(settled, ROUND_SETTLED, ROUND_PLAIN)).astype(jnp.int32)


def chosen_rounds(spec: Spec):
    """The rounds `round_choice` picks from, by ROUND_* index: (tp, dp, st, ctl) -> (st, RoundOut,
    the choice for the next round on the new state under the same controls). A host loop reads
    that choice instead of asking again while nothing but the round touched the state."""

    def then_choose(one_round):
        def run(tp, dp, st, ctl):
            st, out = one_round(tp, dp, st, ctl)
            return st, out, round_choice(spec, st, ctl)

        return run

    def settled(tp, dp, st, ctl):
        """A settled round stays the choice while the slots that decode are the same: it changes
        neither the survivals, the acceptance counts, the probe gap nor the credit, and its
        growing `since_draft` is read only when no "no" is settled (`_skip_decision`). The
        choice is asked again (a loop of zero or one iteration) only when a slot ended or
        finished its prompt."""
        _, before = _decoding(spec, st)
        st, out = plain_round(spec, tp, dp, st, ctl, False)
        _, after = _decoding(spec, st)
        again = jnp.any(before != after)
        nxt, _ = jax.lax.while_loop(lambda c: again & (c[1] < 1), lambda c: (round_choice(spec, st, ctl), c[1] + 1),
                                    (jnp.int32(ROUND_SETTLED), jnp.int32(0)))
        return st, out, nxt

    return (then_choose(lambda tp, dp, st, ctl: plain_round(spec, tp, dp, st, ctl, True)), settled,
            then_choose(lambda tp, dp, st, ctl: drafting_round(spec, tp, dp, st, ctl)))


def round_step(spec: Spec, target_params, drafter_params, st: DecodeState, ctl: Control):
    """One round for all R slots -> (DecodeState, RoundOut). Without a drafter it is
    `plain_round`; with one, `drafting_round`, unless a skip rule (`spec.skip_drafting`) says no
    slot drafts this round (`round_choice`): then `plain_round`, the target-only program.
    `skip_drafting="always"` (cost predictions) compiles `plain_round` alone: the price of a
    skipped round.

    Under a skip rule every round sits in this one program (what the compiled loop of rounds,
    `run_rounds`, runs; a host loop runs the chosen round's own program: `Engine.step`), and each
    writes the caches in place: each round is a `lax.while_loop` of zero or one iteration. (A
    `lax.cond` whose two branches both wrote the caches made XLA copy each cache whole:
    tests/engine/test_in_place.py; one whose other branch passed the state through made libtpu's
    memory-space assignment abort compiling a Qwen3-8B-shaped round for v6e-8:
    tests/engine/test_tpu_compile.py.)"""
    if not spec.G or spec.skip_drafting == "always":
        return plain_round(spec, target_params, drafter_params, st, ctl)
    if not spec.skip_drafting:
        return drafting_round(spec, target_params, drafter_params, st, ctl)
    r = st.anchor.shape[0]
    which = round_choice(spec, st, ctl)

    def at_most_once(choice, one_round, st, out):
        def body(c):
            s, _, n = c
            return (*one_round(target_params, drafter_params, s, ctl)[:2], n + 1)

        st, out, _ = jax.lax.while_loop(lambda c: (which == choice) & (c[2] < 1), body, (st, out, jnp.int32(0)))
        return st, out

    zi, zb = jnp.zeros((r,), jnp.int32), jnp.zeros((r,), bool)
    out = RoundOut(jnp.zeros((r, spec.Gs), jnp.float32), zi, zi, zi, zb, jnp.int32(0), zb, jnp.bool_(False))
    rounds = chosen_rounds(spec)
    choices = (ROUND_PLAIN, ROUND_SETTLED, ROUND_DRAFTING) if spec.reads_survivals else \
        (ROUND_PLAIN, ROUND_DRAFTING)
    for choice in choices:
        st, out = at_most_once(choice, rounds[choice], st, out)
    return st, out


def run_rounds(spec: Spec, target_params, drafter_params, st: DecodeState, ctl: Control, max_rounds, stop_on_free):
    """`lax.while_loop` over `round_step` until no slot is active, `max_rounds` rounds ran, or
    (when `stop_on_free`) a slot finished, so the host can refill it."""
    n0 = jnp.sum(st.active)

    def cond(c):
        s, i = c
        freed = jnp.sum(s.active) < n0
        return jnp.any(s.active) & (i < max_rounds) & ~(stop_on_free & freed)

    def body(c):
        s, i = c
        return round_step(spec, target_params, drafter_params, s, ctl)[0], i + 1

    st, n = jax.lax.while_loop(cond, body, (st, jnp.int32(0)))
    return st, n
