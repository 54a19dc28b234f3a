"""The drafters: the DSpark / DFlash block drafter, the Eagle3 and MTP-1 baselines, one adapter per kind.

- frozen.py: the Frozen variable type for the target's embedding / LM head, attach_target,
  target fingerprints, trainable (checkpointed) state.
- backbone.py: context fusion, training forward over all anchor blocks, inference
  context cache (update_context / draft_hidden). Pure functions.
- heads.py: Markov / gated / RNN bias, teacher-forced (training) and sampled (inference,
  one lax.scan). confidence.py: confidence logits.
- model.py: the DSpark / DFlash NNX module and its config resolution.
- eagle3.py, mtp.py: the baseline drafters (docs/method.md §6), sharing frozen.py.
- kinds/: one adapter per kind (build, loss, engine prefill / draft / update); registry.py
  registers them. Saving and loading: dspark_jax.io.drafter_dir.
"""

from dspark_jax.drafter.confidence import confidence_logits
from dspark_jax.drafter.frozen import (
    Frozen,
    TargetMismatchError,
    attach_target,
    check_target,
    drafter_checkpoint_state,
    target_fingerprint,
    trainable_state,
)
from dspark_jax.drafter.heads import head_bias_train, sample_block
from dspark_jax.drafter.model import (
    Drafter,
    DrafterConfigError,
    default_layer_ids,
    resolve_config,
    resolve_layer_ids,
)

__all__ = [
    "Frozen", "TargetMismatchError", "attach_target", "check_target", "drafter_checkpoint_state",
    "target_fingerprint", "trainable_state", "Drafter", "DrafterConfigError", "default_layer_ids",
    "resolve_config", "resolve_layer_ids", "head_bias_train", "sample_block", "confidence_logits",
]
