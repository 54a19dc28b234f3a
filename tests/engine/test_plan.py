"""`python -m dspark_jax plan engine`: exact per-chip cache sizes from the shapes and the rules
table, and a compiled round whose memory XLA reports, on fake devices in a subprocess."""

import json

from tests.conftest import run_multidevice

CODE = r"""
import json, jax
from dspark_jax.config import from_cli
from dspark_jax.engine.plan import plan, format_plan
cfg = from_cli(["micro"])
out = {}
for mesh in ((1, 1, 1), (2, 1, 2)):
    out[str(mesh)] = plan(cfg, 4, 64, mesh, compile_round=True)
out["text"] = format_plan("micro", 4, 64, (2, 1, 2), out[str((2, 1, 2))], 1e-6)
out["paged"] = plan(cfg, 4, 64, (2, 1, 2), compile_round=True, kv_pages=(8, 8))  # 64 tokens: a quarter of 4 x 64
out["paged_text"] = format_plan("micro", 4, 64, (2, 1, 2), out["paged"], None)
m = cfg.target.model
out["cfg"] = [m.num_layers, m.num_kv_heads, m.head_dim]
print(json.dumps(out))
"""


def test_engine_plan_cache_bytes_and_compiled_round():
    res = json.loads(run_multidevice(CODE, n=4).strip().splitlines()[-1])
    layers, kv, hd = res["cfg"]
    one, two = res["(1, 1, 1)"], res["(2, 1, 2)"]
    assert one["target_kv"] == 2 * layers * 4 * 64 * kv * hd * 4  # k and v, float32, whole on one chip
    # slots over data 2, KV heads over tensor 2 (when they divide it)
    assert two["target_kv"] == one["target_kv"] // (2 * (2 if kv % 2 == 0 else 1))
    assert two["target_weights"] < one["target_weights"]
    for r in (one, two):
        assert r["temporaries"] > 0 and r["arguments"] >= r["target_weights"] + r["target_kv"]
        assert r["aliased"] > 0  # the donated state is updated in place
    assert "does NOT fit" in res["text"] and "compiled round peak" in res["text"]
    # paged: a pool of 8 pages of 8 tokens, whole on data (no slot axis), KV heads over tensor
    paged = res["paged"]
    assert paged["target_kv"] == 2 * layers * 8 * 8 * kv * hd * 4 // (2 if kv % 2 == 0 else 1)
    assert paged["target_kv"] * 2 == two["target_kv"]  # a quarter of the tokens, not split over data 2
    assert 0 < paged["drafter_kv"] < two["drafter_kv"]
    assert paged["arguments"] < two["arguments"] and paged["aliased"] > 0
    assert "target KV (paged)" in res["paged_text"] and "8 pages of 8 tokens = 64 tokens" in res["paged_text"]


def test_a_program_the_tpu_compiler_refuses_for_hbm_is_reported_not_raised():
    from dspark_jax.engine import plan as engine_plan

    err = RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
                       "temporaries (21.22G) exceeds available HBM (15.75G).")
    reason = engine_plan._out_of_memory(err)
    assert reason.startswith("Ran out of memory on HBM") and "(21.22G)" in reason
    assert engine_plan._out_of_memory(RuntimeError("INVALID_ARGUMENT: bad block shape")) is None
    res = {"programs": {"round": {"arguments": 1, "outputs": 1, "aliased": 1, "temporaries": 1},
                        "prefill": {"out_of_memory": reason, "compile_s": 1.0}}}
    bad = engine_plan.misfits(res, None)
    assert len(bad) == 1 and bad[0].startswith("the engine's prefill program does not fit: Ran out of memory")
    assert "--prefill-chunk" in bad[0]
