"""The trainer toolkit (optim, checkpoint, metrics) and the LM loss: schedule shape, AdamW, orbax
round trip, JSONL logger, progress bar."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dspark_jax.console import progress_bar
from dspark_jax.target.lm_loss import lm_loss
from dspark_jax.toolkit.checkpoint import Checkpointer
from dspark_jax.toolkit.metrics import MetricsLogger, read_jsonl
from dspark_jax.toolkit.optim import adamw, warmup_cosine_schedule


def test_schedule_is_linear_warmup_then_cosine_to_zero():
    total, peak = 100, 2e-3
    sched = warmup_cosine_schedule(peak, total, 4)  # 4 % warm-up = 4 steps
    got = np.array([float(sched(s)) for s in range(total + 1)])
    want = [peak * s / 4 if s < 4 else peak * 0.5 * (1 + math.cos(math.pi * (s - 4) / (total - 4)))
            for s in range(total + 1)]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9)
    assert got[0] == 0.0 and got[4] == pytest.approx(peak) and got[-1] == pytest.approx(0.0, abs=1e-12)
    assert np.all(np.diff(got[4:]) <= 0) and np.all(np.diff(got[:5]) > 0)


def test_schedule_rejects_bad_steps():
    with pytest.raises(ValueError, match="total_steps"):
        warmup_cosine_schedule(1e-3, 0, 0)
    with pytest.raises(ValueError, match="warmup_steps"):
        warmup_cosine_schedule(1e-3, 10, warmup_steps=11)


def test_adamw_clips_and_minimises():
    tx = adamw(0.1, clip_norm=1.0)
    x = {"w": jnp.array([3.0, -2.0])}
    st = tx.init(x)
    for _ in range(200):
        g = {"w": 2 * x["w"]}
        upd, st = tx.update(g, st, x)
        x = optax.apply_updates(x, upd)
    assert float(jnp.abs(x["w"]).max()) < 0.05


def test_lm_loss_weights():
    logits = jnp.log(jnp.array([[[0.5, 0.5], [0.9, 0.1]]]))
    loss = lm_loss(logits, jnp.array([[0, 1]]), jnp.array([[1, 0]]))
    assert float(loss) == pytest.approx(math.log(2), rel=1e-6)


def test_checkpointer_round_trip(tmp_path):
    ck = Checkpointer(tmp_path / "ck", keep=1)
    tree = {"params": {"a": np.arange(6, dtype=np.float32).reshape(2, 3)}, "opt": (jnp.array(7, jnp.int32),)}
    ck.save(3, tree, meta={"fingerprint": "abc"})
    ck.save(5, {"params": {"a": tree["params"]["a"] + 1}, "opt": (jnp.array(8, jnp.int32),)},
            meta={"fingerprint": "abc"})
    assert ck.latest_step() == 5
    step = ck.latest_step()
    got, meta = ck.restore(step, tree)
    assert step == 5 and meta == {"fingerprint": "abc"}
    np.testing.assert_array_equal(np.asarray(got["params"]["a"]), tree["params"]["a"] + 1)
    ck.close()


def test_jsonl_logger_and_silent_progress(tmp_path):
    p = tmp_path / "log.jsonl"
    with MetricsLogger(p) as lg:
        lg.log({"step": 1, "loss": np.float32(2.5)})
        lg.log({"step": 2, "v": jnp.array([1, 2])})
    rows = read_jsonl(p)
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["loss"] == 2.5 and rows[1]["v"] == [1, 2]
    bar = progress_bar(range(3), enabled=False)
    assert list(bar) == [0, 1, 2]
    bar.update(1)
    bar.set_postfix(loss=1)
    bar.close()
