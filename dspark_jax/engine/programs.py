"""An engine's compiled programs: prefill (one per prompt-length bucket), the round, the
`lax.while_loop` of rounds, the draft alone, and a join without a forward (chunked prefill).
Under a skip rule also the skip rule's choice and each round it chooses from, one program each:
a host loop runs the chosen one alone (`Engine.step`). On XLA:CPU the skipped round of the
program holding every round took about 0.8 ms more than the plain round compiled alone (its
launch took longer; why is not established: a zero-iteration loop around heavy work alone cost
nothing in a small test; docs/serving.md).

The decode state is donated to every program that returns it; with a mesh it keeps its layout
from call to call (`state_sh`). Engines of the same static description (`Spec`, and the state's
layout) share one set of jitted programs in a process, so a second engine of the same shapes
compiles nothing: the weights, the state and every setting are arguments."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax

from dspark_jax.engine.round import admit, chosen_rounds, draft_part, prefill, round_choice, round_step, run_rounds
from dspark_jax.engine.spec import Spec
from dspark_jax.io.program_store import stored_jit
from dspark_jax.target.attention import cache_update
from dspark_jax.target.forward import forward

__all__ = ["Programs", "compile_programs", "clear_shared_programs"]

SHARED_PROGRAM_SETS = 16  # engine shapes whose programs a process keeps (each holds its compiled executables)


class Programs(NamedTuple):
    prefill: object  # (tp, dp, st, tokens, plen, join, keys, max_new) -> st
    round: object  # (tp, dp, st, ctl) -> (st, RoundOut)
    loop: object  # (tp, dp, st, ctl, max_rounds, stop_on_free) -> (st, rounds)
    draft: object  # (dp, st, sampling) -> (tokens, q, z); None for target-only
    admit: object  # (st, tokens, plen, join, keys, max_new) -> st
    choose: object  # (st, ctl) -> int32 ROUND_*: the skip rule's round; None without a skip rule
    rounds: tuple | None  # the rounds it chooses from, by ROUND_* index: (tp, dp, st, ctl) -> (st, RoundOut)


def compile_programs(spec: Spec, state_sh=None, state_shape=None) -> Programs:
    """The jitted programs of `spec`, shared by every engine of the same spec, argument shapes
    (`state_shape`: the shapes of a fresh state and of the weights, so each engine's programs are
    compiled once for it: dense or paged, one drafter head or another) and state layout.
    A spec that cannot be hashed (a test's unhashable policy) gets programs of its own."""
    leaves, treedef = jax.tree.flatten(state_shape)
    key = (spec, state_sh, treedef, tuple((x.shape, str(x.dtype)) for x in leaves))
    try:
        hash(key)
    except TypeError:  # e.g. a policy object without __hash__
        return _programs(spec, state_sh)
    return _shared_programs(key)


@functools.lru_cache(maxsize=SHARED_PROGRAM_SETS)
def _shared_programs(key) -> Programs:
    return _programs(key[0], key[1])


def clear_shared_programs() -> None:
    """Forget the shared programs: the next engine traces its own (a test that changes a function
    the programs call must see its change traced)."""
    _shared_programs.cache_clear()


def _programs(spec: Spec, state_sh) -> Programs:
    """The target's weights are an argument of each program, laid out per layer
    (`target.decode_weights`), so every program reads each weight once."""

    def _prefill(tp, dp, st, tokens, plen, join, keys, max_new):
        def apply(tok, pos, valid, cache, fl, slots=None):
            return forward(tp, spec.tcfg, tok, pos, cache_update(cache, pos, valid, slots), feature_layers=fl,
                           return_logits=False)

        return prefill(spec, apply, None, dp, st, tokens, plen, join, keys, max_new)

    state_kw = {} if state_sh is None else {"out_shardings": state_sh}
    round_kw = {} if state_sh is None else {"out_shardings": (state_sh, None)}
    static = (spec, state_sh)  # what the programs close over: the key of their stored executables
    chosen = spec.chooses_rounds
    return Programs(
        prefill=stored_jit(_prefill, "engine_prefill", static, donate_argnums=(2,), **state_kw),
        round=stored_jit(functools.partial(round_step, spec), "engine_round", static, donate_argnums=(2,),
                         **round_kw),
        loop=stored_jit(functools.partial(run_rounds, spec), "engine_loop", static, donate_argnums=(2,)),
        draft=stored_jit(functools.partial(draft_part, spec), "engine_draft", static) if spec.G else None,
        admit=stored_jit(admit, "engine_admit", static, donate_argnums=(0,), **state_kw),
        choose=stored_jit(functools.partial(round_choice, spec), "engine_round_choice", static) if chosen else None,
        rounds=tuple(stored_jit(r, f"engine_round_{name}", static, donate_argnums=(2,), **round_kw)
                     for r, name in zip(chosen_rounds(spec), ("plain", "settled", "drafting"))) if chosen else None)
