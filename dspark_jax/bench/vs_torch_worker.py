"""One side of `python -m dspark_jax.bench vs-torch`: builds its models, compiles, then times regions on request.

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

# The bench_cpu shape (configs/bench_cpu.yaml); keep in sync with it.
VOCAB, HIDDEN, MLP, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 8192, 256, 768, 8, 8, 4, 32
SEQ, FEATURE_LAYERS, GAMMA, CONTEXT, NEW = 512, (1, 3, 5), 7, 256, 4


def _tokens(n, seed=0):
    import numpy as np

    return np.random.default_rng(seed).integers(0, VOCAB - 1, (1, n)).astype(np.int32)


def jax_regions() -> dict:
    """Region name -> zero-argument callable that blocks until its result is ready."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from dspark_jax.config import DrafterSection
    from dspark_jax.decoding import rejection
    from dspark_jax.decoding.sampling import SamplingParams, probs_from_params
    from dspark_jax.drafter import heads
    from dspark_jax.drafter.frozen import attach_target
    from dspark_jax.drafter.model import Drafter
    from dspark_jax.engine import Engine
    from dspark_jax.engine.verify import verify_packed
    from dspark_jax.parallel.sharding import create_model
    from dspark_jax.target import TargetModel
    from dspark_jax.target.config import ModelConfig

    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP, num_layers=LAYERS, num_heads=HEADS,
                      num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, tie_word_embeddings=True, arch="qwen3",
                      max_position_embeddings=4096)
    target = create_model(lambda: TargetModel(cfg, rngs=nnx.Rngs(0)))
    tgraph, tstate = nnx.split(target)
    regions = {}

    @jax.jit
    def forward(state, tokens):
        out = nnx.merge(tgraph, state)(tokens, feature_layers=FEATURE_LAYERS)
        return out.logits, out.features

    @jax.jit
    def features_only(state, tokens):
        out = nnx.merge(tgraph, state)(tokens, feature_layers=FEATURE_LAYERS, return_logits=False)
        return out.hidden, out.features

    seq = jnp.asarray(_tokens(SEQ))
    regions["target forward"] = lambda: jax.block_until_ready(forward(tstate, seq))
    regions["train: target features"] = lambda: jax.block_until_ready(features_only(tstate, seq))

    # --- train step: the bench_cpu preset through the real Trainer, synthetic records
    import tempfile

    from dspark_jax.config import from_cli
    from dspark_jax.data.pipeline import make_example
    from dspark_jax.train.run import prepare_target
    from dspark_jax.train.trainer import Trainer

    tcfg = from_cli(["bench_cpu", f"train.output_dir={tempfile.mkdtemp(prefix='vs_torch_')}", "train.checkpoint_every=0"])
    loaded = prepare_target(tcfg)
    rng = np.random.default_rng(0)
    recs = [{"tokens": rng.integers(0, VOCAB - 1, SEQ).astype(np.int32),
             "loss_mask": np.r_[np.zeros(8, bool), np.ones(SEQ - 8, bool)]} for _ in range(2)]
    tr = Trainer(tcfg, loaded.model, recs, None, progress=False)
    ex = [make_example(r, j, tr.spec) for j, r in enumerate(recs[:1])]
    dev = tr._device_batch({k: np.stack([e[k] for e in ex]) for k in ex[0]})
    train_state = [tr.state]

    def step():
        train_state[0], m, _ = tr.train_step(train_state[0], tr.frozen, tr.t_state, dev)
        jax.block_until_ready(m["loss"])

    regions["train step (online)"] = step

    # --- draft round and verification: a random DSpark drafter, one slot, context 252 + 4 new
    dcfg = DrafterSection(kind="dspark", num_layers=2, gamma=GAMMA, target_layer_ids=FEATURE_LAYERS, markov_rank=64,
                          mask_token_id=VOCAB - 1)
    drafter = create_model(lambda: Drafter(cfg, dcfg, rngs=nnx.Rngs(1)))
    attach_target(drafter, target)
    eng = Engine(target, drafter, num_slots=1, max_len=2 * CONTEXT, buckets=(GAMMA + 1,))
    sp = SamplingParams(1.0, 0, 1.0)
    ctl = eng.control(sp)
    st = eng.init_state()
    kd = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(0), 1)))
    st = eng.prefill_slots(st, [0], [list(_tokens(CONTEXT - NEW, 1)[0])], kd, [CONTEXT])
    st, _ = eng.step(st, ctl)  # a live state: the drafter context holds the prompt and one round
    regions["draft round"] = lambda: jax.block_until_ready(eng.draft(st, ctl))

    h = jax.random.normal(jax.random.key(2), (1, GAMMA, HIDDEN), jnp.float32)
    anchor = jnp.zeros((1,), jnp.int32)
    dp = eng.dp
    sample_block = jax.jit(lambda dp, h, key: heads.sample_block(key, dp, h, anchor, sp))
    regions["draft: sample_block"] = lambda: jax.block_until_ready(sample_block(dp, h, jax.random.key(3)))

    toks = jnp.asarray(_tokens(GAMMA + 1, 4))
    valid = jnp.ones(toks.shape, bool)
    start = jnp.full((1,), CONTEXT - NEW, jnp.int32)
    q = jax.nn.softmax(jax.random.normal(jax.random.key(5), (1, GAMMA, VOCAB)), -1)

    @jax.jit
    def verify(tp, cache, key):
        out = verify_packed(tp, cfg, cache, toks, start, valid, bucket=GAMMA + 1, feature_layers=FEATURE_LAYERS)
        p = probs_from_params(out.logits, sp)
        return rejection.verify(key, toks[:, 1:], q, p, jnp.full((1,), GAMMA, jnp.int32)), out.cache.k

    cache = st.cache
    regions["verify 8 + rejection"] = lambda: jax.block_until_ready(verify(eng.tp, cache, jax.random.key(6)))
    return regions


def torch_regions() -> dict:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    torch.set_num_threads(int(os.environ.get("VS_TORCH_THREADS", os.cpu_count() or 1)))
    hf = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=LAYERS,
                     num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                     tie_word_embeddings=True, max_position_embeddings=4096)
    model = Qwen3ForCausalLM(hf).eval()
    seq = torch.from_numpy(_tokens(SEQ)).long()

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
