"""The DSpark drafter: parallel backbone over fused target features + sequential heads.

- frozen.py: the Frozen variable type for the target's embedding / LM head, attach_target,
  target fingerprints, trainable (checkpointed) state.
- backbone.py: context fusion, training forward over all anchor blocks, inference
  context cache (update_context / draft_hidden). Pure functions.
- heads.py: Markov / gated / RNN bias, teacher-forced (training) and sampled (inference,
  one lax.scan). confidence.py: confidence logits and the soft label.
- model.py: the Drafter NNX module, config resolution, save_drafter / load_drafter.
- eagle3.py, mtp.py: the baseline drafters (spec 6), sharing frozen.py.
"""

from dspark_jax.drafter.confidence import confidence_logits, soft_label
from dspark_jax.drafter.frozen import (
    Frozen, TargetMismatchError, attach_target, check_target, drafter_checkpoint_state, target_fingerprint,
    trainable_state,
)
from dspark_jax.drafter.heads import head_bias_train, sample_block
from dspark_jax.drafter.model import (
    Drafter, DrafterConfigError, build_drafter, default_layer_ids, load_drafter, resolve_config, resolve_layer_ids,
    save_drafter,
)

__all__ = [
    "Frozen", "TargetMismatchError", "attach_target", "check_target", "drafter_checkpoint_state",
    "target_fingerprint", "trainable_state", "Drafter", "DrafterConfigError", "build_drafter", "default_layer_ids",
    "load_drafter", "resolve_config", "resolve_layer_ids", "save_drafter", "head_bias_train", "sample_block",
    "confidence_logits", "soft_label",
]
