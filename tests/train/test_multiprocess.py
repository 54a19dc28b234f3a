"""`python -m dspark_jax.train` as 2 processes x 4 fake CPU devices (`jax.distributed` on 127.0.0.1).

What a multi-host TPU run does, on CPU: fsdp over both processes (no process holds a whole
parameter), per-process data, gloo collectives, orbax checkpoints written by both. The run must
finish, export and measure held-out tau on every process; equal the 1-process 8-device run; resume
after one process is killed to the same parameters; evaluate held-out sets whose records do not
split evenly over the hosts (a hang before); and on a preemption signal to one host, stop both at
the same step with a checkpoint and no export.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import fake_devices_env
from tests.multiprocess import launch
from tests.train.test_run import _write

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT = 420


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("mpdata")
    # 23 held-out records: 12 / 11 per host, 3 / 2 full batches of 4 each under drop_remainder
    return _write(d / "train", 64, 0), _write(d / "held", 23, 1)


def _args(data, out, *extra):
    train, held = data
    return ["-m", "dspark_jax.train", "configs/micro.yaml", f"train.output_dir={out}", f"data.path={train}",
            f"data.heldout_path={held}", "data.seq_len=48", "data.num_anchors=8", "train.batch_size=8",
            "train.steps=6", "train.anchor_chunk=4", "mesh.data=1", "mesh.fsdp=8", "train.eval_every=0",
            "train.checkpoint_every=3", "train.log_every=1", "train.eval_batches=100", "train.measure_prompts=2",
            "train.measure_max_new_tokens=8", *extra]


def _check(results):
    for r in results:
        assert r.returncode == 0, f"process {r.process_id} exited {r.returncode}:\n{r.output[-4000:]}"


def _params(out):
    from dspark_jax.io import safetensors_io

    return {k: np.array(v) for k, v in safetensors_io.load_file(out / "drafter" / "drafter.safetensors").items()}


def _losses(out):
    rows = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def two_process_run(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("mp2")
    results = launch(_args(data, out), timeout=TIMEOUT, cwd=REPO)
    _check(results)
    return out, results


def test_two_processes_finish_export_and_measure_on_every_process(data, two_process_run):
    out, results = two_process_run
    summary = json.loads((out / "summary.json").read_text())
    assert summary["step"] == 6 and not summary["preempted"]
    assert (out / "drafter" / "drafter.safetensors").is_file()
    assert "measured_tau" in summary and 1.0 <= summary["measured_tau"] <= 5.0
    assert f"held-out measured accepted length: {summary['measured_tau']:.3f}" in results[1].output
    # all 23 held-out records evaluated (blocks of the uneven split = those of a 1-host pass)
    assert summary["eval"]["eval/blocks"] == _heldout_blocks(data[1])


def _heldout_blocks(held_dir):
    """Fully valid blocks of every held-out record, counted in one pass on one host."""
    from dspark_jax.data.dataset import TokenDataset
    from dspark_jax.data.pipeline import RecordSpec, heldout_batches

    spec = RecordSpec(48, 8, 4, pad_id=0, seed=1)  # micro: gamma 4; the trainer evaluates with seed + 1
    return sum(int(b["block_valid"].all(axis=-1).sum())
               for b in heldout_batches(TokenDataset(held_dir), spec, 8, process_index=0, process_count=1))


def test_two_processes_equal_one_process_with_eight_devices(data, two_process_run, tmp_path):
    out2, _ = two_process_run
    out1 = tmp_path / "one"
    env = fake_devices_env(8)
    env.pop("JAX_COORDINATOR_ADDRESS", None)
    # no end-of-run decoding (compared: losses, parameters, eval blocks), which saves an engine compile
    res = subprocess.run([sys.executable, *_args(data, out1, "train.measure_prompts=0")],
                         cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=TIMEOUT)
    assert res.returncode == 0, res.stderr[-4000:]
    l1, l2 = _losses(out1), _losses(out2)
    assert sorted(l1) == sorted(l2) == list(range(1, 7))
    np.testing.assert_allclose([l2[s] for s in sorted(l2)], [l1[s] for s in sorted(l1)], rtol=1e-5)
    p1, p2 = _params(out1), _params(out2)
    assert p1.keys() == p2.keys()
    for k in p1:
        np.testing.assert_allclose(p2[k], p1[k], rtol=1e-4, atol=1e-6, err_msg=k)
    s1 = json.loads((out1 / "summary.json").read_text())
    s2 = json.loads((out2 / "summary.json").read_text())
    assert s1["eval"]["eval/blocks"] == s2["eval"]["eval/blocks"]
    # the reference layout (vLLM / SGLang) gathered across the two processes holds the same tensors
    from dspark_jax.io.safetensors_io import load_file

    r1, r2 = (load_file(o / "drafter_reference" / "model.safetensors") for o in (out1, out2))
    assert r1.keys() == r2.keys() and "lm_head.weight" in r1
    for k in r1:
        np.testing.assert_allclose(np.asarray(r2[k], np.float32), np.asarray(r1[k], np.float32), rtol=2e-2, atol=1e-3,
                                   err_msg=k)


def test_killed_process_then_relaunch_resumes_to_the_same_parameters(data, two_process_run, tmp_path):
    out_full, _ = two_process_run
    out = tmp_path / "killed"
    ckpt = out / "checkpoints" / "3"
    first = launch(_args(data, out), timeout=TIMEOUT, cwd=REPO, signal_process=1, signal_when=ckpt.is_dir)
    assert ckpt.is_dir(), "the run never reached its step-3 checkpoint:\n" + first[0].output[-3000:]
    assert first[1].returncode is None  # killed
    assert not (out / "drafter").exists()
    second = launch(_args(data, out, "train.measure_prompts=0"), timeout=TIMEOUT, cwd=REPO)
    _check(second)
    assert "resumed from step 3" in second[0].output or "resumed from step 6" in second[0].output
    want, got = _params(out_full), _params(out)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7, err_msg=k)


def test_preemption_of_one_host_stops_both_with_a_checkpoint_and_no_export(data, tmp_path):
    out = tmp_path / "preempted"
    log = out / "log.jsonl"
    sent = []

    def signal_host1():
        # once a step is logged, send what a TPU maintenance event sends, to process 1 only
        if not sent and log.is_file() and log.read_text().strip():
            sent.append(time.monotonic())
            return True
        return False

    results = launch(_args(data, out, "train.steps=400", "train.checkpoint_every=0"), timeout=TIMEOUT, cwd=REPO,
                     signal_process=1, signal_when=signal_host1, signal_number=signal.SIGTERM)
    _check(results)
    assert sent
    summary = json.loads((out / "summary.json").read_text())
    assert summary["preempted"] and summary["step"] < 400 and summary["drafter"] is None
    assert (out / "checkpoints" / str(summary["step"])).is_dir()
    assert not (out / "drafter").exists()
