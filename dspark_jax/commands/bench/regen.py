"""Regeneration throughput: tokens/s at batch 1 and 16, and the compiled decode loop vs a host loop.

Every row generates exactly ``--max-new-tokens`` tokens (stop tokens disabled) at the
reference sampling settings, so rows and runs do the same work. Times exclude
compilation (one warm-up call per shape), include prefill, block on the result, and
are the best of ``--repeats`` calls.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np


def _prompts(tok, template, n: int, prompt_len: int):
    from dspark_jax.data.regenerate import default_prompts, prompt_messages
    from dspark_jax.text.chat import render_prompt

    convs = default_prompts()
    toks = np.full((n, prompt_len), tok.pad_id, np.int32)
    lens = np.zeros((n,), np.int32)
    for r in range(n):
        ids = render_prompt(tok, prompt_messages(convs[r]), template)[-prompt_len:]
        toks[r, :len(ids)] = ids
        lens[r] = len(ids)
    return toks, lens


def _timed(fn, repeats: int):
    """Best of ``repeats`` timed calls after one warm-up (compile) call: robust on a shared CPU."""
    out = jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best, out


def main(argv=None) -> int:
    from dspark_jax.data.regen_defaults import DEFAULT_SAMPLING
    from dspark_jax.io.hf import load_target
    from dspark_jax.target.generation import generate, generate_host_loop

    ap = argparse.ArgumentParser(prog="python -m dspark_jax bench regen", description=__doc__)
    ap.add_argument("--target", default=None, help="HF checkpoint directory (default: the embedded target)")
    ap.add_argument("--preset", default="full", help="embedded preset when --target is not given")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--loop-batch", type=int, default=16, help="batch of the compiled-vs-host loop comparison")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per figure (the best is reported)")
    ap.add_argument("--json", action="store_true", help="also print one JSON line with all figures")
    a = ap.parse_args(argv)

    if a.target is None:
        from dspark_jax.embedded.target import embedded_target_dir

        a.target = embedded_target_dir(preset=a.preset)
    lt = load_target(a.target)
    tok = lt.require_tokenizer()
    batches = [int(b) for b in a.batches.split(",")]
    toks, lens = _prompts(tok, lt.chat_template, max(batches + [a.loop_batch]), a.prompt_len)
    n = a.max_new_tokens
    kw = dict(max_new_tokens=n, sampling=DEFAULT_SAMPLING, seed=0, stop_ids=(), pad_id=tok.pad_id)
    res = {"target": str(lt.path), "device": str(jax.devices()[0]), "prompt_len": a.prompt_len, "max_new_tokens": n}
    print(f"target {lt.path} ({lt.cfg.num_layers} layers x {lt.cfg.hidden_size}, vocab {lt.cfg.vocab_size}) on "
          f"{jax.devices()[0].platform}; prompt length {a.prompt_len} (padded), {n} new tokens per row")
    for b in batches:
        dt, out = _timed(lambda: generate(lt.model, toks[:b], lens[:b], **kw), a.repeats)
        assert int(np.asarray(out.lengths).sum()) == b * n
        res[f"batch{b}_tokens_per_s"] = b * n / dt
        print(f"regeneration batch {b:>3}: {b * n / dt:9.1f} tokens/s  ({dt * 1e3:.0f} ms for {b}x{n} tokens)")
    b = a.loop_batch
    t_loop, o1 = _timed(lambda: generate(lt.model, toks[:b], lens[:b], **kw), a.repeats)
    t_host, o2 = _timed(lambda: generate_host_loop(lt.model, toks[:b], lens[:b], **kw), a.repeats)
    same = bool(np.array_equal(np.asarray(o1.tokens), np.asarray(o2.tokens)))
    res.update(loop_s=t_loop, host_s=t_host, host_over_loop=t_host / t_loop, same_tokens=same)
    print(f"decode loop, batch {b}: compiled while_loop {t_loop * 1e3:.0f} ms, host loop of jitted steps "
          f"{t_host * 1e3:.0f} ms -> host/compiled = {t_host / t_loop:.2f}x (identical tokens: {same})")
    if a.json:
        print(json.dumps(res))
    return 0
