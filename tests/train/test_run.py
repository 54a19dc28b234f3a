"""The training loop on a micro target: resume = uninterrupted, preemption, bad input."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from dspark_jax.config import from_cli
from dspark_jax.config.loader import ConfigError
from dspark_jax.data.dataset import DatasetWriter
from dspark_jax.data.pipeline import NoAssistantTokensError
from dspark_jax.drafter.model import DrafterConfigError
from dspark_jax.train.run import run
from dspark_jax.train.trainer import TrainingError


def _write(path, n, seed, vocab=500, empty_mask=False):
    rng = np.random.default_rng(seed)
    w = DatasetWriter(path, vocab_size=512)
    for _ in range(n):
        length = int(rng.integers(24, 48))
        t = rng.integers(0, vocab, length)
        m = np.zeros(length, bool)
        if not empty_mask:
            m[6:] = True
        w.add(t, m)
    w.close()
    return path


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    return _write(d / "train", 48, 0), _write(d / "held", 8, 1)


def _cfg(datasets, out, *extra):
    train, held = datasets
    return from_cli(["micro", f"data.path={train}", f"data.heldout_path={held}", f"train.output_dir={out}",
                     "data.seq_len=48", "data.num_anchors=8", "train.batch_size=4", "train.steps=6",
                     "train.checkpoint_every=3", "train.eval_every=0", "train.log_every=1", "train.anchor_chunk=4",
                     "train.eval_batches=1", *extra])


def _losses(out):
    rows = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _params(out):
    from dspark_jax.io import safetensors_io

    return {k: np.array(v) for k, v in safetensors_io.load_file(out / "drafter" / "drafter.safetensors").items()}


@pytest.fixture(scope="module")
def uninterrupted(datasets, tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    summary = run(_cfg(datasets, out), progress=False)
    return out, summary


def test_uninterrupted_run_writes_everything(uninterrupted):
    out, summary = uninterrupted
    assert summary["step"] == 6 and not summary["preempted"]
    assert (out / "checkpoints" / "6").is_dir() and (out / "drafter" / "drafter_config.json").is_file()
    assert (out / "summary.json").is_file() and list((out / "tensorboard").iterdir())
    ref = json.loads((out / "drafter_reference" / "config.json").read_text())  # what vLLM / SGLang load
    assert ref["num_anchors"] == 8 and ref["sample_from_anchor"] is True and ref["torch_dtype"] == "bfloat16"
    assert (out / "drafter_reference" / "model.safetensors").is_file()
    ev = summary["eval"]
    assert 1.0 <= ev["eval/expected_accepted_length"] <= 5.0 and len(ev["eval/acceptance_per_position"]) == 4
    assert set(summary["phases_s"]) >= {"training", "evaluation"}


def test_stopped_and_resumed_equals_uninterrupted(datasets, uninterrupted, tmp_path):
    full_out, _ = uninterrupted
    s1 = run(_cfg(datasets, tmp_path, "train.stop_after_steps=3"), progress=False)
    assert s1["step"] == 3
    s2 = run(_cfg(datasets, tmp_path), progress=False)
    assert s2["step"] == 6
    a, b = _losses(full_out), _losses(tmp_path)
    for step in (4, 5, 6):
        assert a[step] == b[step], (step, a[step], b[step])
    pa, pb = _params(full_out), _params(tmp_path)
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)


def test_preemption_saves_and_resumes_exactly(datasets, uninterrupted, tmp_path, monkeypatch):
    from dspark_jax.train import trainer as trainer_mod

    calls = {"n": 0}
    orig = trainer_mod.Trainer.fit

    def fit_with_sigterm(self):
        step_fn = self.train_step

        def wrapped(*a):
            calls["n"] += 1
            if calls["n"] == 2:
                os.kill(os.getpid(), signal.SIGTERM)  # what a TPU preemption sends
            return step_fn(*a)

        self.train_step = wrapped
        return orig(self)

    monkeypatch.setattr(trainer_mod.Trainer, "fit", fit_with_sigterm)
    s1 = run(_cfg(datasets, tmp_path), progress=False)
    assert s1["preempted"] and s1["step"] == 2
    assert (tmp_path / "checkpoints" / "2").is_dir()
    monkeypatch.setattr(trainer_mod.Trainer, "fit", orig)
    s2 = run(_cfg(datasets, tmp_path), progress=False)
    assert s2["step"] == 6
    pa, pb = _params(uninterrupted[0]), _params(tmp_path)
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)


def test_nan_loss_stops_and_keeps_last_good_checkpoint(datasets, tmp_path, monkeypatch):
    from dspark_jax.train import trainer as trainer_mod

    orig = trainer_mod.Trainer.fit

    def fit_with_nan(self):
        step_fn = self.train_step
        n = {"i": 0}

        def wrapped(*a):
            n["i"] += 1
            state, metrics, sums = step_fn(*a)
            if n["i"] >= 5:
                metrics = dict(metrics, loss=metrics["loss"] * np.nan)
            return state, metrics, sums

        self.train_step = wrapped
        return orig(self)

    monkeypatch.setattr(trainer_mod.Trainer, "fit", fit_with_nan)
    with pytest.raises(TrainingError, match="non-finite loss at step 5.*last good checkpoint \\(step 3\\)"):
        run(_cfg(datasets, tmp_path), progress=False)
    steps = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [3]


def test_resume_with_changed_model_shape(datasets, tmp_path):
    run(_cfg(datasets, tmp_path, "train.stop_after_steps=3"), progress=False)
    with pytest.raises(TrainingError, match="the model shape changed .*num_layers.*existing checkpoints are kept"):
        run(_cfg(datasets, tmp_path, "drafter.num_layers=2"), progress=False)
    assert (tmp_path / "checkpoints" / "3").is_dir()


def test_unwritable_output_dir(datasets, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(TrainingError, match="cannot be written.*set train.output_dir"):
        run(_cfg(datasets, blocker / "out"), progress=False)


_PROBE_LOOP = """
import sys, time
from pathlib import Path
from dspark_jax.train.trainer import check_output_dir
start = float(sys.argv[2])
while time.time() < start:
    time.sleep(0.001)
