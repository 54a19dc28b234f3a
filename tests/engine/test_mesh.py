"""The engine on a mesh: 8 fake CPU devices (slots over data 4, KV heads over tensor 2) give the
same greedy tokens as one device, for every drafter kind, dense KV with whole prefills, and paged KV
with the two later requests' prompts forwarded in chunks of 4 inside the rounds, with the decode
state laid out as `decode_shardings` says and kept that way across rounds."""

import json

from tests.conftest import fake_devices_env, run_multidevice

CODE = r"""
import dataclasses, json, numpy as np, jax
from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.testing.tiny import tiny_config, tiny_drafter, tiny_target
from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.parallel.sharding import make_mesh

cfg = dataclasses.replace(tiny_config(vocab_size=64, hidden_size=32, num_layers=3),
                          num_heads=4, num_kv_heads=2, head_dim=8)
target = tiny_target(cfg, logit_scale=1.0)
rng = np.random.default_rng(0)
prompts = [rng.integers(0, 60, n).tolist() for n in (5, 9, 3, 7, 6, 4)]
res = {}
for kind in ("dspark", "eagle3", "mtp1", None):  # dflash shares dspark's code path
    d = None if kind is None else tiny_drafter(kind, target, gamma=3)
    out = {}
    for name, mesh, pages, chunk in (("one", None, None, None), ("mesh", make_mesh(4, 1, 2), None, None),
                                     ("chunked", make_mesh(4, 1, 2), (40, 4), 4)):
        eng = Engine(target, d, EngineConfig(policy="fixed",
                                             num_slots=4, max_len=48, kv_pages=pages, prefill_chunk=chunk), mesh=mesh)
        g = eng.generate(prompts, max_new_tokens=12, sampling=SamplingParams(0.0, 0, 1.0), seed=1)
        out[name] = [r.tokens for r in g.results]
        if pages is not None:
            st = eng.init_state()
            out["pool_spec"] = [str(st.cache.k.sharding.spec), str(st.cache.page_table.sharding.spec)]
            continue
        if mesh is not None:
            st = eng.init_state()
            ctl = eng.control(SamplingParams(0.0, 0, 1.0))
            st, _ = eng.step(st, ctl)
            st, _ = eng.step(st, ctl)
            out["spec"] = [str(st.cache.k.sharding.spec), str(st.pos.sharding.spec), str(st.dcache.k.sharding.spec)]
            out["shards"] = list(st.cache.k.addressable_shards[0].data.shape)
            out["full"] = list(st.cache.k.shape)
    res[str(kind)] = {"equal": out["one"] == out["mesh"],
                      "chunked": out["one"] == out["chunked"],
                      "pool_spec": out["pool_spec"], "n": sum(map(len, out["one"])), "spec": out["spec"],
                      "shards": out["shards"], "full": out["full"]}
print(json.dumps(res))
"""


def test_engine_on_a_mesh_matches_one_device():
    res = json.loads(run_multidevice(CODE).strip().splitlines()[-1])
    for kind, r in res.items():
        assert r["equal"] and r["chunked"] and r["n"] == 6 * 12, (kind, r)
        assert r["pool_spec"] == ["P(None, None, 'tensor', None, None)", "P('data', None)"], (kind, r["pool_spec"])
        assert r["spec"][:2] == ["P(None, 'data', 'tensor', None, None)", "P('data',)"], (kind, r["spec"])
        layers, slots, kv, length, d = r["full"]  # heads-major
        assert r["shards"] == [layers, slots // 4, kv // 2, length, d], (kind, r)


def test_generate_command_on_a_mesh(embedded_tiny_dir, tmp_path):
    """`python -m dspark_jax generate --mesh 2,1,1` on 2 fake devices prints the same greedy text as
    one device; a malformed --mesh is one line naming the format."""
    import subprocess
    import sys

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["def add(a, b):"]}) + "\n"
                       + json.dumps({"turns": ["What is 3 + 4?"]}) + "\n")
    env = fake_devices_env(2)
    base = [sys.executable, "-m", "dspark_jax", "generate", "--target", str(embedded_tiny_dir),
            "--prompts", str(prompts),
            "--temperature", "0", "--max-new-tokens", "12", "--batch", "2"]
    one = subprocess.run(base, capture_output=True, text=True, env=env, timeout=600)
    two = subprocess.run(base + ["--mesh", "2,1,1"], capture_output=True, text=True, env=env, timeout=600)
    assert one.returncode == 0 and two.returncode == 0, (one.stderr[-2000:], two.stderr[-2000:])
    text = lambda out: out.split("tokens_per_s")[0]  # the texts and counts; timings differ
    assert text(one.stdout) == text(two.stdout) and "=== request" in one.stdout
    bad = subprocess.run(base + ["--mesh", "2x1"], capture_output=True, text=True, env=env, timeout=600)
    assert bad.returncode != 0 and "--mesh '2x1': give three integers DATA,FSDP,TENSOR" in bad.stderr
    assert "Traceback" not in bad.stderr
