"""The compiled round writes the caches in place: no copy of a whole cache (issue 16).

A round used to carry the caches through `lax.scan` as xs -> ys, which made XLA copy the whole
cache several times per round (a tiny model's round needed more temporaries than its caches).
The caches now ride in the scan carry and the state is donated; these tests read the compiled
program: its temporaries stay far below one cache, and no `copy` in the optimized HLO has a whole
cache's shape. A round that copied a cache fails both (checked against `xs_ys_round` below)."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.engine.round import round_step
from dspark_jax.testing.tiny import tiny_config, tiny_drafter, tiny_target

KINDS = ["none", "dspark", "eagle3", "mtp1"]


@pytest.fixture(scope="module")
def target():
    """8 layers: a round's per-layer working set (one layer's K / V view for attention) is an
    eighth of the cache, so a whole-cache copy stands out."""
    return tiny_target(tiny_config(vocab_size=16, hidden_size=32, num_layers=8), logit_scale=1.0)


def _compiled_round(eng, round_fn=round_step):
    st, ctl = eng.init_state(), eng.control()
    c = jax.jit(functools.partial(round_fn, eng.spec), donate_argnums=(2,)).lower(eng.tp, eng.dp, st, ctl).compile()
    return st, c


def _whole_cache_copies(hlo: str, shapes) -> list[str]:
    """`copy` instructions whose result has one of `shapes` (dims as in HLO, any layout)."""
    found = []
    for line in hlo.splitlines():
        m = re.search(r"= f32\[([\d,]+)\]\{[^}]*\} copy\(", line)
        if m and tuple(int(x) for x in m.group(1).split(",")) in shapes:
            found.append(line.strip()[:160])
    return found


def _engine(target, kind, kv_pages=None, prefill_chunk=None):
    """kind "dspark-threshold": a policy that may verify no drafts (one- and full-width views)."""
    base, _, policy = kind.partition("-")
    drafter = None if base == "none" else tiny_drafter(base, target, gamma=3)
    # a long context makes one cache far larger than anything else a round touches
    return Engine(target, drafter, EngineConfig(num_slots=4, max_len=1024, prefill_buckets=(16,), kv_pages=kv_pages,
                                                prefill_chunk=prefill_chunk, policy=policy or "fixed"))


@pytest.mark.parametrize("kind,paged,chunk", [(k, False, None) for k in KINDS]
                         + [("none", True, None), ("dspark", True, None), ("eagle3", True, None)]
                         + [("dspark", False, 8), ("eagle3", True, 8), ("dspark-threshold", False, None)])
def test_round_keeps_caches_in_place(target, kind, paged, chunk):
    """No copy of the target cache nor of the drafter's cache, for every kind (Eagle3 / MTP-1's
    one-layer cache was copied around its scatter while their attention read it before writing).
    `paged`: both caches as page pools (256 pages of 16, as many positions as the dense caches):
    no copy of a pool either. `chunk`: the round also forwards prompt chunks (its own attention
    view under a `lax.cond`, written after the switch like the block, and the drafter's prefill)."""
    eng = _engine(target, kind, (256, 16) if paged else None, chunk)
    st, c = _compiled_round(eng)
    assert len(eng.spec.widths) == (2 if kind.endswith("threshold") else 1)
    caches = [st.cache] + ([st.dcache] if kind != "none" else [])
    shapes = {tuple(x.shape) for cache in caches for x in (cache.k, cache.v)}
    cache_bytes = st.cache.k.nbytes + st.cache.v.nbytes
    temps = c.memory_analysis().temp_size_in_bytes
    assert temps < cache_bytes / 2, (temps, cache_bytes)  # a copy of K alone is half the cache
    assert not _whole_cache_copies(c.as_text(), shapes)


def test_the_old_round_that_wrote_inside_the_bucket_switch_is_caught(target, monkeypatch):
    """The round as it was: the cache written by the verification inside the `lax.switch` over
    buckets (several buckets, as the default DSpark engine compiles). XLA copied the whole cache
    there; both checks see it."""
    from dspark_jax.engine import round as round_mod
    from dspark_jax.engine.verify import verify_packed

    def written_inside(tp, cfg, cache, tokens, start, valid, *, bucket, feature_layers=(), packed_logits=False,
                       **_):
        vo = verify_packed(tp, cfg, cache, tokens, start, valid, bucket=bucket, feature_layers=feature_layers)
        vo = vo._replace(k_new=vo.cache.k, v_new=vo.cache.v)  # the written cache leaves the switch
        if packed_logits:  # the packed view the round now asks for
            from dspark_jax.target.packing import pack

            pk = pack(tokens, start, valid, bucket, cache.max_len)
            r, t = valid.shape
            return vo._replace(logits=vo.logits.reshape(r * t, -1)[:bucket], packing=pk._replace(
                dest=jnp.arange(r * t, dtype=jnp.int32)))
        return vo

    def write_nothing(cache, k, v, start, valid, rows=None):
        return cache._replace(k=k, v=v)

    monkeypatch.setattr(round_mod, "verify_forward", written_inside)
    monkeypatch.setattr(round_mod, "write_block", write_nothing)
    eng = _engine(target, "dspark")
    assert len(eng.buckets) > 1
    st, c = _compiled_round(eng)
    temps = c.memory_analysis().temp_size_in_bytes
    copies = _whole_cache_copies(c.as_text(), {tuple(st.cache.k.shape)})
    if not copies and jax.__version_info__ >= (0, 12):
        pytest.skip("XLA in jax 0.12 writes this round's caches in place too: no copy for the checks to catch "
                    "(jax 0.10 copies; the floor CI environment runs this test)")
    assert temps >= (st.cache.k.nbytes + st.cache.v.nbytes) / 2 and copies, (temps, copies)


def test_a_round_under_a_skip_rule_keeps_caches_in_place(target):
    """With a skip rule the round is a `lax.cond` between the drafting round and the target-only
    round, both writing the caches: neither cache is copied."""
    from dspark_jax.scheduler import prefix

    d = tiny_drafter("dspark", target, gamma=3)
    eng = Engine(target, d, EngineConfig(num_slots=4, max_len=1024, prefill_buckets=(16,), policy="production",
                                         skip_drafting="known"))
    b = eng.priced_buckets
    table = prefix.make_table(b, t_verify=[1.0 + i / 8 for i in range(len(b))], t_draft=0.1, skip_extra=0.05)
    st, ctl = eng.init_state(), eng.control(table=table)
    c = jax.jit(functools.partial(round_step, eng.spec), donate_argnums=(2,)).lower(eng.tp, eng.dp, st, ctl).compile()
    shapes = {tuple(x.shape) for cache in (st.cache, st.dcache) for x in (cache.k, cache.v)}
    assert "conditional" in c.as_text()
    assert c.memory_analysis().temp_size_in_bytes < (st.cache.k.nbytes + st.cache.v.nbytes) / 2
    assert not _whole_cache_copies(c.as_text(), shapes)