while time.time() < start + 2:
    check_output_dir(Path(sys.argv[1]))
"""


def test_output_dir_probed_by_every_host_at_once(tmp_path):
    # the hosts of a multi-host run check the shared output dir at the same moment; one host's probe
    # must not be removed by another (with one probe name for all, a host saw its probe vanish)
    start = str(time.time() + 12)  # after every process has imported jax: 2 s of probing, all at once
    procs = [subprocess.Popen([sys.executable, "-c", _PROBE_LOOP, str(tmp_path), start],
                              stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(errors)
    assert list(tmp_path.iterdir()) == []


def test_dataset_without_assistant_tokens(tmp_path, datasets):
    empty = _write(tmp_path / "empty", 8, 0, empty_mask=True)
    with pytest.raises(NoAssistantTokensError, match="no assistant tokens"):
        run(_cfg((empty, datasets[1]), tmp_path / "o"), progress=False)


def test_dataset_vocabulary_larger_than_target(tmp_path, datasets):
    big = tmp_path / "big"
    w = DatasetWriter(big, vocab_size=4096)
    for _ in range(8):
        w.add(np.arange(30) + 600, np.ones(30, bool))
    w.close()
    with pytest.raises(TrainingError, match="vocabulary"):
        run(_cfg((big, datasets[1]), tmp_path / "o"), progress=False)


@pytest.mark.parametrize("override, err, needle", [
    ("drafter.target_layer_ids=[2]", DrafterConfigError, "exceed 0"),
    ("drafter.target_layer_ids=[1,0]", ConfigError, "strictly increasing"),
    ("drafter.gamma=0", ConfigError, "gamma must be >= 1"),
    ("drafter.mask_token_id=512", DrafterConfigError, "outside the target vocabulary"),
    ("drafter.gamm=3", ConfigError, "unknown config key 'drafter.gamm'"),
])
def test_bad_drafter_config(datasets, tmp_path, override, err, needle):
    with pytest.raises(err, match=needle):
        run(_cfg(datasets, tmp_path, override), progress=False)


@pytest.mark.parametrize("kind", ["dflash", "eagle3", "mtp1"])
def test_baseline_kinds_train_and_export(datasets, tmp_path, kind):
    from dspark_jax.io import drafter_dir as drafter_io
    from dspark_jax.train.run import prepare_target

    cfg = _cfg(datasets, tmp_path, f"drafter.kind={kind}", "train.steps=4", "train.eagle3_steps=2")
    s = run(cfg, progress=False)
    losses = _losses(tmp_path)
    assert s["step"] == 4 and all(np.isfinite(v) for v in losses.values())
    ev = s["eval"]
    if kind == "dflash":  # the same acceptance statistics as DSpark
        assert "eval/expected_accepted_length" in ev
    else:
        assert np.isfinite(ev["eval/loss"])
    target = prepare_target(cfg, None)
    d = drafter_io.load(tmp_path / "drafter", target.model)
    assert d.dcfg.kind == kind and type(d).__name__ == {"dflash": "Drafter",
                                                        "eagle3": "Eagle3Drafter", "mtp1": "MTPDrafter"}[kind]


def test_gradient_accumulation_equals_the_whole_batch_update(datasets, tmp_path):
    """With SGD(lr=1) the update is minus the gradient: accumulated over 2 micro-batches it must
    equal the whole batch's gradient (one loss denominator for the batch), which differs from the
    mean of the micro-batches' own mean-loss gradients (what a per-micro-batch mean would give)."""
    import jax
    import optax

    from dspark_jax.data.dataset import TokenDataset
    from dspark_jax.drafter import registry
    from dspark_jax.drafter.losses import LossCoefs
    from dspark_jax.train.run import prepare_target
    from dspark_jax.train.step import TrainState, make_loss_fn, make_train_step, split_micro
    from dspark_jax.train.trainer import Trainer

    cfg = _cfg(datasets, tmp_path, "train.grad_accum=2")
    tr = Trainer(cfg, prepare_target(cfg, None).model, TokenDataset(datasets[0]), None, progress=False)
    tr.data_iter = tr._new_iter()
    batch = tr._device_batch(next(tr.data_iter))
    lf = make_loss_fn(tr.d_graphdef, tr.t_graphdef, registry.get_kind("dspark"), LossCoefs(), 4)
    sgd = optax.sgd(1.0)
    state = TrainState(jax.numpy.zeros((), jax.numpy.int32), tr.state.params, sgd.init(tr.state.params))
    new, metrics, _ = jax.jit(make_train_step(lf, sgd, 2))(state, tr.frozen, tr.t_state, batch)
    grad_of = jax.jit(jax.grad(lambda p, b: lf(p, tr.frozen, tr.t_state, b)[0]))
    whole = grad_of(tr.state.params, batch)
    micro = split_micro(batch, 2)
    assert np.array_equal(np.asarray(micro["tokens"][1]), np.asarray(batch["tokens"])[1::2])  # strided rows
    halves = [grad_of(tr.state.params, jax.tree.map(lambda x: x[i], micro)) for i in range(2)]
    upd = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), tr.state.params, new.params)
    mean_of_halves = jax.tree.map(lambda a, b: (np.asarray(a) + np.asarray(b)) / 2, *halves)
    for u, w in zip(jax.tree.leaves(upd), jax.tree.leaves(whole)):
        np.testing.assert_allclose(u, w, atol=1e-6, rtol=1e-4)
    assert max(np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in
               zip(jax.tree.leaves(mean_of_halves), jax.tree.leaves(whole))) > 1e-4
    np.testing.assert_allclose(float(metrics["loss"]), float(lf(tr.state.params, tr.frozen, tr.t_state, batch)[0]),
                               rtol=1e-5)
    tr.close()


