"""One side of `python -m dspark_jax bench vs-torch`: builds its models, compiles, then times regions on request.

Run as a script (`python vs_torch_worker.py jax|torch|probe`), never imported: the parent starts one
worker per side with PYTHONPATH pointing at the tree to measure, so the same file times the
current checkout and an older commit (it uses only APIs both have). Protocol, one JSON object
per line: the worker prints {"ready": ..., "regions": [...]} once compiled, then answers each
{"region": name, "reps": n} with {"times": [seconds, ...]}; an empty line ends it.
"""

from __future__ import annotations

import json
import os
import sys
import time

if sys.path and sys.path[0] == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # this file's folder holds modules (train.py, engine.py) that must not shadow others

# Drafting and verification: one slot with CONTEXT tokens, the last NEW of them not yet seen by the drafter.
CONTEXT, NEW = 256, 4


def bench_config():
    """The `bench_cpu` preset (of the tree being measured): every shape below comes from it."""
    import tempfile

    from dspark_jax.config import from_cli

    return from_cli(["bench_cpu",
                     f"train.output_dir={tempfile.mkdtemp(prefix='vs_torch_')}", "train.checkpoint_every=0"])


def _tokens(vocab, n, seed=0):
    import numpy as np

    return np.random.default_rng(seed).integers(0, vocab - 1, (1, n)).astype(np.int32)


