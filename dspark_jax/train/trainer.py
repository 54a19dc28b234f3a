"""The training loop: mesh, sharded state, checkpoints, evaluation, logs, summary."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dspark_jax.config import Config
from dspark_jax.config.loader import to_dict
from dspark_jax.console import progress_bar
from dspark_jax.data.pipeline import (
    PAD_ID,
    RecordSpec,
    check_dataset,
    heldout_batches,
    make_pipeline,
)
from dspark_jax.drafter import registry
from dspark_jax.drafter.frozen import Frozen, attach_target
from dspark_jax.drafter.losses import LossCoefs
from dspark_jax.eval.metrics import bootstrap_tau
from dspark_jax.io import drafter_dir as drafter_io
from dspark_jax.io.compile_cache import compile_seconds
from dspark_jax.io.reference import write_reference
from dspark_jax.parallel.sharding import (
    create_model,
    host_arrays,
    make_mesh,
    state_shardings,
)
from dspark_jax.toolkit.checkpoint import Checkpointer, PreemptionFlag
from dspark_jax.toolkit.metrics import MetricsLogger
from dspark_jax.train.step import (
    TrainState,
    make_eval_step,
    make_loss_fn,
    make_optimizer,
    make_train_step,
    require_cacheable,
)


class TrainingError(RuntimeError):
    pass


class Phases:
    """Wall time per phase, the part of it spent compiling (tracing, lowering, compiling or
    reading programs back from JAX's persistent cache) and the part spent reading executables back
    from the program store (io/program_store.py), for the final summary table."""
    def __init__(self):
        self.times: dict[str, float] = {}
        self.compile: dict[str, float] = {}  # compiling and reading back, both
        self.reading: dict[str, float] = {}  # of which reading back stored executables

    @contextmanager
    def __call__(self, name: str):
        t0, c0, b0 = time.perf_counter(), compile_seconds(), compile_seconds(stored_reads=False)
        try:
            yield
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0
            c, b = compile_seconds() - c0, compile_seconds(stored_reads=False) - b0
            self.compile[name] = self.compile.get(name, 0.0) + c
            self.reading[name] = self.reading.get(name, 0.0) + c - b

    def table(self) -> str:
        total = sum(self.times.values()) or 1.0
        rows = []
        for k, v in self.times.items():
            read = self.reading.get(k, 0.0)
            rows.append(f"  {k:<22} {v:8.1f} s  {100 * v / total:5.1f} %  {self.compile.get(k, 0.0) - read:8.1f} s"
                        f"  {read:8.1f} s")
        return "\n".join(["  phase                      time   share   compiling  reading back", *rows])


def is_remote(path) -> bool:
    return "://" in str(path)


def output_paths(output_dir: str) -> tuple[object, Path]:
    """(where checkpoints and the final export go, where logs are written as they happen).

    A `gs://` output dir takes orbax checkpoints directly (tensorstore writes to GCS);
    the JSONL log and TensorBoard files go to a local mirror that tpu_scripts/worker.sh
    copies up every minute, and the summary and drafter export are copied at the end.
    """
    if not is_remote(output_dir):
        p = Path(output_dir).absolute()
        return p, p
    from etils import epath

    local_root = Path(os.environ.get("DSPARK_JAX_LOCAL_RUN_DIR", "~/dspark_runs")).expanduser()
    name = output_dir.split("://", 1)[1].strip("/").replace("/", "_")
    return epath.Path(output_dir), local_root / name


def check_output_dir(path) -> None:
    """Fail early on an unwritable output dir; every host of a run probes it at once, so each probes its own file."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write_test.{socket.gethostname()}.{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except Exception as e:  # OSError locally; fsspec / auth errors remotely
        reason = getattr(e, "strerror", None) or str(e) or type(e).__name__
        raise TrainingError(f"output directory '{path}' cannot be written ({reason}); "
                            "set train.output_dir to a writable path") from None


def copy_tree(src: Path, dst) -> None:
    """Copy a local directory (recursively) to a local or remote (epath) directory."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
        elif f.is_dir():
            copy_tree(f, dst / f.name)


class LogMirror:
    """Copies the run's log.jsonl and TensorBoard files from the local mirror to a remote output
    dir every `every_s` seconds and at the end, so they outlive the VM (`remote` None: no-op)."""

    def __init__(self, local: Path, remote, every_s: float = 60.0):
        self.local, self.remote, self.every_s = local, remote, every_s
        self.last = time.monotonic()
        self.syncs = 0

    def sync(self, force: bool = False) -> None:
        if self.remote is None or (not force and time.monotonic() - self.last < self.every_s):
            return
        self.remote.mkdir(parents=True, exist_ok=True)
        log = self.local / "log.jsonl"
        if log.is_file():
            (self.remote / "log.jsonl").write_bytes(log.read_bytes())
        if (self.local / "tensorboard").is_dir():
            copy_tree(self.local / "tensorboard", self.remote / "tensorboard")
        self.last = time.monotonic()
        self.syncs += 1


def bootstrap_ratio(pairs: list[tuple[float, float]], n: int = 2000, seed: int = 0) -> list[float]:
    """95 % percentile interval of sum(a) / sum(b) resampling the (a, b) pairs (held-out batches):
    `eval.bootstrap_tau` with a = accepted + rounds, b = rounds."""

    if len(pairs) < 2:
        return [float("nan"), float("nan")]
    a, b = np.asarray(pairs, float).T
    return list(bootstrap_tau(a - b, b, n, seed)[1:])


def check_vocabulary(ds, vocab_size: int, name: str) -> None:
    """The data's token ids must index the target's (and so the drafter's) vocabulary."""
    meta_v = (getattr(ds, "meta", None) or {}).get("vocab_size")
    n = len(ds)
    top = max(int(np.max(ds[int(i)]["tokens"], initial=0)) for i in np.linspace(0, n - 1, min(n, 64)).astype(int))
    if (meta_v is not None and meta_v > vocab_size) or top >= vocab_size:
        raise TrainingError(
            f"{name} was tokenized with a vocabulary of {meta_v if meta_v is not None else top + 1} tokens "
            "but the target "
            f"(and drafter) vocabulary has {vocab_size}: regenerate the data with the target's tokenizer"
        )


def check_cache(features, spec: RecordSpec, layer_ids) -> None:
    """A feature cache must be the one this run's pipeline and drafter read."""
    ident = features.meta["identity"]
    want = {"seq_len": spec.seq_len, "pad_id": spec.pad_id, "layers": [int(i) for i in layer_ids]}
    diff = {k: (ident.get(k), v) for k, v in want.items() if ident.get(k) != v}
    if diff:
        raise TrainingError(f"feature cache {features.path} does not fit this run ({diff}: cache, run); "
                            "compute it for this config with `python -m dspark_jax features CONFIG`")


def model_signature(drafter, target_cfg) -> dict:
    """What must match to resume: the drafter's shape and the target it belongs to."""
    sig = drafter_io.config_json(drafter)
    sig.pop("param_dtype", None)
    sig["target"] = dataclasses.asdict(target_cfg)
    return json.loads(json.dumps(sig, default=str))


class Trainer:
    """Holds the sharded target, drafter and optimiser; `fit` runs the loop."""
    def __init__(self, cfg: Config, target, train_ds, heldout_ds=None, *, log=print, progress: bool = True,
                 phases: Phases | None = None, mesh=None, features=None):
        """`features`: the training set's feature cache (data.features.FeatureCache); its rows then
        replace the target forward in the training step (held-out evaluation stays online)."""
        self.cfg = cfg
        self.log = log if jax.process_index() == 0 else (lambda *a, **k: None)
        self.progress = progress and jax.process_index() == 0
        self.phases = phases or Phases()
        self.target = target  # TargetModel
        self.out, self.local_out = output_paths(cfg.train.output_dir)
        check_output_dir(self.out)
        check_output_dir(self.local_out)
        tc = cfg.train
        self.mesh = mesh if mesh is not None else make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
        dcfg = registry.resolve(target.cfg, cfg.drafter)
        self.dcfg = dcfg
        drafter = create_model(lambda: registry.build(target.cfg, dcfg, rngs=nnx.Rngs(cfg.seed),
                                                      ttt_steps=tc.eagle3_steps),
                               self.mesh)
        attach_target(drafter, target)
        self.drafter = drafter
        self.signature = model_signature(drafter, target.cfg)
        self.d_graphdef, params, frozen = nnx.split(drafter, nnx.Param, Frozen)
        self.t_graphdef, t_state = nnx.split(target)
        self.param_sh = state_shardings(params, self.mesh)
        self.frozen = jax.device_put(frozen, state_shardings(frozen, self.mesh))
        self.t_state = jax.device_put(t_state, state_shardings(t_state, self.mesh))
        params = jax.device_put(params, self.param_sh)

        self.train_ds, self.heldout_ds = train_ds, heldout_ds
        check_dataset(train_ds, "training dataset")
        check_vocabulary(train_ds, target.cfg.vocab_size, "training dataset")
        if heldout_ds is not None:
            check_vocabulary(heldout_ds, target.cfg.vocab_size, "held-out dataset")
        global_batch = tc.batch_size
        if global_batch % jax.process_count():
            raise TrainingError(f"train.batch_size {global_batch} must be divisible by the {jax.process_count()} hosts")
        self.local_batch = global_batch // jax.process_count()
        steps_per_epoch = max(1, len(train_ds) // global_batch)
        self.total_steps = tc.steps if tc.steps is not None else max(1, int(math.ceil(tc.epochs * steps_per_epoch)))
        self.spec = RecordSpec(cfg.data.seq_len, cfg.data.num_anchors, dcfg.gamma, pad_id=PAD_ID, seed=cfg.seed)
        self.features = features
        if features is not None:
            require_cacheable(registry.get_kind(dcfg.kind))
            check_cache(features, self.spec, dcfg.target_layer_ids)
        self.tx, self.schedule = make_optimizer(tc.lr, self.total_steps,
                                                tc.warmup_frac, tc.b1, tc.b2, tc.weight_decay, tc.clip_norm)
        # Adam moments are laid out like their parameters; counters are replicated.
        abstract_opt = jax.eval_shape(self.tx.init, params)
        rep = NamedSharding(self.mesh, P())
        leaf_sh = jax.tree.map(lambda x: x.sharding, params)  # same pytree type as params
        opt_sh = optax.tree_map_params(self.tx, lambda _, sh: sh, abstract_opt, leaf_sh,
                                       transform_non_params=lambda _: rep)
        opt_state = jax.jit(self.tx.init, out_shardings=opt_sh)(params)
        self.state = self._on_mesh(TrainState(jnp.zeros((), jnp.int32), params, opt_state))
        compute = jnp.bfloat16 if tc.compute_dtype == "bfloat16" else None
        coefs = LossCoefs.from_train(tc, dcfg.gamma)
        loss_fn = make_loss_fn(self.d_graphdef, self.t_graphdef, registry.get_kind(dcfg.kind),
                               coefs, tc.anchor_chunk, compute,
                               tc.eagle3_steps, tc.remat)
        self.batch_sh = NamedSharding(self.mesh, P(("data", "fsdp")))
        state_sh = jax.tree.map(lambda x: x.sharding, self.state)
        micro_sh = NamedSharding(self.mesh, P(None, ("data", "fsdp")))
        self.train_step = jax.jit(make_train_step(loss_fn, self.tx, tc.grad_accum, micro_sh), donate_argnums=(0,),
                                  out_shardings=(state_sh, None, None))
        self.eval_step = jax.jit(make_eval_step(loss_fn, tc.grad_accum, micro_sh))
        self.ckpt = Checkpointer(self.out / "checkpoints", tc.checkpoint_every, tc.keep_checkpoints)
        self.data_iter = None
        self._saved: set[int] = set()

    def _on_mesh(self, tree):
        """Leaves not already laid out on this mesh (step counters, Adam counts) are replicated on it."""
        rep = NamedSharding(self.mesh, P())

        def place(x):
            sh = getattr(x, "sharding", None)
            if isinstance(sh, NamedSharding) and sh.mesh == self.mesh:
                return x
            return jax.device_put(x, rep)

        return jax.tree.map(place, tree)

    # ------------------------------------------------------------------ data
    def _device_batch(self, batch: dict) -> dict:
        return {k: jax.make_array_from_process_local_data(self.batch_sh, np.asarray(v)) for k, v in batch.items()}

    def _new_iter(self):
        return iter(make_pipeline(self.train_ds, self.spec, self.local_batch, shuffle=True, features=self.features))

    # ------------------------------------------------------------------ checkpoints
    def _abstract_state(self):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.state)

    def maybe_resume(self) -> int:
        step = self.ckpt.latest_step() if self.cfg.train.resume else None
        if step is None:
            return 0
        meta = self.ckpt.read_meta(step)
        saved = meta.get("signature")
        if saved != self.signature:
            diff = sorted(k for k in set(saved or {}) | set(self.signature)
                          if (saved or {}).get(k) != self.signature.get(k))
            raise TrainingError(
                f"cannot resume from {self.ckpt.directory}/{step}: the model shape changed ({', '.join(diff)} differ); "
                "use a new train.output_dir or set train.resume=false to start over (existing checkpoints are kept)"
            )
        with self.phases("restore checkpoint"):
            self.state, _ = self.ckpt.restore(step, self._abstract_state(), self.data_iter)
        self.log(f"resumed from step {step} ({self.ckpt.directory / str(step)})")
        return step

    def save(self, step: int, wait: bool = False):
        if step in self._saved:
            if wait:
                self.ckpt.wait()
            return
        self._saved.add(step)
        meta = {"signature": self.signature, "config": to_dict(self.cfg), "step": step,
                "drafter_config": drafter_io.config_json(self.drafter)}
        self.ckpt.save(step, self.state, self.data_iter, meta, wait=wait)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict:
        if self.heldout_ds is None or len(self.heldout_ds) == 0:
            return {}
        it = heldout_batches(self.heldout_ds, dataclasses.replace(self.spec, seed=self.cfg.seed + 1), self.local_batch)
        tot = None
        losses: list[float] = []
        per_batch: list[tuple[float, float]] = []  # (sum of block tau, blocks): bootstrap unit
        for i, batch in enumerate(it):
            if i >= self.cfg.train.eval_batches:
                break
            metrics, sums = self.eval_step(self.state.params, self.frozen, self.t_state, self._device_batch(batch))
            if sums is None:  # baselines: held-out loss only
                losses.append(float(metrics["loss"]))
                continue
            sums = jax.tree.map(np.asarray, sums)
            per_batch.append((float(sums.tau), float(sums.blocks)))
            tot = sums if tot is None else jax.tree.map(np.add, tot, sums)
        if tot is None:
            return {"eval/loss": float(np.mean(losses))} if losses else {}
        den = max(float(tot.weight), 1e-9)
        acc = tot.accept / np.maximum(tot.count, 1)
        return {
            "eval/ce": float(tot.ce) / den, "eval/l1": float(tot.l1) / den,
            "eval/expected_accepted_length": float(tot.tau) / max(float(tot.blocks), 1.0),
            "eval/acceptance_per_position": [round(float(a), 4) for a in acc],
            "eval/top1_per_position": [round(float(a), 4) for a in tot.correct / np.maximum(tot.count, 1)],
            "eval/blocks": int(tot.blocks),
            "eval/expected_accepted_length_ci95": bootstrap_ratio(per_batch),
        }

    # ------------------------------------------------------------------ loop
    def _step_metrics(self, step: int, metrics: dict, last_good: int, tokens: int, seconds: float) -> dict:
        """Host floats of a logged step (+ throughput, lr); a non-finite loss stops training."""
        m = {k: float(v) for k, v in metrics.items()}
        if not all(math.isfinite(v) for v in m.values()):
            raise TrainingError(
                f"non-finite loss at step {step} ({m}); training stopped. The last good checkpoint "
                f"(step {last_good}) in {self.ckpt.directory} is kept; lower train.lr or check the data"
            )
        m["tokens_per_s"] = tokens / max(seconds, 1e-9)
        m["lr"] = float(self.schedule(step))
        return m

    def _export(self):
        """Gather the final drafter on every process, write it (reference layout) on process 0,
        copy it to gs:// outputs, and wait until it is written. Returns (export dir, the drafter
        with host parameters: every process can decode with it without reading the file)."""
        export = self.out / "drafter"
        # with fsdp over several hosts no process holds a whole parameter: gather (a collective)
        drafter = nnx.merge(self.d_graphdef, host_arrays(self.state.params), self.frozen)
        if jax.process_index() == 0:
            local_export = self.local_out / "drafter"
            # what `python -m dspark_jax convert export` records in the reference config.json
            drafter_io.save(drafter, local_export, training={"num_anchors": int(self.cfg.data.num_anchors)})
            if is_remote(self.out):
                copy_tree(local_export, export)
        if registry.kind_of(drafter).has_reference_layout:  # what vLLM / SGLang load (docs/serving.md)

            local_ref = self.local_out / "drafter_reference"
            write_reference(drafter, local_ref, "bfloat16", int(self.cfg.data.num_anchors),
                            write=jax.process_index() == 0)
            if jax.process_index() == 0 and is_remote(self.out):
                copy_tree(local_ref, self.out / "drafter_reference")
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("dspark_jax drafter export")
        return export, drafter

    def fit(self) -> dict:
        with jax.set_mesh(self.mesh):  # activation constraints (parallel.sharding.constrain) read it
            return self._fit()

    def _fit(self) -> dict:
        tc = self.cfg.train
        self.data_iter = self._new_iter()
        start = self.maybe_resume()
        self._saved.add(start)
        main = jax.process_index() == 0
        logger = MetricsLogger(self.local_out / "log.jsonl" if main else None,
                               self.local_out / "tensorboard" if main else None)
        self.mirror = LogMirror(self.local_out, self.out if main and is_remote(self.out) else None)

        def scalars(step, values):  # evaluation returns {} without held-out data: nothing to log then
            if values:
                logger.log({"step": step, **values})

        flag = PreemptionFlag()
        tokens_per_step = tc.batch_size * self.cfg.data.seq_len
        last_good = start
        step = start
        stop_at = self.total_steps if tc.stop_after_steps is None else min(self.total_steps,
                                                                           start + tc.stop_after_steps)
        preempted = False
        bar = progress_bar(total=self.total_steps, initial=start, desc="train", unit="step", enabled=self.progress)
        # Throughput: steps are dispatched asynchronously, so the clock is read only after the
        # logged step's results are on the host, and time spent in evaluation and checkpoint saves
        # (after the steps before them have finished) is left out.
        t_last, n_last, paused = time.perf_counter(), step, 0.0
        try:
            with self.phases("training"):
                while step < stop_at:
                    batch = next(self.data_iter)
                    self.state, metrics, _ = self.train_step(self.state, self.frozen, self.t_state,
                                                             self._device_batch(batch))
                    step += 1
                    if step % tc.log_every == 0 or step == stop_at:
                        jax.block_until_ready(metrics)
                        now = time.perf_counter()
                        m = self._step_metrics(step, metrics, last_good, tokens_per_step * (step - n_last),
                                               now - t_last - paused)
                        t_last, n_last, paused = now, step, 0.0
                        scalars(step, m)
                        self.mirror.sync()
                        bar.set_postfix({k: f"{m[k]:.3g}" for k in ("loss", "ce", "l1", "conf_bce", "tokens_per_s")
                                         if k in m})
                    bar.update(1)
                    evaluate = tc.eval_every and step % tc.eval_every == 0 and step < stop_at
                    save = self.ckpt.should_save(step)
                    if evaluate or save:
                        jax.block_until_ready(self.state)
                        t_pause = time.perf_counter()
                        if evaluate:
                            with self.phases("evaluation"):
                                scalars(step, self.evaluate())
                        if save:
                            self.save(step)
                            last_good = step
                        paused += time.perf_counter() - t_pause
                    if self.ckpt.agreed_preemption(step, bool(flag)):
                        self.log(f"preemption signal: saving step {step} and exiting")
                        self.save(step, wait=True)
                        preempted = True
                        break
        finally:
            bar.close()
            flag.restore()
        self.ckpt.wait()
        if preempted:  # the VM is going away: the checkpoint is written, nothing else is started
            logger.close()
            self.mirror.sync(force=True)
            self.exported = None
            return {"step": step, "total_steps": self.total_steps, "preempted": True,
                    "checkpoint": str(self.ckpt.directory / str(step)), "drafter": None, "eval": {}}
        self.save(step, wait=True)
        with self.phases("evaluation"):
            final_eval = self.evaluate()
        scalars(step, final_eval)
        logger.close()
        self.mirror.sync(force=True)
        export, self.exported = self._export()
        return {"step": step, "total_steps": self.total_steps, "preempted": False,
                "checkpoint": str(self.ckpt.directory / str(step)), "drafter": str(export),
                "drafter_local": str(self.local_out / "drafter"), "eval": final_eval}

    def close(self):
        self.ckpt.close()