def test_remote_output_dir_keeps_logs_in_a_local_mirror(monkeypatch, tmp_path):
    from dspark_jax.train.trainer import output_paths

    monkeypatch.setenv("DSPARK_JAX_LOCAL_RUN_DIR", str(tmp_path))
    remote, local = output_paths("gs://bucket/runs/a")
    assert str(remote) == "gs://bucket/runs/a" and local == tmp_path / "bucket_runs_a"
    r2, l2 = output_paths(str(tmp_path / "x"))
    assert r2 == l2 == tmp_path / "x"


def test_random_target_is_the_same_with_or_without_a_mesh():
    """A drafter trained against a random target (built on the training mesh) must find the same
    target when reloaded without one: eager initialisation drew other values (a fingerprint error)."""
    from dspark_jax.drafter.frozen import target_fingerprint
    from dspark_jax.parallel.sharding import make_mesh
    from dspark_jax.train.run import prepare_target

    cfg = from_cli(["micro"])
    assert target_fingerprint(prepare_target(cfg, None).model) == \
        target_fingerprint(prepare_target(cfg, None, make_mesh(1, 1, 1)).model)


def test_remat_of_drafter_layers_keeps_the_gradient(datasets, tmp_path):
    """train.remat=drafter_layers recomputes each drafter layer in the backward: same loss and
    gradient (to rounding) as storing them; kinds without the option say so."""
    import jax

    from dspark_jax.config.loader import ConfigError
    from dspark_jax.data.dataset import TokenDataset
    from dspark_jax.drafter import registry
    from dspark_jax.drafter.losses import LossCoefs
    from dspark_jax.train.run import prepare_target
    from dspark_jax.train.step import make_loss_fn
    from dspark_jax.train.trainer import Trainer

    cfg = _cfg(datasets, tmp_path, "drafter.num_layers=2")
    tr = Trainer(cfg, prepare_target(cfg, None).model, TokenDataset(datasets[0]), None, progress=False)
    tr.data_iter = tr._new_iter()
    batch = tr._device_batch(next(tr.data_iter))
    grads = {}
    for remat in ("none", "drafter_layers"):
        lf = make_loss_fn(tr.d_graphdef, tr.t_graphdef, registry.get_kind("dspark"), LossCoefs(), 4, remat=remat)
        grads[remat] = jax.jit(jax.value_and_grad(lambda p: lf(p, tr.frozen, tr.t_state, batch)[0]))(tr.state.params)
    np.testing.assert_allclose(float(grads["drafter_layers"][0]), float(grads["none"][0]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads["drafter_layers"][1]), jax.tree.leaves(grads["none"][1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7)
    with pytest.raises(ConfigError, match="train.remat=drafter_layers is not available for mtp1"):
        make_loss_fn(tr.d_graphdef, tr.t_graphdef, registry.get_kind("mtp1"), LossCoefs(), 4, remat="drafter_layers")
    tr.close()


def test_remote_output_dir_receives_logs_during_and_after_the_run(datasets, tmp_path, monkeypatch):
    """With a remote output dir, log.jsonl and the TensorBoard events are copied there while
    training (every `every_s`) and at the end; a VM that dies keeps all but the last minute."""
    from dspark_jax.train import run as run_module
    from dspark_jax.train import trainer as tr

    remote, local = tmp_path / "remote", tmp_path / "local"
    monkeypatch.setattr(tr, "output_paths", lambda _: (remote, local))
    monkeypatch.setattr(run_module, "output_paths", lambda _: (remote, local))  # the job's own reference
    monkeypatch.setattr(tr, "is_remote", lambda p: p == remote)
    counts = []
    orig = tr.LogMirror.sync

    def counting(self, force=False):
        self.every_s = 0.0  # sync at every logged step
        orig(self, force)
        counts.append(self.syncs)

    monkeypatch.setattr(tr.LogMirror, "sync", counting)
    run(_cfg(datasets, tmp_path / "ignored", "train.steps=4", "train.checkpoint_every=0"), progress=False)
    assert counts[-1] >= 5  # 4 logged steps + the final sync
    assert (remote / "log.jsonl").read_bytes() == (local / "log.jsonl").read_bytes()
    events = sorted(p.relative_to(local) for p in (local / "tensorboard").rglob("*") if p.is_file())
    assert events and all((remote / e).is_file() for e in events)


def test_logged_throughput_accounts_for_the_whole_training_time(datasets, tmp_path):
    """Steps are dispatched asynchronously: the logged tokens/s must include waiting for the device.
    Summed over the logged intervals, tokens / (tokens/s) is the time spent training; timing only the
    dispatch (the bug this guards against) sums to a fraction of it."""
    out = tmp_path / "tps"
    summary = run(_cfg(datasets, out, "train.steps=12", "train.log_every=1", "train.checkpoint_every=0",
                       "data.seq_len=48"), progress=False)
    rows = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    tokens_per_interval = 4 * 48  # batch 4 x sequence 48, one step per logged interval
    seconds = sum(tokens_per_interval / r["tokens_per_s"] for r in rows if "tokens_per_s" in r)
    training = summary["phases_s"]["training"]
    print(f"logged {seconds:.3f} s of {training:.3f} s training")
    assert 0.95 * training <= seconds <= 1.01 * training, (seconds, training)  # the dispatch-only clock gave 0.83