def jax_regions() -> dict:
    """Region name -> zero-argument callable that blocks until its result is ready."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from dspark_jax.data.pipeline import make_example
    from dspark_jax.decoding import rejection
    from dspark_jax.decoding.sampling import SamplingParams, probs_from_params
    from dspark_jax.drafter import heads, registry
    from dspark_jax.drafter.frozen import attach_target
    from dspark_jax.engine import Engine, EngineConfig
    from dspark_jax.engine.verify import verify_packed
    from dspark_jax.parallel.sharding import create_model
    from dspark_jax.train.run import prepare_target
    from dspark_jax.train.trainer import Trainer

    bc = bench_config()
    target = prepare_target(bc).model  # random weights of the preset's shape
    cfg, seq_len, layer_ids = target.cfg, bc.data.seq_len, tuple(bc.drafter.target_layer_ids)
    gamma, vocab = bc.drafter.gamma, target.cfg.vocab_size
    tgraph, tstate = nnx.split(target)
    regions = {}

    @jax.jit
    def forward(state, tokens):
        out = nnx.merge(tgraph, state)(tokens, feature_layers=layer_ids)
        return out.logits, out.features

    @jax.jit
    def features_only(state, tokens):
        out = nnx.merge(tgraph, state)(tokens, feature_layers=layer_ids, return_logits=False)
        return out.hidden, out.features

    seq = jnp.asarray(_tokens(vocab, seq_len))
    regions["target forward"] = lambda: jax.block_until_ready(forward(tstate, seq))
    regions["train: target features"] = lambda: jax.block_until_ready(features_only(tstate, seq))

    # --- train step: the real Trainer on synthetic records (everything after 8 tokens is a response)
    rng = np.random.default_rng(0)
    recs = [{"tokens": rng.integers(0, vocab - 1, seq_len).astype(np.int32),
             "loss_mask": np.r_[np.zeros(8, bool), np.ones(seq_len - 8, bool)]} for _ in range(2)]
    tr = Trainer(bc, target, recs, None, progress=False)
    ex = [make_example(r, j, tr.spec) for j, r in enumerate(recs[: bc.train.batch_size])]
    dev = tr._device_batch({k: np.stack([e[k] for e in ex]) for k in ex[0]})
    train_state = [tr.state]

    def step():
        train_state[0], m, _ = tr.train_step(train_state[0], tr.frozen, tr.t_state, dev)
        jax.block_until_ready(m["loss"])

    regions["train step (online)"] = step

    # --- draft round and verification: a random drafter of the preset, one slot, context CONTEXT - NEW + NEW
    drafter = create_model(lambda: registry.build(cfg, bc.drafter, rngs=nnx.Rngs(1)))
    attach_target(drafter, target)
    # the regions above run the target's stacked state taken before this engine: it keeps the stacks
    eng = Engine(target, drafter, EngineConfig(num_slots=1, max_len=2 * CONTEXT, buckets=(gamma + 1,), policy="fixed",
                                               keep_target_stacks=True))
    sp = SamplingParams(1.0, 0, 1.0)
    ctl = eng.control(sp)
    st = eng.init_state()
    kd = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(0), 1)))
    st = eng.prefill_slots(st, [0], [list(_tokens(vocab, CONTEXT - NEW, 1)[0])], kd, [CONTEXT])
    st, _ = eng.step(st, ctl)  # a live state: the drafter context holds the prompt and one round
    regions["draft round"] = lambda: jax.block_until_ready(eng.draft(st, ctl))

    h = jax.random.normal(jax.random.key(2), (1, gamma, cfg.hidden_size), jnp.float32)
    anchor = jnp.zeros((1,), jnp.int32)
    dp = eng.dp
    sample_block = jax.jit(lambda dp, h, key: heads.sample_block(key, dp, h, anchor, sp))
    regions["draft: sample_block"] = lambda: jax.block_until_ready(sample_block(dp, h, jax.random.key(3)))

    toks = jnp.asarray(_tokens(vocab, gamma + 1, 4))
    valid = jnp.ones(toks.shape, bool)
    start = jnp.full((1,), CONTEXT - NEW, jnp.int32)
    q = jax.nn.softmax(jax.random.normal(jax.random.key(5), (1, gamma, vocab)), -1)

    @jax.jit
    def verify(tp, cache, key):
        out = verify_packed(tp, cfg, cache, toks, start, valid, bucket=gamma + 1, feature_layers=layer_ids)
        p = probs_from_params(out.logits, sp)
        return rejection.verify(key, toks[:, 1:], q, p, jnp.full((1,), gamma, jnp.int32)), out.cache.k

    cache = st.cache
    regions["verify 8 + rejection"] = lambda: jax.block_until_ready(verify(eng.tp, cache, jax.random.key(6)))
    return regions


def torch_regions() -> dict:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    bc = bench_config()
    m, seq_len = bc.target.model, bc.data.seq_len
    torch.manual_seed(0)
    torch.set_num_threads(int(os.environ.get("VS_TORCH_THREADS", os.cpu_count() or 1)))
    hf = Qwen3Config(vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
                     num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
                     num_key_value_heads=m.num_kv_heads,
                     head_dim=m.head_dim, rms_norm_eps=m.rms_norm_eps, rope_theta=m.rope.theta,
                     tie_word_embeddings=m.tie_word_embeddings, max_position_embeddings=m.max_position_embeddings)
    model = Qwen3ForCausalLM(hf).eval()
    seq = torch.from_numpy(_tokens(m.vocab_size, seq_len)).long()

    def forward():
        with torch.inference_mode():
            out = model(seq, output_hidden_states=True, use_cache=False)
        return out.logits.sum().item()

    return {"target forward": forward}


def main() -> int:
    side = sys.argv[1]  # jax | torch | probe (no regions: reports where dspark_jax was imported from)
    regions = {"jax": jax_regions, "torch": torch_regions, "probe": dict}[side]()
    for fn in regions.values():  # compile / warm up
        fn()
        fn()
    origin = "torch"
    if side != "torch":
        import dspark_jax

        origin = os.path.dirname(os.path.dirname(os.path.abspath(dspark_jax.__file__)))
    print(json.dumps({"ready": True, "regions": list(regions), "origin": origin}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        req = json.loads(line)
        fn, times = regions[req["region"]], []
        for _ in range(int(req["reps"])):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        print(json.dumps({"times": times}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
