"""Chat conversations through the engine: rendered with the target's template, decoded, the
completions as text (what `python -m dspark_jax generate` prints), and the engine's round traces
saved for calibration."""

from __future__ import annotations

import logging
from pathlib import Path

from dspark_jax.calibration.traces import from_engine, save_traces
from dspark_jax.engine.config import EngineConfig
from dspark_jax.engine.engine import Engine
from dspark_jax.text.chat import render_prompt

__all__ = ["generate_texts", "save_run_traces"]

log = logging.getLogger(__name__)


def generate_texts(target, drafter, convs, *, max_new_tokens=128, batch=8, max_len=None, gamma=None,
                   policy="auto", threshold=0.0, sampling=None, seed=0, loop="host", traces=False, table=None,
                   sts=None, theta="latency", cost=None, skip_drafting="auto", probe_every=8, probe_max=64, mesh=None,
                   kv_pages=None, prefill_chunk=None):
    """Render, encode, generate; returns (GenerateResult, prompt ids, completion texts).

    `table`: a scheduler.CostTable; its buckets become the engine's verification buckets."""
    tok = target.require_tokenizer()
    ids = [render_prompt(tok, c, target.chat_template) for c in convs]
    G = gamma or getattr(drafter, "gamma", 0)
    S = max_len or (max(len(p) for p in ids) + max_new_tokens + G + 2)
    config = EngineConfig(num_slots=min(batch, len(ids)), max_len=S, gamma=gamma, policy=policy, theta=theta,
                          cost=cost, skip_drafting=skip_drafting, probe_every=probe_every, probe_max=probe_max,
                          kv_pages=kv_pages, prefill_chunk=prefill_chunk)
    eng = Engine(target, drafter, config, table=table, mesh=mesh)
    log.debug("policy %s; cost table %s", eng.scheduling, eng.table_source)  # the summary prints them
    res = eng.generate(ids, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, threshold=threshold,
                       stop_ids=tok.stop_ids, traces=traces, loop=loop, sts=sts)
    res.extra.update(policy=eng.scheduling, cost_table=eng.table_source)
    texts = [tok.decode([t for t in r.tokens if t not in tok.stop_ids]) for r in res.results]
    return res, ids, texts


def save_run_traces(path: Path, traces, mode: str, sampling) -> Path:
    """`.npz`: a trace file that records the drafter kind and the sampling setting its rounds were
    drafted under (calibration fits and stores STS per setting); `.jsonl`: one record per round."""
    if path.suffix != ".npz":
        return traces.save(path)
    return save_traces(path, from_engine(traces, drafter_kind=mode, sampling=sampling))
