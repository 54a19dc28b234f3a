"""The offline feature cache: same training step as online, refusals, resume, and the pipeline's rows."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

from dspark_jax.config import DataSection, from_cli
from dspark_jax.config.loader import ConfigError
from dspark_jax.data.dataset import DatasetWriter, TokenDataset
from dspark_jax.data.features import (
    FeatureCache,
    FeatureCacheError,
    FeatureIdentity,
    dataset_hash,
    ensure_features,
    write_features,
)
from dspark_jax.data.pipeline import PAD_ID, RecordSpec, heldout_batches, make_pipeline
from dspark_jax.drafter import registry
from dspark_jax.drafter.frozen import target_fingerprint
from dspark_jax.drafter.losses import LossCoefs
from dspark_jax.testing.tiny import tiny_config, tiny_target
from dspark_jax.train.run import prepare_target
from dspark_jax.train.step import make_loss_fn, require_cacheable
from dspark_jax.train.trainer import Trainer

SEQ = 32
LAYERS = (0, 1)


def _write(path, n, seed, vocab):
    rng = np.random.default_rng(seed)
    w = DatasetWriter(path, vocab_size=vocab)
    for _ in range(n):
        length = int(rng.integers(12, SEQ + 8))  # some longer than SEQ: cut as the pipeline cuts
        m = np.zeros(length, bool)
        m[4:] = True
        w.add(rng.integers(1, vocab, length), m)
    return TokenDataset(w.close())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny target, a 5-record dataset, and its cache in shards of 2 records."""
    d = tmp_path_factory.mktemp("feat")
    target = tiny_target(tiny_config(vocab_size=16, hidden_size=32), seed=0)
    ds = _write(d / "train", 5, 0, 16)
    cache = ensure_features(target, ds, d / "cache", layers=LAYERS, seq_len=SEQ, pad_id=PAD_ID, progress=False,
                            shard_records=2, batch_size=2)
    return target, ds, cache, d


def _identity(target, ds, layers=LAYERS):
    return FeatureIdentity(target=target_fingerprint(target), layers=layers, data=dataset_hash(ds), seq_len=SEQ,
                           pad_id=PAD_ID)


