"""The Engine: R request slots, bucketed prefill, one compiled round, continuous batching.

    engine = Engine(target, drafter, num_slots=8, max_len=512)   # drafter None = target-only
    res = engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=64, sampling=SamplingParams(0.7, 20, 0.8))
    res.results[0].tokens, res.results[0].tau

What the drafter does in a round comes from its kind's adapter (drafter/kinds/, found by
`registry.kind_of`); None is target-only autoregressive decoding. Compiled programs: one round
(all verification buckets inside one `lax.switch`), one prefill per prompt-length bucket,
optionally one `lax.while_loop` of rounds. Sampling settings, gamma, threshold, cost table
and stop ids are traced: switching them never recompiles.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.scheduler import prefix as scheduler
from dspark_jax.decoding import rejection
from dspark_jax.drafter import registry
from dspark_jax.drafter.frozen import TargetMismatchError, check_target
from dspark_jax.engine.page_alloc import OutOfPagesError, PageAllocator
from dspark_jax.engine.spec import Spec
from dspark_jax.engine.policy import SCHEDULED, get_policy
from dspark_jax.engine.round import admit, draft_part, prefill, round_step, run_rounds
from dspark_jax.engine.state import FINISH_REASONS, Control, DecodeState
from dspark_jax.calibration.traces import Traces
from dspark_jax.engine.verify import target_arrays
from dspark_jax.target.kv_cache import KVCache
from dspark_jax.target.paged_kernel import resolve_impl
from dspark_jax.target.paged_kv import PAGE_AXES, PagedKVCache, pages_per_slot
from dspark_jax.decoding.sampling import SamplingParams

__all__ = ["Engine", "EngineError", "RequestResult", "GenerateResult", "default_buckets", "with_chunk_room"]

MAX_STOP_IDS = 8
# accepted `skip_drafting` values -> Spec.skip_drafting
_SKIP_RULES = {False: None, None: None, "none": None, True: "known", "known": "known", "best_case": "best_case"}


class EngineError(ValueError):
    pass


@dataclass
class RequestResult:
    tokens: list[int]
    prompt_len: int
    rounds: int
    accepted: int  # accepted draft tokens kept, over all rounds (len(tokens) == accepted + rounds)
    seconds: float
    finish_reason: str | None = None  # "stop", "length" (max_new_tokens) or "context" (max_len full first)

    @property
    def tau(self) -> float:
        """Mean over rounds of (accepted + 1) (spec 5)."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else float("nan")


@dataclass
class GenerateResult:
    results: list[RequestResult]
    seconds: float
    round_calls: int  # compiled round dispatches (host loop) or while-loop calls
    traces: Traces | None = None
    extra: dict = field(default_factory=dict)

    @property
    def tau(self) -> float:
        """Accepted length over all rounds of all requests."""
        r = sum(x.rounds for x in self.results)
        return (sum(x.accepted for x in self.results) + r) / r if r else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return sum(len(x.tokens) for x in self.results) / self.seconds if self.seconds > 0 else float("nan")


def stop_row(stop_ids) -> np.ndarray:
    """Stop ids -> one fixed-width row (-1 = none), so changing them never recompiles."""
    stops = [int(x) for x in stop_ids]
    if len(stops) > MAX_STOP_IDS:
        raise EngineError(f"at most {MAX_STOP_IDS} stop ids, got {len(stops)}")
    return np.asarray(stops + [-1] * (MAX_STOP_IDS - len(stops)), np.int32)


def per_request(value, n: int, what: str) -> list:
    """One value for every request, or a list with one per request."""
    if isinstance(value, (list, tuple)) and not isinstance(value, SamplingParams) and \
            (what != "stop_ids" or (value and isinstance(value[0], (list, tuple)))):
        if len(value) != n:
            raise EngineError(f"{what}: {len(value)} values for {n} prompts; give one, or one per prompt")
        return list(value)
    return [value] * n


def kind_of_drafter(drafter):
    try:
        return registry.kind_of(drafter)
    except ValueError as e:
        raise EngineError(str(e)) from None


def default_buckets(R: int, G: int, prefill_chunk: int = 0) -> tuple[int, ...]:
    """Verification bucket sizes (tokens): R, 2R, 4R, ... and R * (G + 1) + prefill_chunk (every
    round fits, with a whole prompt chunk beside it)."""
    return tuple(sorted(_doubling(R, R * (G + 1) + int(prefill_chunk))))


def _doubling(b: int, top: int) -> set[int]:
    """b, 2b, 4b, ... below top, and top."""
    out = {top}
    while b < top:
        out.add(b)
        b *= 2
    return out


