"""The Engine: R request slots, bucketed prefill, one compiled round.

    engine = Engine(target, drafter, EngineConfig(num_slots=8, max_len=512))   # drafter None = target-only
    res = engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=64, sampling=SamplingParams(0.7, 20, 0.8))
    res.results[0].tokens, res.results[0].tau

What the drafter does in a round comes from its kind's adapter (drafter/kinds/, found by
`registry.kind_of`); None is target-only autoregressive decoding. Compiled programs
(engine/programs.py): one round (all verification buckets inside one `lax.switch`), one prefill per
prompt-length bucket, optionally one `lax.while_loop` of rounds. Sampling settings, gamma,
threshold, cost table and stop ids are traced: switching them never recompiles. Continuous
batching (which request runs in which slot) is the Batcher's (engine/batcher.py).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.decoding import rejection
from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.drafter import registry
from dspark_jax.drafter.decode_weights import drafter_decode_arrays
from dspark_jax.engine import batcher, own_costs, rows
from dspark_jax.engine.buckets import (
    bucket_for,
    default_buckets,
    prefill_buckets,
    tiled,
    with_chunk_room,
)
from dspark_jax.engine.config import EngineConfig
from dspark_jax.engine.drafter_fit import check_confidence_head, draft_shape
from dspark_jax.engine.errors import EngineConfigError, EngineError, InvalidRequest
from dspark_jax.engine.layout import decode_shardings, fresh_state
from dspark_jax.engine.page_alloc import PageAllocator
from dspark_jax.engine.policy import SCHEDULED, get_policy
from dspark_jax.engine.programs import compile_programs
from dspark_jax.engine.requests import (
    MAX_STOP_IDS,
    Checked,
    Limits,
    check_request,
    reach,
    stop_row,
)
from dspark_jax.engine.results import GenerateResult, RequestResult
from dspark_jax.engine.round import ROUND_DRAFTING, ROUND_PLAIN, ROUND_SETTLED
from dspark_jax.engine.slot_pages import SlotPages
from dspark_jax.engine.spec import Spec
from dspark_jax.engine.state import PIN_POLICY, PIN_SKIP, Control, DecodeState
from dspark_jax.parallel.sharding import shard_model, state_shardings
from dspark_jax.scheduler import prefix
from dspark_jax.target.decode_weights import decode_arrays
from dspark_jax.target.kernels import per_layer_decode, row_tile
from dspark_jax.target.paged_kernel import resolve_impl
from dspark_jax.target.paged_kv import pages_per_slot

log = logging.getLogger(__name__)

__all__ = ["Engine", "EngineConfig", "EngineError", "EngineConfigError", "InvalidRequest", "RequestResult",
           "GenerateResult", "default_buckets", "with_chunk_room", "decode_shardings", "measure_accepted_length",
           "MAX_STOP_IDS"]


class Engine:
    """Speculative decoding over `config.num_slots` request slots (settings: engine/config.py).

    `table`: the measured cost table a scheduler or skip rule prices verification with (its buckets
    become the engine's unless the config names them; also per call). `mesh` (a (data, fsdp,
    tensor) mesh): weights laid out by the rules table, the decode state with slots over `data`
    and KV heads over `tensor`. `kind` (the drafter's adapter, default from the registry) and
    `verify` (batched rejection sampling) are injection points for tests of broken variants.
    With `config.kv_pages`, `self.pages` is the host page allocator of the paged caches.
    `self.state_shape`: the decode state's shapes (ShapeDtypeStructs), for compiling its programs
    ahead of time without allocating one.

    Where the programs run the layers over per-layer weights (accelerators:
    `target.kernels.per_layer_decode`), the target model gives up its stacked decoder weights
    for the engine's per-layer split and reads that split when called afterwards (with a mesh,
    the caller's model is laid out on it in place first): one copy of the layers, shared by the
    model and every engine built on it (`config.keep_target_stacks` keeps the stacks beside the
    split instead). Elsewhere the programs read the model's own arrays.
    """

    def __init__(self, target, drafter=None, config: EngineConfig | None = None, *, table=None, mesh=None,
                 kind=None, verify=rejection.verify):
        cfg = self.config = EngineConfig() if config is None else config
        if not isinstance(cfg, EngineConfig):
            raise EngineConfigError(f"Engine takes an EngineConfig as its third argument, got {type(cfg).__name__}")
        tmodel = target if hasattr(target, "lm_head_weight") else target.model
        self.mesh = mesh
        per_layer = per_layer_decode(mesh)
        if mesh is not None:
            # where the layers are split per layer, the caller's model itself is laid out and then
            # holds the split (`decode_arrays`), so it reads the arrays the engine reads
            tmodel = place_model(tmodel, mesh) if per_layer and not cfg.keep_target_stacks else \
                shard_model(tmodel, mesh)
            drafter = None if drafter is None else shard_model(drafter, mesh)
        self.target, self.drafter = tmodel, drafter
        self.kind = None if drafter is None else (kind or _kind_of(drafter))
        self.mode = "ar" if self.kind is None else self.kind.name
        shape = None if drafter is None else draft_shape(self.kind, drafter, tmodel, cfg.gamma, cfg.layer_ids)
        G = self.G = 0 if shape is None else shape.G
        R, S = self.R, self.S = int(cfg.num_slots), int(cfg.max_len)
        if S < G + 3:
            raise EngineError(f"max_len {S} is too short for gamma {G}: need at least {G + 3}")
        chunk = cfg.prefill_chunk or 0
        # buckets a cost table prices (the scheduler's choices), and those compiled: the same, plus
        # chunk-only ones beyond the largest when prompt chunks need the room
        priced = cfg.buckets or (np.asarray(table.buckets) if table is not None else default_buckets(R, G, chunk))
        self.priced_buckets = tuple(sorted(set(int(b) for b in priced)))
        if self.priced_buckets[-1] < R * (G + 1):
            raise EngineError(f"largest verification bucket {self.priced_buckets[-1]} < num_slots * (gamma + 1) = "
                              f"{R * (G + 1)}: a round could not fit; add a bucket of that size")
        # compiled: those, chunk-only ones, and none smaller than the platform's row tile
        self.buckets = tiled(with_chunk_room(self.priced_buckets, R, G, chunk), row_tile(mesh))
        self.pages = None if cfg.kv_pages is None else \
            PageAllocator(*cfg.kv_pages, R, pages_per_slot(S, cfg.kv_pages[1]))
        try:  # the request rides in the caches; the backend resolves it where the programs are traced
            self.cache_reads = resolve_impl(cfg.paged_attention, mesh)
        except ValueError as e:
            raise EngineError(str(e)) from None
        self.paged_attention = cfg.paged_attention
        self.gamma = G if cfg.gamma is None else int(cfg.gamma)
        self.prefill_buckets = tuple(sorted(cfg.prefill_buckets or prefill_buckets(S)))
        policy, skip_rule = cfg.scheduling(self.kind, drafter)
        skip_rule = skip_rule if G > 0 else None
        self.policy_name = policy if isinstance(policy, str) else getattr(policy, "__name__", "custom")
        self.needs_table = G > 0 and (policy in SCHEDULED or skip_rule is not None)
        check_confidence_head(drafter, cfg, G, skip_rule, self.mode, policy)
        self.spec = Spec(kind=self.kind, draft=shape, tcfg=tmodel.cfg, buckets=self.buckets, max_len=S,
                         policy=get_policy(policy, cfg.theta, cfg.cost), verify=verify, skip_drafting=skip_rule,
                         theta=cfg.theta, probe_every=int(cfg.probe_every), probe_max=int(cfg.probe_max),
                         prefill_chunk=int(chunk), prefill_rows=min(int(cfg.prefill_rows), R) if chunk else 0,
                         prefill_tokens=int(cfg.prefill_tokens),
                         verify_widths=(1, G + 1) if G and (skip_rule is not None or policy != "fixed") else ())
        self.table = None if table is None else self._checked_table(table)
        self.own_table = None  # the table this engine measured or read back (engine/own_costs.py)
        # policies that never read a table still need one in the compiled round's signature; a
        # round timed with it lands in the smallest bucket that holds its tokens
        self.unpriced_table = prefix.make_table(self.priced_buckets, t_verify=np.ones(len(self.priced_buckets)),
                                                  t_draft=0.0)
        # the target's weights one array per layer: what every compiled program reads (each once).
        # The model gives up its stacked layers for this split and reads it from then on, and a
        # later engine on the same model takes it as it is: the layers are held once
        # (target/decode_weights.py)
        self.tp = decode_arrays(tmodel, per_layer=per_layer, hold=not cfg.keep_target_stacks)
        self.dp = {} if drafter is None else drafter.arrays() if not self.kind.decode_layout else \
            drafter_decode_arrays(drafter.arrays(), shape.cfg, per_layer, mesh)
        state_shape = self.state_shape = jax.eval_shape(self._fresh_state)
        self._state_sh = None if mesh is None else decode_shardings(state_shape, mesh)
        self._paging = None if self.pages is None else SlotPages(self.pages, S, G, self._place_table)
        # shared with engines of the same spec and argument shapes (state, target and drafter weights)
        shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (self.tp, self.dp))
        progs = compile_programs(self.spec, self._state_sh, (state_shape, shapes))
        self._prefill, self._round, self._loop, self._draft, self._admit, self._choose, self._rounds = progs
        self.round_calls = 0
        # (state, controls, choice): the skip rule's choice for the next round, made by the round
        # that returned that state under those controls (`step`)
        self._next_round = (None, None, None)

    @property
    def prefill_chunk(self) -> int:
        """Prompt tokens a round forwards for joining slots (0: prompts are prefilled whole)."""
        return self.spec.prefill_chunk

    @property
    def min_prompt_len(self) -> int:
        """The shortest prompt the drafter kind takes (1 for target-only)."""
        return 1 if self.kind is None else self.kind.min_prompt_len

    @property
    def room(self) -> int:
        """Tokens a request's prompt and answer may hold together: max_len - gamma - 2."""
        return self.S - self.G - 2

    # ------------------------------------------------------------ requests

    def validate_request(self, prompt, max_new, **kw) -> Checked:
        """One request checked against this engine's ranges -> its normalised values, or
        InvalidRequest naming the field (keywords: engine/requests.py `check_request`)."""
        lim = Limits(min_prompt=self.min_prompt_len, room=self.room,
                     vocab_size=self.target.cfg.vocab_size, max_len=self.S, G=self.G, mode=self.mode, pages=self.pages)
        return check_request(lim, prompt, max_new, **kw)

    def reserve(self, slot: int, prompt_len: int, max_new: int) -> bool:
        """Admission: True when `slot` may take a request of this size now (always, without paged KV;
        with it, when the page pool can hold its whole reach beside the running requests')."""
        return self.pages is None or self.pages.reserve(slot, reach(prompt_len, max_new, self.G, self.S))

    def pages_to_reserve(self, prompt_len: int, max_new: int) -> int:
        """KV pages a request of this size may come to hold."""
        return self.pages.pages_for(reach(prompt_len, max_new, self.G, self.S))

    def release(self, st: DecodeState, slots) -> DecodeState:
        """The requests of `slots` ended: their pages and reservations go back to the pool."""
        return st if self._paging is None or not len(slots) else self._paging.end(st, slots)

    def cancel(self, st: DecodeState, slots) -> DecodeState:
        """End the requests of `slots` now: their slots stop decoding and free their pages."""
        if not len(slots):
            return st
        keep = np.ones((self.R,), bool)
        keep[list(slots)] = False  # a fixed-shape mask: one compiled op for any number of slots
        st = self.release(st, slots)
        return st._replace(active=st.active & jax.device_put(keep))

    # ------------------------------------------------------------ state / controls

    def init_state(self) -> DecodeState:
        """A fresh decode state (every slot free); with paged KV the page allocator empties too."""
        if self.pages is not None:
            self.pages.reset()
        self._next_round = (None, None, None)  # nor does the old state stay alive through it
        return self._placed_fresh_state()

    def _placed_fresh_state(self) -> DecodeState:
        st = self._fresh_state()
        return st if self.mesh is None else jax.device_put(st, self._state_sh)

    def _fresh_state(self) -> DecodeState:
        dtype = jax.tree.leaves(self.tp["layers"])[0].dtype
        return fresh_state(self.spec, self.target.cfg, self.drafter, self.R, dtype, self.pages, self.paged_attention,
                           chunked=bool(self.prefill_chunk))

    def _place_table(self, table: np.ndarray) -> jax.Array:
        t = jnp.array(table)
        return t if self.mesh is None else jax.device_put(t, self._state_sh.cache.page_table)

    def control(self, sampling: SamplingParams | None = None, gamma: int | None = None, threshold: float = 0.0,
                stop_ids=(), sts=None, table=None, default_k: int | None = None, pin: int = PIN_POLICY) -> Control:
        """The traced settings of a call, every slot alike (`start` writes per-request rows).
        `pin` (for timing rounds, engine/own_costs.py): `PIN_POLICY`, a verification length
        every active slot drafts and verifies, or `PIN_SKIP` (a skipped round)."""
        g = self.gamma if gamma is None else int(gamma)
        if g > self.G or g < 0:
            raise EngineError(f"gamma {g} is outside this engine's compiled range 0..{self.G} (the block size it was "
                              f"built with); build the Engine with a larger gamma / drafter block")
        if not (pin in (PIN_POLICY, PIN_SKIP) or 0 <= pin <= self.G):
            raise EngineError(f"pin {pin} is neither PIN_POLICY, PIN_SKIP nor a verification length 0..{self.G}")
        # host arrays put on the device: no eager jnp op, each of which compiles a program per shape
        s = SamplingParams(*jax.device_put([np.full((self.R,), v, dt) for v, dt in
                                            zip(sampling or SamplingParams(), (np.float32, np.int32, np.float32))]))
        stops = jax.device_put(np.broadcast_to(np.asarray(stop_row(stop_ids), np.int32), (self.R, MAX_STOP_IDS)))
        Gs = self.spec.Gs
        sts = jax.device_put(np.ones((Gs,), np.float32) if sts is None else np.asarray(sts, np.float32)[:Gs])
        if sts.shape != (Gs,):
            raise EngineError(f"sts temperatures need {Gs} values, got {sts.shape[0]}")
        table = self._checked_table(table) if table is not None else self.table
        if table is None and self.measures_own_table:
            table = self.measure_own_table().table
        if table is None:
            if self.needs_table:
                raise EngineError(f"policy {self.policy_name!r}"
                                  f"{' with skip_drafting' if self.spec.skip_drafting else ''} prices verification "
                                  "with a measured cost table and none was given: pass table= (to the Engine or "
                                  "this call; measure one with `python -m dspark_jax costs measure`), or leave "
                                  "EngineConfig.own_costs on")
            table = self.unpriced_table
        gamma, threshold, default_k, pin = jax.device_put((np.int32(g), np.float32(threshold), np.int32(
            self.R * g if default_k is None else int(default_k)), np.int32(pin)))
        return Control(sampling=s, gamma=gamma, threshold=threshold, sts=sts, table=table, default_k=default_k,
                       stop_ids=stops, pin=pin)

    @property
    def measures_own_table(self) -> bool:
        """Whether building controls without a table will time this engine's programs (or read
        its table back): it schedules, was given no table and `own_costs` is on."""
        return self.table is None and self.needs_table and self.config.own_costs

    @property
    def scheduling(self) -> str:
        """The policy and skip rule in words, e.g. "production, skip rule known"."""
        skip = self.spec.skip_drafting
        return f"{self.policy_name}, {'skip rule ' + skip if skip else 'no skip rule'}"

    @property
    def table_source(self) -> str:
        """Which cost table the rounds price with: "given", "own (measured)", "own (read back)",
        what `own_costs` will do (before it ran) or "none" (the policy reads none)."""
        if self.table is not None and self.own_table is None:
            return "given"
        if self.own_table is not None:
            return f"own ({self.own_table.source})"
        return own_costs.planned(self) if self.measures_own_table else "none"

    def measure_own_table(self, reuse: bool = True):
        """This engine's own cost table (engine/own_costs.py: read back from the user cache, or
        timed now on its compiled programs), kept as its table -> `OwnTable`. One process only:
        across processes each would time (or read back) its own and feed the program different
        controls."""
        if jax.process_count() > 1:
            raise EngineError(f"this engine spans {jax.process_count()} processes, and each would measure its own "
                              "cost table: pass table= (one measured with `python -m dspark_jax costs measure`, "
                              "loaded on every process) or policy='fixed'")
        self.own_table = own_costs.own_table(self, repeats=self.config.own_costs_repeats, reuse=reuse)
        self.table = self.own_table.table
        log.info("%s", self.own_table.describe())
        return self.own_table

    def _checked_table(self, table):
        """The table must price every bucket the scheduler may choose and nothing beyond the
        largest (a finer grid inside it is allowed); chunk-only buckets are never priced."""
        got = [int(b) for b in np.asarray(table.buckets)]
        missing = sorted(set(self.priced_buckets) - set(got))
        if missing or got[-1] != self.priced_buckets[-1]:
            raise EngineError(f"the cost table's buckets {got} do not match this engine's verification "
                              f"buckets {list(self.priced_buckets)}"
                              f"{f' (unpriced: {missing})' if missing else ''}: build the Engine with "
                              "table= (its buckets become the engine's), or measure the table for these buckets")
        return table

    # ------------------------------------------------------------ compiled calls

    def prefill_slots(self, st: DecodeState, slots, prompts, key_data, max_new) -> DecodeState:
        """Start `prompts` (lists of ids) in `slots` with per-request key data rows (`jax.random.key_data`);
        one compiled prefill per prompt-length bucket."""
        P = bucket_for(self.prefill_buckets, max(len(p) for p in prompts))
        if P is None:
            raise EngineError(f"prompt of {max(len(p) for p in prompts)} tokens exceeds the largest prefill bucket "
                              f"{self.prefill_buckets[-1]}")
        args = rows.join_rows(self.R, st, P, slots, prompts, key_data, max_new)
        if self._paging is not None:  # pages for the prompt and the first round; free slots give theirs back
            st = self._paging.for_join(st, slots, prompts, idle=np.flatnonzero(~np.asarray(st.active)).tolist())
        return self._prefill(self.tp, self.dp, st, *args)

    def admit_slots(self, st: DecodeState, slots, prompts, key_data, max_new) -> DecodeState:
        """Start `prompts` in `slots` without forwarding them (chunked prefill): the rounds forward
        them in chunks beside the running requests."""
        args = rows.join_rows(self.R, st, self.S, slots, prompts, key_data, max_new)
        if self._paging is not None:  # pages for the whole prompt and the first round, as a prefill's
            st = self._paging.for_join(st, slots, prompts)
        return self._admit(st, *args)

    def start(self, st: DecodeState, ctl: Control, slots, prompts, key_data, max_new, samplings, stop_ids):
        """Requests join `slots` (prefilled per prompt-length bucket, or with chunked prefill while
        others run handed to the rounds), their sampling settings and stop ids written into those
        slots' rows of the traced controls -> (state, controls)."""
        key_data, max_new = np.asarray(key_data), [min(int(m), self.S) for m in max_new]
        if self.prefill_chunk and bool(np.asarray(jax.device_get(st.active)).any()):
            st = self.admit_slots(st, slots, prompts, key_data, max_new)
        else:
            for js in rows.by_bucket(self.prefill_buckets, prompts):
                st = self.prefill_slots(st, [slots[j] for j in js], [prompts[j] for j in js], key_data[js],
                                        [max_new[j] for j in js])
        return st, rows.control_rows(ctl, slots, samplings, stop_ids)

    def step(self, st: DecodeState, ctl: Control):
        """One compiled round for the whole batch -> (state, RoundOut). With paged KV the host
        first frees the pages of finished slots and tops up the active ones for this round. Under
        a skip rule the host reads the rule's choice (`round.round_choice`, a scalar) and runs
        that round's own program: a skipped round then costs what the plain round does, not
        what a program holding the drafting round beside it costs. Each round also returns the
        choice for the next one, which is read instead while the state comes back untouched
        under the same controls (objects compared by identity)."""
        given = st
        if self._paging is not None:
            st = self._paging.for_rounds(st, whole_request=False)
        self.round_calls += 1
        if self._rounds is None:
            return self._round(self.tp, self.dp, st, ctl)
        last_state, last_ctl, chosen = self._next_round
        if given is not last_state or ctl is not last_ctl:  # a join, an end, new controls: ask again
            chosen = self._choose(st, ctl)
        which = int(np.asarray(chosen.addressable_data(0)))  # the same on every process
        st, out, chosen = self._rounds[which](self.tp, self.dp, st, ctl)
        self._next_round = (st, ctl, chosen)
        return st, out

    def round_programs(self) -> dict:
        """The programs a host loop of rounds runs, by name ("round", or under a skip rule
        "plain", "settled" (rules on survivals only) and "drafting")."""
        if self._rounds is None:
            return {"round": self._round}
        rounds = {"plain": self._rounds[ROUND_PLAIN], "settled": self._rounds[ROUND_SETTLED],
                  "drafting": self._rounds[ROUND_DRAFTING]}
        if not self.spec.reads_survivals:
            del rounds["settled"]
        return rounds

    def compile_rounds(self, ctl: Control) -> None:
        """Compile (or read back) every round program a host loop may run under controls shaped
        as `ctl` (the loop's own: a table with or without a skipped round's price is another
        signature), on a fresh state with no request: a server's warm-up serves requests
        through the rounds it happens to choose, and a round first chosen mid-serving would
        compile then."""
        if self._rounds is None:
            return
        for program in self.round_programs().values():  # not `init_state`: the page allocator keeps its requests
            jax.block_until_ready(program(self.tp, self.dp, self._placed_fresh_state(), ctl)[:2])

    def run_rounds(self, st: DecodeState, ctl: Control, stop_on_free: bool) -> DecodeState:
        """Rounds in one compiled `lax.while_loop` until every slot is done, or (`stop_on_free`)
        until one frees up for a waiting request."""
        if self._paging is not None:
            st = self._paging.for_rounds(st, whole_request=True)
        return self._loop(self.tp, self.dp, st, ctl, jnp.int32(1 << 30), jnp.asarray(bool(stop_on_free)))[0]

    def draft(self, st: DecodeState, ctl: Control):
        """What the next round would draft from `st`, alone (the state is not donated):
        (tokens [R, G], q [R, G, V], z [R, G]). For cost tables and inspection."""
        if self._draft is None:
            raise EngineError("target-only engine: there is no drafter to run")
        return self._draft(self.dp, st, ctl.sampling)

    def compiled_rounds(self) -> int:
        """How many times any one round program has been compiled (1 for any number of buckets /
        settings; under a skip rule, the most of its round programs')."""
        return max(p._cache_size() for p in self.round_programs().values())

    def compiled_programs(self) -> int:
        """Executables the round programs and the prefill hold in all: what serving must not add
        once warm (traffic after the warm-up, a timed benchmark level)."""
        return sum(p._cache_size() for p in self.round_programs().values()) + self._prefill._cache_size()

    def generate(self, prompts, **kw) -> GenerateResult:
        """Generate for every prompt (lists of token ids), R at a time, refilling freed slots
        (keywords: engine/batcher.py `generate`)."""
        return batcher.generate(self, prompts, **kw)


def place_model(model, mesh):
    """`model`'s weights laid out on `mesh` by the rules table, in place (the model object the
    caller holds is the one laid out): arrays already laid out so stay as they are."""
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, state_shardings(state, mesh)))
    return model