def test_cache_holds_the_target_outputs_in_bf16(tiny):
    target, ds, cache, _ = tiny
    assert len(cache) == 5 and cache.num_shards == 3
    tokens = np.zeros((1, SEQ), np.int32)
    rec = ds[4]["tokens"][:SEQ]
    tokens[0, :len(rec)] = rec
    valid = np.arange(SEQ)[None] < len(rec)
    out = target(tokens, valid=valid, feature_layers=LAYERS, return_logits=False)
    row = cache[4]
    assert row["features"].shape == (SEQ, 2, 32) and row["hidden"].shape == (SEQ, 32)
    assert row["features"].dtype.name == "bfloat16"
    np.testing.assert_allclose(row["features"].astype(np.float32), np.asarray(out.features[0]), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(row["hidden"].astype(np.float32), np.asarray(out.hidden[0]), rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------- (a) the training step


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    d = tmp_path_factory.mktemp("micro")
    ds = _write(d / "train", 4, 1, 500)
    cfg = from_cli(["micro", f"data.path={d / 'train'}", f"train.output_dir={d / 'out'}", f"data.seq_len={SEQ}",
                    "data.num_anchors=4", "train.batch_size=4", "train.anchor_chunk=4",
                    "target.model.num_layers=3", "drafter.target_layer_ids=[0,1]", "drafter.num_target_features=2"])
    target = prepare_target(cfg)
    trainer = Trainer(cfg, target.model, ds, None, progress=False)
    cache = ensure_features(target.model, ds, d / "cache", layers=trainer.dcfg.target_layer_ids, seq_len=SEQ,
                            pad_id=PAD_ID, progress=False)
    yield trainer, ds, cache
    trainer.close()


def test_cached_step_equals_online_step(micro):
    tr, ds, cache = micro
    tc = tr.cfg.train
    loss_fn = make_loss_fn(tr.d_graphdef, tr.t_graphdef, registry.get_kind("dspark"),
                           LossCoefs(tc.loss_ce, tc.loss_l1, tc.loss_conf, tc.loss_decay), tc.anchor_chunk)
    grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    cached = next(iter(heldout_batches(ds, tr.spec, 4, features=cache)))
    online = {k: v for k, v in cached.items() if k not in ("features", "hidden")}
    (l_on, _), g_on = grad(tr.state.params, tr.frozen, tr.t_state, online)
    (l_c, _), g_c = grad(tr.state.params, tr.frozen, tr.t_state, cached)
    g_on, g_c = jax.tree.leaves(g_on), jax.tree.leaves(g_c)

    def rel(a, b):
        return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / max(np.linalg.norm(np.asarray(a)), 1e-12))

    assert rel(l_on, l_c) < 5e-3, (float(l_on), float(l_c))  # bf16 keeps 8 bits: 2^-8 per feature
    worst = max(rel(a, b) for a, b in zip(g_on, g_c))
    assert worst < 3e-2, worst
    # a cache read for the wrong records (rows shifted by one), or with its layers in the wrong
    # order, is far outside that tolerance
    shifted = dict(cached, features=np.roll(cached["features"], 1, axis=0), hidden=np.roll(cached["hidden"], 1, axis=0))
    swapped = dict(cached, features=cached["features"][:, :, ::-1])
    for wrong in (shifted, swapped):
        (l_w, _), g_w = grad(tr.state.params, tr.frozen, tr.t_state, wrong)
        assert rel(l_on, l_w) > 10 * rel(l_on, l_c) and max(rel(a, b) for a, b in zip(g_on, jax.tree.leaves(g_w))) > 0.1


def test_kinds_reading_logits_and_bad_config_values_are_refused():
    with pytest.raises(ConfigError, match="eagle3.*logits.*data.features=online"):
        require_cacheable(registry.get_kind("eagle3"))
    require_cacheable(registry.get_kind("mtp1"))  # reads the hidden state only
    with pytest.raises(ValueError, match="'online'.*'cache'.*'disk'"):
        DataSection(features="disk")
    with pytest.raises(ConfigError, match="'online'.*'cache'"):
        from_cli(["micro", "data.features=offline"])
    assert from_cli(["micro", "data.features=cache"]).data.features == "cache"


# ---------------------------------------------------------------- (b) another target, layer set, dataset


def test_cache_of_another_target_layer_set_or_dataset_is_refused(tiny, tmp_path):
    target, ds, cache, d = tiny
    other_target = tiny_target(tiny_config(vocab_size=16, hidden_size=32), seed=5)
    other_ds = _write(tmp_path / "other", 5, 9, 16)
    fix = "data.features_path.*delete"
    with pytest.raises(FeatureCacheError, match=f"another target.*{fix}"):
        ensure_features(other_target, ds, cache.path, layers=LAYERS, seq_len=SEQ, pad_id=PAD_ID, progress=False)
    with pytest.raises(FeatureCacheError, match=r"another feature layer set \(\[0, 1\], the drafter reads \[1\]\)"):
        FeatureCache(cache.path, _identity(target, ds, layers=(1,)))
    with pytest.raises(FeatureCacheError, match=f"other data.*{fix}"):
        ensure_features(target, other_ds, cache.path, layers=LAYERS, seq_len=SEQ, pad_id=PAD_ID, progress=False)
    with pytest.raises(FeatureCacheError, match="not a feature cache"):  # a directory of something else
        (tmp_path / "busy").mkdir()
        (tmp_path / "busy" / "notes.txt").write_text("mine")
        ensure_features(target, ds, tmp_path / "busy", layers=LAYERS, seq_len=SEQ, pad_id=PAD_ID, progress=False)
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    FeatureCache(cache.path, _identity(target, ds))  # the cache itself is untouched


# ---------------------------------------------------------------- (c) damage and resume


def test_interrupted_write_resumes_after_the_last_complete_shard(tiny, tmp_path):
    target, ds, cache, _ = tiny
    ident = _identity(target, ds)

    def stop_after_first(k):
        if k == 0:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_features(target, ds, tmp_path, ident, shard_records=2, batch_size=2, progress=False,
                       on_shard=stop_after_first)
    with pytest.raises(FeatureCacheError, match="incomplete.*1 of 3|incomplete.*2 of 3"):
        FeatureCache(tmp_path, ident)
    first = (tmp_path / "shard-00000.npy").stat().st_mtime_ns
    stats = write_features(target, ds, tmp_path, ident, shard_records=2, batch_size=2, progress=False)
    assert stats == {"written": [1, 2], "skipped": [0]}
    assert (tmp_path / "shard-00000.npy").stat().st_mtime_ns == first
    resumed = FeatureCache(tmp_path, ident)
    for i in range(len(ds)):
        np.testing.assert_array_equal(resumed[i]["features"], cache[i]["features"])
        np.testing.assert_array_equal(resumed[i]["hidden"], cache[i]["hidden"])
    assert write_features(target, ds, tmp_path, ident, shard_records=2, progress=False)["written"] == []


def test_truncated_or_missing_shard_is_refused_not_rewritten(tiny, tmp_path):
    target, ds, _, _ = tiny
    ident = _identity(target, ds)
    write_features(target, ds, tmp_path, ident, shard_records=2, batch_size=2, progress=False)
    shard = tmp_path / "shard-00001.npy"
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size - 10)
    size = shard.stat().st_size
    for attempt in (lambda: FeatureCache(tmp_path, ident),
                    lambda: write_features(target, ds, tmp_path, ident, progress=False)):
        with pytest.raises(FeatureCacheError, match="shard-00001.npy is truncated.*delete"):
            attempt()
    assert shard.stat().st_size == size  # left as it was
    os.remove(tmp_path / "shard-00002.npy")
    shard.unlink()
    with pytest.raises(FeatureCacheError, match="shard-00001.npy is missing"):
        FeatureCache(tmp_path, ident)