def with_chunk_room(buckets, R: int, G: int, prefill_chunk: int) -> tuple[int, ...]:
    """`buckets` plus chunk-only buckets beyond the largest (doubling, then R * (G + 1) +
    prefill_chunk), so that a whole prompt chunk fits beside a full verification block. A cost
    table prices `buckets` only: the scheduler never chooses the chunk-only ones, and without
    them a joining prompt would get only what the table's largest bucket leaves (28 tokens a
    round instead of 64 on SmolLM2 with 4 slots)."""
    buckets = tuple(sorted(set(int(b) for b in buckets)))
    top = R * (G + 1) + int(prefill_chunk)
    if not prefill_chunk or buckets[-1] >= top:
        return buckets
    return tuple(sorted(set(buckets) | _doubling(buckets[-1], top)))


def _prefill_buckets(max_len: int) -> tuple[int, ...]:
    out, b = [], 16
    while b < max_len:
        out.append(b)
        b *= 2
    return tuple(out + [max_len])


class Engine:
    """Speculative decoding over `num_slots` request slots.

    Verification lengths come from `policy` ("fixed", "threshold", or a scheduler:
    "early_stop" = Algorithm 1, "static" = the static-shape variant, "production"; or a
    function, see engine/policy.py). A scheduler maximises `theta` ("sps": tau * SPS(B),
    the paper's; "latency": tau / (T_draft + T_verify(B))) over the cost table passed as
    `table` (here, which also makes its buckets the engine's, or per call), pricing B tokens by `cost` ("interp" / "step"; None: the
    policy's default). `skip_drafting` (a `lax.cond` around the drafter inside the same
    compiled round): "best_case" skips when even perfect drafts could not beat plain
    decoding on the table (`scheduler.speculation_pays`); "known" (or True) also skips when
    the last known survivals say no admission pays (`scheduler.known_speculation_pays`),
    drafting after `probe_every` skipped rounds to refresh them (the interval doubles, up to
    `probe_max`, while fresh survivals keep saying no). Both decide from the past only.
    """

    def __init__(self, target, drafter=None, *, num_slots: int = 8, max_len: int = 512, gamma: int | None = None,
                 buckets=None, prefill_buckets=None, policy="fixed", table=None, layer_ids=None,
                 theta: str = "latency", cost: str | None = None, skip_drafting: bool | str = False,
                 probe_every: int = 8, probe_max: int = 64, kind=None, verify=rejection.verify, mesh=None,
                 kv_pages: tuple[int, int] | None = None, paged_attention: str = "auto",
                 prefill_chunk: int | None = None, prefill_rows: int = 4):
        """`kind` (the drafter's adapter, default from the registry) and `verify` (batched rejection
        sampling) are injection points for tests of deliberately broken variants (dspark_jax.testing).
        `mesh` (a (data, fsdp, tensor) mesh): weights laid out by the rules table, the decode state
        with slots over `data` and KV heads over `tensor` (`decode_shardings`).
        `kv_pages=(num_pages, page_size)`: the target's KV cache is paged (target/paged_kv.py), a
        pool of `num_pages` pages shared by the slots instead of a dense `[R, max_len]` cache;
        the host allocator `self.pages` (engine/page_alloc.py) gives a slot pages as it grows
        and takes them back when its request ends. The drafter's cache (any kind) is paged too,
        with the same page table: a second pool of its own layers and heads.
        `paged_attention`: how prefill, verification and the drafters read the pages: "auto" (the
        Pallas kernel on TPU, target/paged_kernel.py; the gathering reference elsewhere),
        "pallas" (forced: interpret mode off TPU) or "reference".
        `prefill_chunk=C`: a request that joins while others run is not prefilled in a call of its
        own (which stalls every running request for the whole prompt): its prompt goes into the
        state and each round forwards up to C of its tokens, packed into the same target forward
        as the others' verification (at most `prefill_rows` joining slots per round, earliest
        first; the default buckets get room for a whole chunk). Requests that start on an idle
        engine are still prefilled whole (nobody waits)."""
        tmodel = target if hasattr(target, "lm_head_weight") else target.model
        self.mesh = mesh
        if mesh is not None:
            from dspark_jax.parallel.sharding import shard_model

            tmodel = shard_model(tmodel, mesh)
            drafter = None if drafter is None else shard_model(drafter, mesh)
        self.target, self.drafter = tmodel, drafter
        tcfg = tmodel.cfg
        self.kind = None if drafter is None else (kind or kind_of_drafter(drafter))
        mode = "ar" if self.kind is None else self.kind.name
        shape = None
        if drafter is not None:
            check_target(getattr(drafter, "target_fingerprint", None), tmodel, f"{mode} drafter")
            if tuple(drafter.embed.shape) != (tcfg.vocab_size, tcfg.hidden_size):
                raise TargetMismatchError(f"the {mode} drafter's embedding {tuple(drafter.embed.shape)} does not fit the "
                                          f"target ({tcfg.vocab_size}, {tcfg.hidden_size}): build it for this target")
            try:
                shape = self.kind.draft_shape(drafter, tcfg, gamma, layer_ids)
            except ValueError as e:
                raise EngineError(str(e)) from None
        G = 0 if shape is None else shape.G
        R, S = int(num_slots), int(max_len)
        if S < G + 3:
            raise EngineError(f"max_len {S} is too short for gamma {G}: need at least {G + 3}")
        chunk = int(prefill_chunk or 0)
        if chunk < 0 or (prefill_chunk is not None and chunk == 0) or prefill_rows < 1:
            raise EngineError(f"prefill_chunk must be >= 1 (or None: prefill prompts whole) and prefill_rows >= 1, "
                              f"got {prefill_chunk} and {prefill_rows}")
        if not buckets:  # a cost table's buckets are the ones it prices; else room for every round (and a chunk)
            buckets = np.asarray(table.buckets) if table is not None else default_buckets(R, G, chunk)
        priced = tuple(sorted(set(int(b) for b in buckets)))
        if priced[-1] < R * (G + 1):
            raise EngineError(f"largest verification bucket {priced[-1]} < num_slots * (gamma + 1) = {R * (G + 1)}: "
                              "a round could not fit; add a bucket of that size")
        # buckets a cost table prices (the scheduler's choices), and those compiled: the same,
        # plus chunk-only ones beyond the largest when prompt chunks need the room
        self.priced_buckets, buckets = priced, with_chunk_room(priced, R, G, chunk)
        self.mode, self.G, self.R, self.S = mode, G, R, S
        self.pages = self._page_allocator(kv_pages)
        try:
            self.paged_attention = resolve_impl(paged_attention, mesh)
        except ValueError as e:
            raise EngineError(str(e)) from None
        self.gamma = G if gamma is None else int(gamma)
        self.buckets = buckets
        self.prefill_buckets = tuple(sorted(prefill_buckets or _prefill_buckets(S)))
        self.policy_name = policy if isinstance(policy, str) else getattr(policy, "__name__", "custom")
        try:
            pol = get_policy(policy, theta, cost)
        except ValueError as e:
            raise EngineError(str(e)) from None
        if skip_drafting not in _SKIP_RULES:
            raise EngineError(f"skip_drafting={skip_drafting!r}: use False, 'best_case' or 'known' (True = 'known')")
        if not 1 <= probe_every <= probe_max:
            raise EngineError(f"need 1 <= probe_every <= probe_max, got {probe_every} and {probe_max}")
        skip_rule = _SKIP_RULES[skip_drafting] if G > 0 else None
        scheduled = isinstance(policy, str) and policy in SCHEDULED
        # what this engine reads each round: survivals from a confidence head, a measured cost table
        reads_confidence = G > 0 and ((isinstance(policy, str) and policy in (*SCHEDULED, "threshold"))
                                      or skip_rule == "known")
        self.needs_table = G > 0 and (scheduled or skip_rule is not None)
        if reads_confidence and not getattr(getattr(drafter, "dcfg", None), "confidence_head", False):
            what = f"policy {policy!r}" if policy != "fixed" else f"skip_drafting={skip_drafting!r}"
            raise EngineError(f"{what} schedules verification from the drafter's confidence head, and this {mode} "
                              "drafter has none: use policy 'fixed' (and no skip_drafting, or 'best_case'), or a "
                              "DSpark drafter trained with its confidence head")
        # rounds that verify no drafts are common only when a policy or the skip rule can choose none
        narrow = skip_rule is not None or policy != "fixed"
        self.spec = Spec(self.kind, shape, tcfg, buckets, S, pol, verify, skip_rule,
                         theta, int(probe_every), int(probe_max), chunk, min(int(prefill_rows), R) if chunk else 0,
                         narrow)
        self.table = None if table is None else self._checked_table(table)
        # policies that never read a table still need one in the compiled round's signature
        self._unread_table = scheduler.make_table(priced, t_verify=np.ones(len(priced)), t_draft=0.0)
        self.tp = target_arrays(tmodel)
        self.dp = drafter.arrays() if drafter is not None else {}
        self.tgraph, self.tstate = nnx.split(tmodel)
        spec = self.spec
        tgraph = self.tgraph

        def _prefill(tstate, dp, st, tokens, plen, join, keys, max_new):
            model = nnx.merge(tgraph, tstate)

            def apply(tok, pos, valid, cache, fl):
                return model(tok, positions=pos, valid=valid, cache=cache, feature_layers=fl, return_logits=False)

            return prefill(spec, apply, None, dp, st, tokens, plen, join, keys, max_new)

        # with a mesh, the state keeps its layout from call to call (and its donated buffers)
        st_sh = self._state_sh = None if mesh is None else decode_shardings(jax.eval_shape(self._fresh_state), mesh)
        prefill_kw = round_kw = {}
        if st_sh is not None:
            prefill_kw, round_kw = {"out_shardings": st_sh}, {"out_shardings": (st_sh, None)}
        self._prefill = jax.jit(_prefill, donate_argnums=(2,), **prefill_kw)
        self._round = jax.jit(functools.partial(round_step, spec), donate_argnums=(2,), **round_kw)
        self._loop = jax.jit(functools.partial(run_rounds, spec), donate_argnums=(2,))
        self._draft = jax.jit(functools.partial(draft_part, spec)) if G else None
        self._admit = jax.jit(admit, donate_argnums=(0,), **prefill_kw)
        self.round_calls = 0

    @property
    def prefill_chunk(self) -> int:
        """Prompt tokens a round forwards for joining slots (0: prompts are prefilled whole)."""
        return self.spec.prefill_chunk

    # ------------------------------------------------------------ state / controls

    def init_state(self) -> DecodeState:
        """A fresh decode state (every slot free). With paged KV it also empties the page allocator:
        the allocator follows the state last made here."""
        if self.pages is not None:
            self.pages.reset()
        st = self._fresh_state()
        return st if self.mesh is None else jax.device_put(st, self._state_sh)

    def _fresh_state(self) -> DecodeState:
        R, S, G, cfg = self.R, self.S, self.G, self.target.cfg
        dt = self.tp["layers"]["q_proj"].dtype
        if self.kind is not None:
            if self.pages is None:
                dcache, last = self.kind.init_decode(self.spec, self.drafter, R, S, dt)
            else:  # the drafter's cache paged like the target's (same positions, same page table)
                dense, _ = jax.eval_shape(lambda: self.kind.init_decode(self.spec, self.drafter, R, S, dt))
                _, last = self.kind.init_decode(self.spec, self.drafter, R, 1, dt)
                dcache = PagedKVCache.like(dense, self.pages.num_pages, self.pages.page_size, self.paged_attention)
        else:
            dcache, last = KVCache.create(cfg, R, 1, dt, num_layers=1), jnp.zeros((R, 1), dt)
        zi = lambda: jnp.zeros((R,), jnp.int32)  # distinct buffers: the state is donated
        if self.pages is None:
            cache = KVCache.create(cfg, R, S, dt)
        else:
            cache = PagedKVCache.create(cfg, R, S, self.pages.num_pages, self.pages.page_size, dt,
                                        impl=self.paged_attention)
        return DecodeState(cache, dcache, last, zi(), zi(), jnp.zeros((R,), bool),
                           jax.random.split(jax.random.key(0), R), zi(), zi(), zi(), zi(), jnp.zeros((R, S), jnp.int32),
                           jnp.full((2, R, max(G, 1)), -1.0, jnp.float32), jnp.int32(0), jnp.int32(0),
                           jnp.int32(self.spec.probe_every), zi(), zi(), zi(),
                           jnp.zeros((R, S if self.prefill_chunk else 1), jnp.int32))

    def control(self, sampling: SamplingParams | None = None, gamma: int | None = None, threshold: float = 0.0,
                stop_ids=(), sts=None, table=None, default_k: int | None = None) -> Control:
        g = self.gamma if gamma is None else int(gamma)
        if g > self.G or g < 0:
            raise EngineError(f"gamma {g} is outside this engine's compiled range 0..{self.G} (the block size it was "
                              f"built with); build the Engine with a larger gamma / drafter block")
        s = sampling or SamplingParams()
        s = SamplingParams(*(jnp.broadcast_to(jnp.asarray(v, dt), (self.R,)) for v, dt in
                             zip(s, (jnp.float32, jnp.int32, jnp.float32))))
        stops = jnp.broadcast_to(jnp.asarray(stop_row(stop_ids), jnp.int32), (self.R, MAX_STOP_IDS))
        Gs = max(self.G, 1)
        sts = jnp.ones((Gs,), jnp.float32) if sts is None else jnp.asarray(sts, jnp.float32)[:Gs]
        if sts.shape != (Gs,):
            raise EngineError(f"sts temperatures need {Gs} values, got {sts.shape[0]}")
        dk = self.R * g if default_k is None else int(default_k)
        table = self._checked_table(table) if table is not None else self.table
        if table is None:
            if self.needs_table:
                raise EngineError(f"policy {self.policy_name!r}"
                                  f"{' with skip_drafting' if self.spec.skip_drafting else ''} prices verification "
                                  "with a measured cost table and none was given: pass table= (to the Engine or "
                                  "this call; measure one with `python -m dspark_jax.costs measure`)")
            table = self._unread_table
        return Control(s, jnp.int32(g), jnp.float32(threshold), sts, table, jnp.int32(dk), stops)

    def _checked_table(self, table):
        """The table must price every verification bucket the scheduler may choose and nothing
        beyond the largest (a finer grid inside it is allowed: the scheduler then decides on it,
        as tests do); chunk-only buckets beyond it are never priced."""
        got = [int(b) for b in np.asarray(table.buckets)]
        missing = sorted(set(self.priced_buckets) - set(got))
        if missing or got[-1] != self.priced_buckets[-1]:
            raise EngineError(f"the cost table's buckets {got} do not match this engine's verification "
                              f"buckets {list(self.priced_buckets)}"
                              f"{f' (unpriced: {missing})' if missing else ''}: build the Engine with "
                              "table= (its buckets become the engine's), or measure the table for these buckets")
        return table

    # ------------------------------------------------------------ paged KV (host side)

    def _page_allocator(self, kv_pages) -> PageAllocator | None:
        if kv_pages is None:
            return None
        try:
            num_pages, page_size = (int(x) for x in kv_pages)
        except (TypeError, ValueError):
            raise EngineError(f"kv_pages must be (num_pages, page_size), got {kv_pages!r}") from None
        if num_pages < 1 or page_size < 1:
            raise EngineError(f"kv_pages needs num_pages >= 1 and page_size >= 1, got {kv_pages!r}")
        return PageAllocator(num_pages, page_size, self.R, pages_per_slot(self.S, page_size))

    def pages_to_reserve(self, prompt_len: int, max_new: int) -> int:
        """Pages a request may come to hold: every position its rounds can write (the prompt, its
        max_new tokens and a last round's G drafts), within max_len."""
        return self.pages.pages_for(min(int(prompt_len) + int(max_new) + self.G, self.S))

    def admit_count(self, candidates, reserved: int | None = None) -> int:
        """How many of `candidates` ((prompt_len, max_new), in arrival order) join now, with
        `reserved` pages already promised to running requests (default: the allocator's
        reservations): a leading run whose reservations fit the pool, so a running request never
        finds the pool empty, and later ones wait (first come, first served). A request that
        could not fit even an empty pool is an error."""
        if self.pages is None:
            return len(candidates)
        promised = self.pages.reserved.sum() if reserved is None else reserved
        budget, n = self.pages.num_pages - int(promised), 0
        for plen, max_new in candidates:
            need = self.pages_to_reserve(plen, max_new)
            if need > self.pages.num_pages:
                raise OutOfPagesError(
                    f"a request of {plen} prompt tokens and max_new_tokens {max_new} may hold {need} KV pages of "
                    f"{self.pages.page_size} tokens, more than the whole pool of {self.pages.num_pages}: build the "
                    "Engine with more pages (kv_pages=(num_pages, page_size); --kv-pages NUM,SIZE on the command "
                    "line) or ask for fewer new tokens")
            if need > budget:
                break
            budget -= need
            n += 1
        return n

    def reserve(self, slot: int, prompt_len: int, max_new: int) -> bool:
        """Admission by reservation: promise `slot`'s new request its whole reach when the pool can
        hold it beside what running requests were promised -> True; else False (it waits, first
        in line). Always True without paged KV; a request larger than the pool raises."""
        if self.pages is None:
            return True
        if not self.admit_count([(prompt_len, max_new)]):
            return False
        self.pages.reserved[int(slot)] = self.pages_to_reserve(prompt_len, max_new)
        return True

    def release(self, st: DecodeState, slots) -> DecodeState:
        """The requests of `slots` are over: their pages and their reservations go back to the pool."""
        if self.pages is None or not len(slots):
            return st
        self.pages.reserved[np.asarray(slots, np.int64)] = 0
        return self._set_pages(st, release=slots)

    def _set_pages(self, st: DecodeState, release=(), grow=None) -> DecodeState:
        """Free the pages of slots in `release`, grow slots to the token counts in `grow`
        ({slot: tokens}), and put the page table into the state if it changed."""
        version = self.pages.version
        self.pages.release_many(release)
        self.pages.grow_many({s: min(int(n), self.S) for s, n in (grow or {}).items()})
        if self.pages.version != version:
            def table():  # one buffer per cache (the state is donated), laid out as the state's
                t = jnp.array(self.pages.table)
                return t if self.mesh is None else jax.device_put(t, self._state_sh.cache.page_table)

            dcache = st.dcache.with_page_table(table()) if isinstance(st.dcache, PagedKVCache) else st.dcache
            st = st._replace(cache=st.cache.with_page_table(table()), dcache=dcache)
        return st

    def _pages_for_rounds(self, st: DecodeState, whole_request: bool) -> DecodeState:
        """Before rounds: inactive slots give their pages back; each active slot gets pages for the
        positions a round may write (pos .. pos + G, so pos + G + 1 tokens), or with
        `whole_request` for every round until its max_new tokens (the compiled while loop never
        returns to the host in between): pos - n_gen is constant while a request runs, so its last
        round writes below pos + (max_new - n_gen) + G."""
        pos, active, n_gen, max_new, plen = (np.asarray(x) for x in jax.device_get(
            (st.pos, st.active, st.n_gen, st.max_new, st.plen)))
        pos = np.maximum(pos, plen - 1)  # a slot still prefilling in chunks got its prompt's pages when it joined
        reach = pos + (max_new - n_gen) + self.G if whole_request else pos + self.G + 1
        return self._set_pages(st, release=np.flatnonzero(~active).tolist(),
                               grow={int(s): int(reach[s]) for s in np.flatnonzero(active)})

    # ------------------------------------------------------------ compiled calls

    def _join_rows(self, st: DecodeState, width: int, slots, prompts, key_data, max_new):
        """The device arguments of a join: prompts right padded [R, width], plen, join mask,
        per-request keys (rows not joining keep theirs: only the shape of `st.keys` is read) and
        max_new, each an [R] row set at `slots`."""
        tok = np.zeros((self.R, width), np.int32)
        plen = np.ones((self.R,), np.int32)
        join = np.zeros((self.R,), bool)
        mx = np.zeros((self.R,), np.int32)
        old = jax.random.key_data(st.keys)
        kd = np.zeros(old.shape, old.dtype)
        slots = np.asarray(slots, np.int64)
        for s, p in zip(slots, prompts):
            tok[s, : len(p)] = p
            plen[s] = len(p)
        join[slots], mx[slots], kd[slots] = True, np.asarray(max_new), np.asarray(key_data)
        keys = jax.random.wrap_key_data(jnp.asarray(kd), impl=jax.random.key_impl(st.keys))
        return jnp.asarray(tok), jnp.asarray(plen), jnp.asarray(join), keys, jnp.asarray(mx)

    def prefill_slots(self, st: DecodeState, slots, prompts, key_data, max_new) -> DecodeState:
        """Start `prompts` (lists of ids) in `slots` with per-request key data rows (`jax.random.key_data`);
        one compiled prefill per prompt-length bucket."""
        n = max(len(p) for p in prompts)
        P = next((b for b in self.prefill_buckets if b >= n), None)
        if P is None:
            raise EngineError(f"prompt of {n} tokens exceeds the largest prefill bucket {self.prefill_buckets[-1]}")
        args = self._join_rows(st, P, slots, prompts, key_data, max_new)
        if self.pages is not None:  # pages for the prompt and the first round; free slots give theirs back
            idle = np.flatnonzero(~np.asarray(jax.device_get(st.active))).tolist()
            st = self._set_pages(st, release=sorted(set(idle) | {int(s) for s in slots}),
                                 grow={int(s): len(p) + self.G for s, p in zip(slots, prompts)})
        return self._prefill(self.tstate, self.dp, st, *args)

    def admit_slots(self, st: DecodeState, slots, prompts, key_data, max_new) -> DecodeState:
        """Start `prompts` in `slots` without forwarding them (`prefill_chunk`): the rounds forward
        them in chunks beside the running requests."""
        args = self._join_rows(st, self.S, slots, prompts, key_data, max_new)
        if self.pages is not None:  # pages for the whole prompt and the first round, as a prefill's
            st = self._set_pages(st, release=[int(s) for s in slots],
                                 grow={int(s): len(p) + self.G for s, p in zip(slots, prompts)})
        return self._admit(st, *args)

    def start(self, st: DecodeState, ctl: Control, slots, prompts, key_data, max_new, samplings, stop_ids):
        """Requests join `slots`: one prefill per prompt-length bucket (or, with `prefill_chunk`
        while other requests run, their prompts handed to the rounds), and their sampling settings
        and stop ids written into those slots' rows of the traced controls -> (state, controls).
        The one admission path of `generate` and the server's loop."""
        key_data = np.asarray(key_data)
        max_new = [min(int(m), self.S) for m in max_new]
        if self.prefill_chunk and bool(np.asarray(jax.device_get(st.active)).any()):
            st = self.admit_slots(st, slots, prompts, key_data, max_new)
        else:
            groups: dict = {}
            for j, p in enumerate(prompts):
                groups.setdefault(next((b for b in self.prefill_buckets if b >= len(p)), None), []).append(j)
            for js in groups.values():
                st = self.prefill_slots(st, [slots[j] for j in js], [prompts[j] for j in js], key_data[js],
                                        [max_new[j] for j in js])
        samp = [np.array(x) for x in jax.device_get(ctl.sampling)]
        stops = np.array(ctl.stop_ids)
        for j, s in enumerate(slots):
            for col, v in zip(samp, samplings[j]):
                col[s] = v
            stops[s] = stop_row(stop_ids[j])
        return st, ctl._replace(sampling=SamplingParams(*(jnp.asarray(c) for c in samp)), stop_ids=jnp.asarray(stops))

    def step(self, st: DecodeState, ctl: Control):
        """One compiled round for the whole batch -> (state, RoundOut). With paged KV the host
        first frees the pages of finished slots and tops up the active ones for this round."""
        if self.pages is not None:
            st = self._pages_for_rounds(st, whole_request=False)
        self.round_calls += 1
        return self._round(self.tp, self.dp, st, ctl)

    def draft(self, st: DecodeState, ctl: Control):
        """What the next round would draft from `st`, alone (the state is not donated):
        (tokens [R, G], q [R, G, V], z [R, G]). For cost tables and inspection."""
        if self._draft is None:
            raise EngineError("target-only engine: there is no drafter to run")
        return self._draft(self.dp, st, ctl.sampling)

    def compiled_rounds(self) -> int:
        """How many round programs have been compiled (1 for any number of buckets / settings)."""
        return self._round._cache_size()

    # ------------------------------------------------------------ generation

    def check_prompts(self, prompts, max_new_tokens: int):
        V = self.target.cfg.vocab_size
        limit = self.S - self.G - 2
        min_len = 1 if self.kind is None else self.kind.min_prompt_len
        out = []
        for i, p in enumerate(prompts):
            p = [int(x) for x in p]
            if len(p) < min_len:
                raise EngineError(f"prompt {i} has {len(p)} tokens; {self.mode} needs at least {min_len}")
            if len(p) > limit:
                raise EngineError(f"prompt {i} has {len(p)} tokens, longer than the maximum context allows "
                                  f"(max_len {self.S} - gamma {self.G} - 2 = {limit}): shorten it or build the "
                                  "Engine with a larger max_len")
            if min(p) < 0 or max(p) >= V:
                raise EngineError(f"prompt {i} has token ids outside the vocabulary 0..{V - 1}")
            out.append(p)
        if max_new_tokens < 1:
            raise EngineError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        return out

    def generate(self, prompts, *, max_new_tokens: int = 64, sampling: SamplingParams | None = None, seed: int = 0,
                 gamma: int | None = None, threshold: float = 0.0, stop_ids=(), sts=None, sample_index=None,
                 traces: bool = False, loop: str = "host", table=None) -> GenerateResult:
        """Generate for every prompt (lists of token ids), R at a time, refilling freed slots.

        Per request or for all: `max_new_tokens`, `sampling`, `stop_ids` and `seed` each take one
        value or a list with one per prompt (changing them never recompiles). Request i draws its
        randomness from `fold_in(key(seed_i), sample_index[i])` (default i), so its output does
        not depend on the batch it ran in. `loop`: "host" (a Python loop over the compiled round;
        required for traces) or "while" (a compiled `lax.while_loop` that returns to the host
        only when a slot frees up while requests wait).
        """
        if loop not in ("host", "while"):
            raise EngineError(f"loop must be 'host' or 'while', got {loop!r}")
        if traces and loop != "host":
            raise EngineError("traces need loop='host' (the while loop does not return per-round records)")
        n = len(prompts)
        max_news = [int(m) for m in per_request(max_new_tokens, n, "max_new_tokens")]
        prompts = self.check_prompts(prompts, min(max_news) if max_news else 1)
        for p, m in zip(prompts, max_news):  # paged KV: a request larger than the whole pool fails before anything runs
            self.admit_count([(len(p), m)], 0)
        samplings = [x or SamplingParams() for x in per_request(sampling, n, "sampling")]
        stops = np.stack([stop_row(x) for x in per_request(list(stop_ids), n, "stop_ids")]) if n else None
        seeds = per_request(seed, n, "seed")
        ctl = self.control(samplings[0] if n else sampling, gamma, threshold, (), sts, table)
        idx = list(range(n)) if sample_index is None else [int(i) for i in sample_index]
        req_keys = np.asarray(jax.random.key_data(jax.vmap(lambda sd, i: jax.random.fold_in(jax.random.key(sd), i))(
            jnp.asarray(seeds, jnp.uint32), jnp.asarray(idx, jnp.uint32)))) if n else None
        tr = Traces(self.G) if traces else None
        st = self.init_state()
        queue = list(range(len(prompts)))
        slot_req = np.full((self.R,), -1, np.int64)
        t_start = np.zeros(len(prompts))
        results: list[RequestResult | None] = [None] * len(prompts)
        calls = 0
        t0 = time.perf_counter()
        while True:
            free = np.flatnonzero(slot_req < 0).tolist()
            take, slots = [], []
            while queue and len(slots) < len(free) and self.reserve(free[len(slots)], len(prompts[queue[0]]),
                                                                    max_news[queue[0]]):
                slots.append(free[len(slots)])
                take.append(queue.pop(0))
            if take:
                st, ctl = self.start(st, ctl, slots, [prompts[i] for i in take], req_keys[take],
                                     [max_news[i] for i in take], [samplings[i] for i in take],
                                     [stops[i] for i in take])
                slot_req[slots] = take
                t_start[take] = time.perf_counter()
            if not (slot_req >= 0).any():
                break
            if loop == "host":
                st, ro = self.step(st, ctl)
                calls += 1
                if tr is not None:
                    tr.add(calls - 1, slot_req, ro)
            else:
                if self.pages is not None:
                    st = self._pages_for_rounds(st, whole_request=True)
                st, _ = self._loop(self.tp, self.dp, st, ctl, jnp.int32(1 << 30), jnp.asarray(bool(queue)))
                calls += 1
            active = np.asarray(st.active)
            finished = np.flatnonzero((slot_req >= 0) & ~active).tolist()
            if finished:
                now = time.perf_counter()
                n_gen, rounds, acc, out, fin = jax.device_get((st.n_gen, st.rounds, st.acc_sum, st.out, st.finish))
                for s in finished:
                    i = int(slot_req[s])
                    results[i] = RequestResult(out[s, : n_gen[s]].tolist(), len(prompts[i]), int(rounds[s]),
                                               int(acc[s]), now - t_start[i], FINISH_REASONS[int(fin[s])])
                    slot_req[s] = -1
                st = self.release(st, finished)  # paged KV: its pages go back to the pool at once
        return GenerateResult(results, time.perf_counter() - t0, calls, tr)