def _kind_of(drafter):
    try:
        return registry.kind_of(drafter)
    except ValueError as e:
        raise EngineError(str(e)) from None


def measure_accepted_length(target, drafter, prompts, *, max_new_tokens: int = 64, gamma: int | None = None,
                            sampling: SamplingParams | None = None, num_slots: int = 8, max_len: int | None = None,
                            seed: int = 0, stop_ids=(), layer_ids=None) -> float:
    """tau = mean over all rounds of (accepted + 1), fixed-gamma verification (default T = 1).
    One verification bucket, the full R x (gamma + 1): fixed-gamma rounds of a full engine all
    use it, and the buckets a scheduler picks from would be compiled for the few tail rounds."""
    G = draft_shape(_kind_of(drafter), drafter, target, gamma, layer_ids).G
    S = max_len or (max(len(p) for p in prompts) + max_new_tokens + G + 2)
    R = min(num_slots, len(prompts))
    config = EngineConfig(num_slots=R, max_len=S, gamma=gamma, layer_ids=layer_ids, buckets=(R * (G + 1),),
                          policy="fixed")
    res = Engine(target, drafter, config).generate(prompts, max_new_tokens=max_new_tokens, seed=seed,
                                                   sampling=sampling or SamplingParams(1.0, 0, 1.0), stop_ids=stop_ids)
    return res.tau
