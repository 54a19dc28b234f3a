"""The embedded default target: a small Qwen3 pretrained on the offline corpora, cached per user.

Why: the main job must run on a fresh CPU machine (or Colab) with no downloads, and it must
be real (a trained target, not random weights). So the first use builds one through the
same code paths a real Qwen3 user takes: corpora -> byte-level BPE tokenizer -> ChatML
rendering -> AdamW pretraining -> Hugging Face layout (config.json + model.safetensors +
tokenizer.json + tokenizer_config.json) that ``load_target`` reads like any checkpoint.

Training objective: next-token loss on *all* tokens of each chat-rendered conversation
(prompts included, not only assistant tokens): the target must model prompts too (the
drafter reads target features over them), and pretraining on everything doubles the
signal on a tiny budget. Conversations are joined with ``<|endoftext|>`` into one stream
cut into rows of ``seq_len`` (standard packed LM pretraining).

Cache: ``$DSPARK_JAX_CACHE`` (default ``~/.cache/dspark_jax``)/``embedded-<preset>-v<N>``.
A ``manifest.json`` written last holds the size and sha256 of every file; a directory
without a valid manifest, or whose files do not match it, is corrupt and rebuilt, never
used. Builds happen in a temporary sibling directory under a file lock and are renamed
into place atomically. An interrupted build resumes from its orbax checkpoint.

Command: ``python -m dspark_jax embedded build [--force] [--preset full|tiny]``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dspark_jax.console import progress_bar
from dspark_jax.data import corpora as C
from dspark_jax.io.cache import cache_root
from dspark_jax.io.files import sha256_file
from dspark_jax.io.hf import build_from_pure, save_target
from dspark_jax.parallel.sharding import create_model
from dspark_jax.target import ModelConfig, RopeConfig, TargetModel
from dspark_jax.target.lm_loss import lm_loss
from dspark_jax.text.chat import CHATML_TEMPLATE, encode_chat, render_text
from dspark_jax.text.tokenizer import ENDOFTEXT, IM_END, MASK, PAD, train_tokenizer
from dspark_jax.toolkit.checkpoint import Checkpointer
from dspark_jax.toolkit.metrics import MetricsLogger
from dspark_jax.toolkit.optim import adamw, warmup_cosine_schedule

log = logging.getLogger(__name__)
BUILD_VERSION = 1
MANIFEST = "manifest.json"
WEIGHT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
DOMAINS = ("code", "math", "prose")


@dataclass(frozen=True)
class Preset:
    """Everything that determines an embedded build (recorded in config.json)."""

    name: str
    vocab_size: int
    n_code: int | None  # None = every train item of the domain
    n_math: int
    n_prose: int | None
    n_heldout_math: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    seq_len: int
    batch_size: int
    steps: int
    peak_lr: float
    warmup_frac: float = 0.04
    weight_decay: float = 0.01
    checkpoint_every: int = 0  # 0 = no intermediate orbax checkpoints
    rope_theta: float = 10000.0


PRESETS = {
    # ~8-11 min cold on 2 cores: 8 x 128, 1.47 M tokens (about one epoch of the corpus).
    "full": Preset("full", vocab_size=4096, n_code=None, n_math=3000, n_prose=None, n_heldout_math=200,
                   hidden_size=128, intermediate_size=384, num_layers=8, num_heads=4, num_kv_heads=2,
                   head_dim=32, seq_len=256, batch_size=16, steps=360, peak_lr=3e-3,
                   checkpoint_every=100),
    # Under a minute to build, for tests: the same pipeline, 8 layers x 64, vocabulary 1024,
    # math-heavy so that it learns something measurable (math) within 200 steps.
    "tiny": Preset("tiny", vocab_size=1024, n_code=200, n_math=1500, n_prose=200, n_heldout_math=100,
                   hidden_size=64, intermediate_size=192, num_layers=8, num_heads=2, num_kv_heads=1,
                   head_dim=32, seq_len=128, batch_size=16, steps=200, peak_lr=4e-3),
}


def get_preset(preset: str | Preset = "full", small: bool = False) -> Preset:
    if isinstance(preset, Preset):
        return preset
    name = "tiny" if small else preset
    if name not in PRESETS:
        raise ValueError(f"unknown embedded preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name]


def _cache_name(preset: Preset, seed: int) -> str:
    return f"embedded-{preset.name}-v{BUILD_VERSION}" + (f"-seed{seed}" if seed else "")


# ------------------------------------------------------------------------ manifest

def write_manifest(d: Path, info: dict | None = None) -> dict:
    files = {f: {"size": (d / f).stat().st_size, "sha256": sha256_file(d / f)} for f in WEIGHT_FILES}
    man = {"build_version": BUILD_VERSION, "files": files, **(info or {})}
    (d / MANIFEST).write_text(json.dumps(man, indent=2, sort_keys=True))
    return man


def verify_target_dir(d) -> str | None:
    """None if ``d`` is a complete, uncorrupted embedded target, else the reason it is not."""
    d = Path(d)
    if not d.is_dir():
        return f"{d} does not exist"
    try:
        man = json.loads((d / MANIFEST).read_text())
        files = man["files"]
    except FileNotFoundError:
        return f"{d / MANIFEST} is missing (interrupted or foreign build)"
    except (ValueError, KeyError, TypeError) as e:
        return f"{d / MANIFEST} is unreadable ({e})"
    if man.get("build_version") != BUILD_VERSION:
        return f"{d} was built by build version {man.get('build_version')}, expected {BUILD_VERSION}"
    for f in WEIGHT_FILES:
        p = d / f
        want = files.get(f)
        if want is None:
            return f"{d / MANIFEST} does not list {f}"
        if not p.is_file():
            return f"{p} is missing"
        if p.stat().st_size != want["size"]:
            return f"{p} has {p.stat().st_size} bytes, manifest says {want['size']}"
        if sha256_file(p) != want["sha256"]:
            return f"{p} does not match its sha256 in the manifest"
    return None


@contextlib.contextmanager
def _lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# -------------------------------------------------------------------------- data

def _corpora(preset: Preset, seed: int):
    """(train conversations, {domain: heldout conversations})."""

    big = 10 ** 9
    train = C.build_corpus("train", seed, n_code=preset.n_code or big, n_math=preset.n_math,
                           n_prose=preset.n_prose or big)
    held = {"code": C.code_conversations("heldout", seed),
            "math": C.math_conversations("heldout", seed, preset.n_heldout_math),
            "prose": C.prose_conversations("heldout", seed)}
    return train, held


def tokenizer_config(template: str, model_max_length: int) -> dict:

    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": IM_END,
            "pad_token": PAD, "mask_token": MASK, "unk_token": None, "endoftext_token": ENDOFTEXT,
            "model_max_length": model_max_length, "chat_template": template}


def encode_stream(tokenizer, conversations, template=None) -> np.ndarray:
    """Chat-rendered conversations joined with <|endoftext|> into one int32 token stream."""

    eot = tokenizer.token_to_id(ENDOFTEXT)
    parts = []
    for conv in conversations:
        ids, _ = encode_chat(tokenizer, conv, template)
        parts.append(ids)
        parts.append(np.asarray([eot], np.int32))
    return np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)


def _rows(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """[N, seq_len + 1] windows with stride seq_len (inputs = [:, :-1], targets = [:, 1:])."""
    n = (len(stream) - 1) // seq_len
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return stream[idx]


def _model_config(preset: Preset, vocab_size: int, eos_id: int):

    return ModelConfig(arch="qwen3", vocab_size=vocab_size, hidden_size=preset.hidden_size,
                       intermediate_size=preset.intermediate_size, num_layers=preset.num_layers,
                       num_heads=preset.num_heads, num_kv_heads=preset.num_kv_heads, head_dim=preset.head_dim,
                       rope=RopeConfig(theta=preset.rope_theta), tie_word_embeddings=True,
                       max_position_embeddings=preset.seq_len, eos_token_id=eos_id)


# ---------------------------------------------------------------------- training

def _train(model_cfg, rows: np.ndarray, preset: Preset, seed: int, work: Path | None, progress: bool,
           log_path: Path | None, fingerprint: str):
    """AdamW pretraining; returns (pure param dict, last losses). Resumes from ``work`` checkpoints."""


    model = create_model(lambda: TargetModel(model_cfg, rngs=nnx.Rngs(seed)))
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    warmup = max(1, math.ceil(preset.warmup_frac * preset.steps))
    schedule = warmup_cosine_schedule(preset.peak_lr, preset.steps, warmup)
    # Weight decay on matrices only (norm gains and 1-D params are not decayed).
    tx = adamw(schedule, b1=0.9, b2=0.98, weight_decay=preset.weight_decay, clip_norm=1.0,
               mask=lambda p: jax.tree_util.tree_map_with_path(lambda path, _: "norm" not in jax.tree_util.keystr(path),
                                                               p))
    opt_state = tx.init(params)

    def loss_fn(p, batch):
        logits = nnx.merge(graphdef, p)(batch[:, :-1]).logits
        return lm_loss(logits, batch[:, 1:], batch[:, 1:] >= 0)

    @jax.jit
    def step(p, o, batch):
        loss, g = jax.value_and_grad(loss_fn)(p, batch)
        upd, o = tx.update(g, o, p)
        return optax.apply_updates(p, upd), o, loss

    start = 0
    ckpt = None
    if work is not None and preset.checkpoint_every:
        ckpt = Checkpointer(work / "ckpt", keep=1)
        last = ckpt.latest_step()
        if last is not None:
            try:
                tree, meta = ckpt.restore(last, {"params": params, "opt": opt_state})
                if (meta or {}).get("fingerprint") == fingerprint:
                    params, opt_state, start = tree["params"], tree["opt"], last
            except Exception:  # noqa: BLE001 - an unreadable checkpoint only costs a restart
                start = 0

    n_rows, bs = len(rows), preset.batch_size
    per_epoch = n_rows // bs
    if per_epoch < 1:
        raise ValueError(f"corpus gives {n_rows} rows of {preset.seq_len} tokens, fewer than one batch of {bs}")
    orders = {}

    def batch_at(s):
        epoch, k = divmod(s, per_epoch)
        if epoch not in orders:
            orders[epoch] = np.random.default_rng([seed, epoch]).permutation(n_rows)
        return rows[orders[epoch][k * bs:(k + 1) * bs]]

    logger = MetricsLogger(log_path)
    bar = progress_bar(total=preset.steps, initial=start, desc=f"train embedded-{preset.name}", enabled=progress,
                       unit="step")
    losses = []
    for s in range(start, preset.steps):
        params, opt_state, loss = step(params, opt_state, batch_at(s))
        if s % 10 == 0 or s == preset.steps - 1:
            lv = float(loss)
            losses.append((s, lv))
            bar.set_postfix(loss=f"{lv:.3f}")
            logger.log({"step": s, "loss": lv, "lr": float(schedule(s))})
        bar.update(1)
        if ckpt is not None and (s + 1) % preset.checkpoint_every == 0 and s + 1 < preset.steps:
            ckpt.save(s + 1, {"params": params, "opt": opt_state}, meta={"fingerprint": fingerprint})
    bar.close()
    logger.close()
    if ckpt is not None:
        ckpt.close()
    return jax.tree.map(np.asarray, params), losses


# ------------------------------------------------------------------------- build

def build_embedded_target(out_dir, *, preset: str | Preset = "full", small: bool = False, seed: int = 0,
                          progress: bool = True, work_dir=None) -> Path:
    """Build the embedded target into ``out_dir`` (atomically: temp sibling + rename).

    ``small=True`` is shorthand for ``preset="tiny"``. ``work_dir`` keeps orbax checkpoints
    so an interrupted build resumes (default: ``<out_dir>.work``, removed on success).
    """


    p = get_preset(preset, small)
    out_dir = Path(out_dir)
    t0 = time.time()
    work = Path(work_dir) if work_dir is not None else out_dir.with_name(out_dir.name + ".work")
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        train, _held = _corpora(p, seed)
        manifest = C.corpus_manifest(train, seed=seed, n_code=p.n_code, n_math=p.n_math, n_prose=p.n_prose)
        texts = [render_text(conv) for conv in train]
        tok = train_tokenizer(texts, vocab_size=p.vocab_size)
        tok.save(tmp / "tokenizer.json")
        tcfg = tokenizer_config(CHATML_TEMPLATE, p.seq_len)
        (tmp / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2))
        stream = encode_stream(tok, train)
        rows = _rows(stream, p.seq_len)
        t_data = time.time() - t0
        cfg = _model_config(p, tok.vocab_size, tok.eos_id)
        fingerprint = hashlib.sha256(json.dumps([dataclasses.asdict(p), seed, manifest["sha256"],
                                                 tok.fingerprint, BUILD_VERSION]).encode()).hexdigest()
        work.mkdir(parents=True, exist_ok=True)
        pure, losses = _train(cfg, rows, p, seed, work, progress, tmp / "train_log.jsonl", fingerprint)
        model = build_from_pure(cfg, pure, jnp.float32)
        extra = {
            "pad_token_id": tok.pad_id,
            "corpus_sha256": manifest["sha256"],
            "corpus_python_version": manifest["python_version"],
            "dspark_embedded": {
                "preset": dataclasses.asdict(p), "seed": seed, "build_version": BUILD_VERSION,
                "corpus": manifest, "train_tokens": int(len(stream)), "tokens_seen": p.steps * p.batch_size * p.seq_len,
                "final_train_loss": losses[-1][1] if losses else None,
                "data_seconds": round(t_data, 1), "build_seconds": round(time.time() - t0, 1),
                "fingerprint": fingerprint,
            },
        }
        save_target(model, tmp, extra_config=extra)
        write_manifest(tmp, {"preset": p.name, "seed": seed, "corpus_sha256": manifest["sha256"]})
        if out_dir.exists():
            trash = out_dir.with_name(f".{out_dir.name}.trash-{os.getpid()}")
            os.rename(out_dir, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(work, ignore_errors=True)
    return out_dir


def target_cache_dir(preset: str | Preset = "full", seed: int = 0, cache_dir=None) -> Path:
    """Where the embedded target of `preset` and `seed` is cached (built or not)."""
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    return root / _cache_name(get_preset(preset), seed)


def resolve_target_dir(target_dir=None):
    """`target_dir` as given when one is named, else the embedded target's directory (a Path,
    built when missing): what every command and the server mean by "no --target"."""
    return target_dir if target_dir is not None else embedded_target_dir(build=True, progress=True)


def embedded_target_dir(build: bool = True, progress: bool = True, *, preset: str | Preset = "full",
                        small: bool = False, seed: int = 0, force: bool = False, cache_dir=None) -> Path:
    """Directory of the cached embedded target, building it when missing or corrupt.

    ``build=False`` raises instead of building. ``force=True`` rebuilds unconditionally.
    """
    p = get_preset(preset, small)
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    d = root / _cache_name(p, seed)
    if not force and verify_target_dir(d) is None:
        return d
    if not build:
        raise FileNotFoundError(
            f"embedded target {d}: {verify_target_dir(d)}; build it with "
            f"`python -m dspark_jax embedded build --preset {p.name}` (or pass build=True)")
    with _lock(root / f".{d.name}.lock"):
        problem = verify_target_dir(d)
        if force or problem is not None:  # re-check: another process may have built it meanwhile
            if d.exists() and problem is not None and progress:
                log.warning(f"rebuilding embedded target: {problem}")
            build_embedded_target(d, preset=p, seed=seed, progress=progress)
    return d
