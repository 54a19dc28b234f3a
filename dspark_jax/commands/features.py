"""`python -m dspark_jax features CONFIG [section.key=value ...]`: the training set's feature cache
alone (dspark_jax/data/features.py), e.g. on a machine of its own before training reads it."""

from __future__ import annotations

import dataclasses
import sys

from dspark_jax.cli import report_user_errors

USAGE = """usage: python -m dspark_jax features [CONFIG.yaml] [section.key=value ...] [--no-progress]

Computes the frozen target's drafter inputs (the drafter's feature layers and the last hidden
state) for every record of the training set, once, in bfloat16: (m + 1) x hidden_size x 2 bytes
per token, m = the number of feature layers. Written to data.features_path (default
<data.path>/features); rerun after an interruption and it continues after the last complete
shard. Train from it with data.features=cache (which also computes it when missing).
Not for drafter kinds whose loss reads the target's logits (eagle3)."""


@report_user_errors
def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    progress = "--no-progress" not in argv
    from dspark_jax.config import from_cli
    from dspark_jax.parallel.sharding import make_mesh
    from dspark_jax.train.run import prepare_data, prepare_features, prepare_target, with_mask_token
    from dspark_jax.train.trainer import Phases

    cfg = from_cli([a for a in argv if a != "--no-progress"])
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, features="cache"))
    phases = Phases()
    mesh = make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    target = prepare_target(cfg, phases, mesh)
    cfg = with_mask_token(cfg, target)
    train_ds, _ = prepare_data(cfg, target, phases)
    cache = prepare_features(cfg, target, train_ds, phases, mesh, progress)
    print(f"feature cache: {cache.path} ({len(cache)} records, {cache.num_shards} shards)")
    return 0