def measure_accepted_length(target, drafter, prompts, *, max_new_tokens: int = 64, gamma: int | None = None,
                            sampling: SamplingParams | None = None, num_slots: int = 8, max_len: int | None = None,
                            seed: int = 0, stop_ids=(), layer_ids=None) -> float:
    """tau = mean over all rounds of (accepted + 1), fixed-gamma verification (default T = 1)."""
    longest = max(len(p) for p in prompts)
    G = gamma or getattr(drafter, "gamma", 7)
    S = max_len or (longest + max_new_tokens + G + 2)
    eng = Engine(target, drafter, num_slots=min(num_slots, len(prompts)), max_len=S, gamma=gamma, layer_ids=layer_ids)
    res = eng.generate(prompts, max_new_tokens=max_new_tokens, sampling=sampling or SamplingParams(1.0, 0, 1.0),
                       seed=seed, stop_ids=stop_ids)
    return res.tau


def decode_shardings(state: DecodeState, mesh):
    """Layout of a DecodeState on `mesh`: per-slot arrays split over `data` (slots), KV caches
    [L, R, S, Nkv, D] also over `tensor` (KV heads), scalars replicated. A paged cache's pool
    [L, pages, Nkv, page_size, D] has no slot axis (`PAGE_AXES`): KV heads over `tensor`, whole on
    `data` (every data shard holds the pool; page tables split with their slots), as the paged
    kernel's shard_map reads it. An axis that does not divide its dimension is left whole
    (`logical_to_pspec`)."""
    from jax.sharding import NamedSharding

    from dspark_jax.parallel.sharding import logical_to_pspec

    r = state.anchor.shape[0]

    def one(x, names):
        return NamedSharding(mesh, logical_to_pspec(names, x.shape, mesh))

    def per_slot(x):
        if x.ndim == 0:
            return one(x, ())
        names = ["batch" if d == r and i == 0 else None for i, d in enumerate(x.shape)]
        return one(x, names)

    def cache(c):
        if isinstance(c, PagedKVCache):
            pool = lambda a: one(a, PAGE_AXES)
            return c._replace(k=pool(c.k), v=pool(c.v), page_table=per_slot(c.page_table), lengths=per_slot(c.lengths))
        kv = lambda a: one(a, (None, "batch", None, "kv_heads", None))
        return type(c)(kv(c.k), kv(c.v), per_slot(c.lengths))

    out = jax.tree.map(per_slot, state._replace(cache=None, dcache=None))
    hist = one(state.a_hist, (None, "batch", None))
    return out._replace(cache=cache(state.cache), dcache=cache(state.dcache), a_hist=hist)