# ---------------------------------------------------------------- (d) the pipeline's rows


def test_pipeline_rows_with_cache_under_two_hosts(tiny):
    target, ds, cache, _ = tiny
    spec = RecordSpec(seq_len=SEQ, num_anchors=4, gamma=2, pad_id=PAD_ID, seed=3)
    index = {}
    for i in range(len(ds)):
        tokens = np.full(SEQ, PAD_ID, np.int32)
        rec = ds[i]["tokens"][:SEQ]
        tokens[:len(rec)] = rec
        index[tokens.tobytes()] = i
    for host in (0, 1):
        args = dict(shuffle=True, num_epochs=2, process_index=host, process_count=2)
        plain = list(make_pipeline(ds, spec, 2, **args))
        it = iter(make_pipeline(ds, spec, 2, features=cache, **args))
        first = next(it)
        state = it.get_state()
        rest = list(it)
        assert len(plain) == 1 + len(rest) >= 2
        for a, b in zip(plain, [first, *rest]):
            assert set(b) == set(a) | {"features", "hidden"}
            for k in a:
                np.testing.assert_array_equal(a[k], b[k], err_msg=k)
            for r, tokens in enumerate(b["tokens"]):
                i = index[tokens.tobytes()]
                np.testing.assert_array_equal(b["features"][r], cache[i]["features"])
                np.testing.assert_array_equal(b["hidden"][r], cache[i]["hidden"])
        again = iter(make_pipeline(ds, spec, 2, features=cache, **args))
        again.set_state(state)  # the checkpointed iterator resumes with the same rows and arrays
        np.testing.assert_array_equal(next(again)["features"], rest[0]["features"])
        held = list(heldout_batches(ds, spec, 2, process_index=host, process_count=2, features=cache))
        mine = list(range(host, len(ds), 2))
        rows = np.concatenate([b["features"] for b in held])
        for r, i in enumerate(mine):
            np.testing.assert_array_equal(rows[r], cache[i]["features"])
        assert not rows[len(mine):].astype(np.float32).any()  # padding rows: zeros
    with pytest.raises(ValueError, match="holds 5 records but the dataset has 4"):
        make_pipeline(_Prefix(ds, 4), spec, 2, features=cache)


class _Prefix:
    def __init__(self, ds, n):
        self.ds, self.n = ds, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.ds[i]


# ---------------------------------------------------------------- the run, end to end


def test_features_command_then_a_training_run_that_reads_the_cache(tmp_path, capsys):
    """The wiring: `python -m dspark_jax features` makes the cache beside the dataset on the
    config's mesh; a run with `data.features=cache` finds it complete and trains from it (the
    step's equality with the online step is test_cached_step_equals_online_step)."""
    import json

    from dspark_jax.commands.features import main as features_main
    from dspark_jax.train.run import run

    _write(tmp_path / "train", 8, 2, 500)
    out = tmp_path / "out"
    args = ["micro", f"data.path={tmp_path / 'train'}", f"train.output_dir={out}", f"data.seq_len={SEQ}",
            "data.num_anchors=4", "train.batch_size=4", "train.steps=2", "train.anchor_chunk=4",
            "train.eval_every=0", "train.log_every=1", "train.measure_prompts=0", "train.checkpoint_every=0"]
    assert features_main([*args, "--no-progress"]) == 0
    assert "(8 records, 1 shards)" in capsys.readouterr().out
    meta_file = tmp_path / "train" / "features" / "meta.json"
    meta = json.loads(meta_file.read_text())
    assert meta["done"] == [0] and meta["identity"]["layers"] == [0] and meta["identity"]["seq_len"] == SEQ
    written = (tmp_path / "train" / "features" / "shard-00000.npy").stat().st_mtime_ns
    summary = run(from_cli([*args, "data.features=cache"]), progress=False)
    assert summary["step"] == 2 and "features" in summary["phases_s"]
    assert (tmp_path / "train" / "features" / "shard-00000.npy").stat().st_mtime_ns == written  # read, not redone
    losses = [json.loads(x)["loss"] for x in (out / "log.jsonl").read_text().splitlines() if '"loss"' in x]
    assert len(losses) == 2 and all(np.isfinite(losses))
