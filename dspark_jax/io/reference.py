"""Convert drafters between DeepSpec's checkpoint layout (docs/method.md §8) and ours.

    python -m dspark_jax convert import REF_DIR OUT_DIR --target TARGET_DIR
    python -m dspark_jax convert export OUR_DIR REF_DIR --target TARGET_DIR [--dtype bfloat16] [--num-anchors N]

Reference layout: Hugging Face `save_pretrained` of `Qwen3DSparkModel` (config.json +
safetensors, keys without a `model.` prefix, torch Linear weights (out, in)). Ours: a
directory with `drafter.safetensors` + `drafter_config.json` (dspark_jax.drafter.model).
The target checkpoint is needed both ways: import checks the drafter against it (widths,
vocabulary, layer ids, the embedding / LM head the drafter carries) and export writes its
embedding / LM head, which the reference layout holds.

Export writes bfloat16 tensors by default (what DeepSpec trains and ships; `--dtype
float32` keeps our float32 master weights) and a config.json that vLLM's and SGLang's
DSpark loaders read without falling back to a default: `ENGINE_FIELDS` below lists each
field, what we write and where each engine reads it. `num_anchors` is the training run's
`data.num_anchors`, recorded in drafter_config.json by training (`recorded_num_anchors`), or `--num-anchors`.

A reference confidence head without the Markov input (`confidence_head_with_markov`
false while markov_rank > 0) is imported with zero weights on the W1[x] part: the same
function; it is then exported with the Markov input.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from dspark_jax.config import DrafterSection
from dspark_jax.drafter import registry
from dspark_jax.drafter.frozen import trainable_state
from dspark_jax.drafter.kinds.block import DFLASH, DSPARK
from dspark_jax.drafter.model import (
    HEAD_TYPES,
    Drafter,
    DrafterConfigError,
    validate_layer_ids,
)
from dspark_jax.io import drafter_dir as drafter_io
from dspark_jax.io import safetensors_io
from dspark_jax.io.hf import decoder_layer_rules, load_target, read_weights
from dspark_jax.io.keymap import (
    CheckpointMismatchError,
    KeyRule,
    export_tensors,
    import_tensors,
)
from dspark_jax.parallel.sharding import host_arrays
from dspark_jax.target.config import ModelConfig

ARCHITECTURE = "Qwen3DSparkModel"
REF_WEIGHTS = "model.safetensors"

REFERENCE_KEY_TABLE = [
    KeyRule(r"embed_tokens\.weight", "embed"),
    *decoder_layer_rules(""),
    KeyRule(r"norm\.weight", "final_norm"),
    KeyRule(r"fc\.weight", "fc", transpose=True),  # torch (H, m*H): column block i = layer id i
    KeyRule(r"hidden_norm\.weight", "hidden_norm"),
    KeyRule(r"lm_head\.weight", "lm_head", transpose=True),
    KeyRule(r"markov_head\.markov_w1\.weight", "markov_w1"),  # nn.Embedding (V, r)
    KeyRule(r"markov_head\.markov_w2\.weight", "markov_w2", transpose=True),  # nn.Linear (V, r)
    KeyRule(r"markov_head\.gate_proj\.weight", "gate_kernel", transpose=True),  # input [h; W1[x]]
    KeyRule(r"markov_head\.gate_proj\.bias", "gate_bias"),
    # input [s; W1[x]; h], out gate|cand|out
    KeyRule(r"markov_head\.joint_proj\.weight", "joint_kernel", transpose=True),
    KeyRule(r"markov_head\.joint_proj\.bias", "joint_bias"),
    KeyRule(r"confidence_head\.proj\.weight", "conf_kernel", transpose=True),  # input [h; W1[x]]
    KeyRule(r"confidence_head\.proj\.bias", "conf_bias"),
]
IGNORED_KEYS = (r".*rotary_emb\.inv_freq",)
# Width fields that must equal the target's (the drafter shares its embedding and LM head).
_WIDTH_FIELDS = ("vocab_size", "hidden_size", "intermediate_size",
                 "num_heads", "num_kv_heads", "head_dim", "rms_norm_eps")


# Block layout of our DSpark and DFlash drafters, for the engines' `sample_from_anchor` flag.
# The block is [x_p, MASK, ..., MASK] at positions p..p+gamma-1 and slot j is trained on the
# label x_{p+j+1} (docs/method.md §2.1 and §4): the first draft token comes from the
# drafter's own output at the anchor slot (slot 0), not from the target's logits at the
# anchor position, and every one of the gamma slots is a draft token. That is the anchor-first
# layout, `sample_from_anchor: true`. `false` is the DFlash fill-in layout: 1 + gamma query
# slots where the anchor slot is the bonus token and only the mask slots predict. Readers
# disagree on the default when the key is missing (vLLM's and SGLang's DSpark paths and
# speculators' DSpark config: true; speculators' DFlash config and llama.cpp's reader of
# speculators checkpoints, PR 26275: false), and a wrong guess serves at ~1 % acceptance with no
# error (vLLM issue 56792: a fill-in drafter whose config lacked the key, served anchor-first
# at 0.9 %; the key comes from speculators PR 760, read by vLLM since PR 48639). So we write it.
SAMPLE_FROM_ANCHOR = True


class EngineField(NamedTuple):
    name: str
    ours: str  # what export writes
    vllm: str  # where vLLM reads it (repository vllm-project/vllm)
    sglang: str  # where SGLang reads it (repository sgl-project/sglang)


_V_SPEC = "vllm/config/speculative.py"
_V_DSPARK = "vllm/v1/worker/gpu/spec_decode/dspark/speculator.py"
_V_MODEL = "vllm/model_executor/models/qwen3_dspark.py"
_V_DFLASH = "vllm/model_executor/models/qwen3_dflash.py (DFlashQwen3Model, the backbone Qwen3DSparkModel subclasses)"
_V_AUX = "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py get_eagle3_aux_layers_from_config"
_V_MASK = "vllm/v1/worker/gpu/spec_decode/utils.py get_parallel_drafting_token_id"
_S_MODEL = "python/sglang/srt/models/qwen3_dspark.py (Qwen3DSparkBackbone)"
_S_CFG = "python/sglang/srt/speculative/dspark_components/dspark_config.py parse_dspark_draft_config"
_S_DFLASH = "python/sglang/srt/speculative/dflash_utils.py parse_dflash_draft_config"
_S_LAYER = "python/sglang/srt/models/dflash.py DFlashDecoderLayer (the layer it subclasses; not read in detail)"

# Every field vLLM's and SGLang's DSpark loaders read from the drafter's config.json, read in
# the stored snapshots of those repositories (2026-08/09; public code, read, not copied).
# "-" : that engine was not found reading the field. Fields only the speculators format has
# (speculators_config, transformer_layer_config, aux_hidden_state_layer_ids) are deliberately
# absent: loaders pick the speculators code path when `speculators_config` /
# `speculators_model_type` is present (vLLM's speculators algos.update_dspark rewrites the
# config; SGLang's parse_dspark_draft_config flags `speculators_convention`), and that format
# names layers with +1 ids and nests the Qwen3 fields; this export is DeepSpec's layout only.
ENGINE_FIELDS: tuple[EngineField, ...] = (
    EngineField("architectures", '["Qwen3DSparkModel"]',
                f"{_V_SPEC}: selects method 'dspark' and the Qwen3DSparkForCausalLM class",
                "python/sglang/srt/models/qwen3_dspark.py: EntryClass name == architectures[0]"),
    EngineField("sample_from_anchor", "true (SAMPLE_FROM_ANCHOR, every kind that exports)",
                f"{_V_DSPARK}: getattr(hf_config, 'sample_from_anchor', True): "
                "gamma query slots if true, 1+gamma if false",
                "dspark_components/dspark_config.py get_dspark_sample_from_anchor (top-level key, default true; "
                "PR 36186, not in the stored snapshot); also dflash_utils.py is_nemotron_35_draft_config"),
    EngineField("block_size", "gamma (draft tokens per round)",
                "- (the Qwen3 path takes num_speculative_tokens from the command line; only the "
                "Qwen3-Omni check in vllm/config/speculative.py reads block_size)",
                f"{_S_MODEL} (required > 0); {_S_DFLASH} -> gamma in dspark_config.resolve_runtime_config"),
    EngineField("target_layer_ids", "our layer ids (output of decoder layer i = HF hidden_states[i+1])",
                f"{_V_AUX}: top-level target_layer_ids, +1 (used only when eagle_aux_hidden_state_layer_ids, "
                "dflash_config.target_layer_ids and dspark_target_layer_ids are all absent: we write none of them)",
                f"{_S_MODEL} (required); {_S_DFLASH} (top-level when no dflash_config)"),
    EngineField("num_target_layers", "the target's layer count", "-",
                f"{_S_DFLASH} (validated >= 1)"),
    EngineField("mask_token_id", "the drafter's mask token id",
                f"{_V_MASK} (top-level when no dflash_config); {_V_DFLASH}",
                f"{_S_MODEL} (required); {_S_CFG}"),
    EngineField("markov_rank", "r (0 = no Markov head)",
                f"{_V_MODEL}: DSparkMarkovHead(vocab, draft_vocab, markov_rank), built unconditionally",
                f"{_S_CFG}: DSPARK needs > 0; {_S_MODEL}: head built iff > 0"),
    EngineField("markov_head_type", "vanilla | gated | rnn (written when markov_rank > 0)",
                "- (qwen3_dspark.py builds the vanilla head only)",
                f"{_S_CFG}: required when markov_rank > 0; qwen3_dspark.py loads vanilla tensors only"),
    EngineField("enable_confidence_head", "whether the drafter has the confidence head",
                f"{_V_MODEL} (default false)", f"{_S_MODEL} (default false)"),
    EngineField("confidence_head_with_markov", "true when markov_rank > 0 (written when the head exists)",
                f"{_V_MODEL} (default false: input width H instead of H + r)",
                f"{_S_MODEL}: must be true when the confidence head is on"),
    EngineField("draft_vocab_size", "vocab_size (full vocabulary, no d2t map)",
                f"{_V_MODEL} (default vocab_size; smaller needs a d2t tensor)", "-"),
    EngineField("vocab_size", "the target's", f"{_V_DFLASH}; {_V_MODEL}", f"{_S_MODEL}"),
    EngineField("hidden_size", "the target's", f"{_V_DFLASH}", f"{_S_MODEL}"),
    EngineField("num_hidden_layers", "drafter layers", f"{_V_DFLASH}", f"{_S_MODEL} (required); {_S_DFLASH}"),
    EngineField("head_dim", "the target's", f"{_V_DFLASH} (else hidden_size // heads)", f"{_S_MODEL} (required)"),
    EngineField("num_attention_heads", "the target's", f"{_V_DFLASH}", _S_LAYER),
    EngineField("num_key_value_heads", "the target's", f"{_V_DFLASH}", _S_LAYER),
    EngineField("intermediate_size", "the target's", f"{_V_DFLASH}", _S_LAYER),
    EngineField("hidden_act", "silu", f"{_V_DFLASH}", _S_LAYER),
    EngineField("rms_norm_eps", "the target's", f"{_V_DFLASH}", f"{_S_MODEL}"),
    EngineField("rope_parameters", "the target's RoPE (also rope_theta)", f"{_V_DFLASH}: config.rope_parameters",
                _S_LAYER),
    EngineField("max_position_embeddings", "the target's", f"{_V_DFLASH}", "-"),
    EngineField("attention_bias", "false", f"{_V_DFLASH} (default false)", "-"),
    EngineField("layer_types", "all full_attention, or all sliding_attention with a window",
                f"{_V_DFLASH}: sliding layers default to causal unless is_causal is set",
                "python/sglang/srt/speculative/dflash_utils.py get_dflash_layer_types"),
    EngineField("sliding_window", "the drafter's window or null",
                f"{_V_DFLASH} (when a layer is sliding)",
                "dflash_utils.py get_dflash_attention_sliding_window_size (HF window includes the query token)"),
    EngineField("is_causal", "false (the block attends to itself bidirectionally)",
                f"{_V_DFLASH} _dflash_layer_causal: overrides the per-layer default", "-"),
    EngineField("is_neox_style", "true (rotate-half RoPE, as the HF Qwen3 target)",
                f"{_V_DFLASH} (default true; a mismatch is silent)", "-"),
    EngineField("tie_word_embeddings", "false (the checkpoint ships embed_tokens and lm_head)",
                "- (vllm/v1/worker/gpu/spec_decode/dspark/utils.py shares the target's when the vocabularies match)",
                f"{_S_MODEL} docstring: the checkpoint ships both"),
    EngineField("dtype", "bfloat16 by default (also written as torch_dtype)",
                "the draft ModelConfig takes the target's dtype (vllm/config/speculative.py); "
                "the value documents the file",
                "-"),
    EngineField("num_anchors", "the run's data.num_anchors (recorded_num_anchors) or --num-anchors",
                "- (training-only; DeepSpec deepspec/modeling/dspark/qwen3/config.py "
                "build_draft_config writes it)", "-"),
)


class ConversionError(ValueError):
    pass


def _target_model(target, mesh=None):
    if isinstance(target, (str, Path)):
        # as stored (bf16 halves the memory); on a mesh each chip holds its share
        return load_target(target, dtype="auto", load_tokenizer=False, mesh=mesh).model
    return target if hasattr(target, "lm_head_weight") else target.model


# ---------------------------------------------------------------------------- config


def reference_config(drafter: Drafter, num_anchors: int, dtype: str = "bfloat16") -> dict:
    """config.json of the reference layout for `drafter`: DeepSpec's fields plus every field
    vLLM's and SGLang's DSpark loaders read (ENGINE_FIELDS)."""
    d = drafter.dcfg
    r = d.markov_rank
    sliding = d.sliding_window is not None
    hf = drafter.cfg.to_hf(torch_dtype=dtype, dtype=dtype)
    hf.update(
        architectures=[ARCHITECTURE],
        model_type="qwen3",
        num_hidden_layers=d.num_layers,
        layer_types=["sliding_attention" if sliding else "full_attention"] * d.num_layers,
        sliding_window=d.sliding_window,
        use_sliding_window=sliding,
        tie_word_embeddings=False,
        block_size=d.gamma,
        mask_token_id=d.mask_token_id,
        target_layer_ids=list(d.target_layer_ids),
        num_target_layers=drafter.target_cfg.num_layers,
        num_anchors=int(num_anchors),
        markov_rank=r,
        enable_confidence_head=bool(d.confidence_head),
        sample_from_anchor=SAMPLE_FROM_ANCHOR,
        draft_vocab_size=drafter.cfg.vocab_size,
        is_causal=False,  # the block sees all its slots (vLLM otherwise makes sliding layers causal)
        is_neox_style=True,  # rotate-half RoPE (dspark_jax.target.layers.apply_rope)
    )
    if r:
        hf["markov_head_type"] = d.head_type
    if d.confidence_head:
        hf["confidence_head_with_markov"] = bool(r)
    return hf


def engine_notes(dcfg) -> list[str]:
    """What vLLM / SGLang will not serve correctly in an export of `dcfg` (ENGINE_FIELDS sources)."""
    notes = []
    if not dcfg.markov_rank:
        notes.append("markov_rank 0 (DFlash): SGLang's DSPARK worker requires markov_rank > 0 and the vLLM / SGLang "
                     "DFlash paths use the 1+gamma fill-in layout (vLLM's DFlash speculator fixes "
                     "sample_from_anchor false); no engine path for an anchor-first DFlash drafter was established")
    elif dcfg.head_type != "vanilla":
        notes.append(f"markov_head_type '{dcfg.head_type}': vLLM's and SGLang's Qwen3 DSpark models build only the "
                     "vanilla Markov head; this export loads in DeepSpec and dspark_jax, not in those engines")
    if dcfg.confidence_head and not dcfg.markov_rank:
        notes.append("a confidence head without a Markov head: SGLang's Qwen3DSparkModel refuses it")
    if dcfg.sliding_window is not None:
        notes.append(f"sliding_window {dcfg.sliding_window}: our window covers the {dcfg.sliding_window} context "
                     "positions before the anchor; the engines' HF-style windows count back from each query, "
                     "so attention may differ from training")
    return notes


def parse_reference_config(hf: dict, target_cfg: ModelConfig,
                           source: str = "config.json") -> tuple[DrafterSection, bool]:
    """Reference config.json -> (our resolved DrafterSection, confidence_head_with_markov).

    Every problem found is reported in one ConversionError.
    """
    problems = []
    archs = hf.get("architectures") or []
    if ARCHITECTURE not in archs:
        raise ConversionError(f"{source}: architectures {archs} is not ['{ARCHITECTURE}']: "
                              "not a DeepSpec DSpark/DFlash drafter checkpoint")
    try:
        width = ModelConfig.from_hf({**hf, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"})
    except (KeyError, ValueError) as e:
        raise ConversionError(f"{source}: cannot read the Qwen3 fields ({e!r})") from e
    for f in _WIDTH_FIELDS:
        a, b = getattr(width, f), getattr(target_cfg, f)
        if a != b:
            problems.append(f"{f} is {a} in the drafter but {b} in the target")
    if (width.rope.theta, width.rope.type) != (target_cfg.rope.theta, target_cfg.rope.type):
        problems.append(f"RoPE (theta {width.rope.theta}, {width.rope.type}) differs from the target's "
                        f"(theta {target_cfg.rope.theta}, {target_cfg.rope.type})")
    L = target_cfg.num_layers
    if "num_target_layers" in hf and int(hf["num_target_layers"]) != L:
        problems.append(f"num_target_layers is {hf['num_target_layers']} but the target has {L} layers")
    ids = hf.get("target_layer_ids")
    if not ids:
        problems.append("target_layer_ids is missing")
    elif any(int(i) == -1 for i in ids):
        problems.append(f"target_layer_ids {ids} uses -1 (the embedding output), which dspark_jax does not support")
    else:
        try:
            ids = validate_layer_ids(ids, L)
        except DrafterConfigError as e:
            problems.append(str(e))
    r = int(hf.get("markov_rank", 0))
    head = str(hf.get("markov_head_type", "vanilla")).lower() if r else "vanilla"
    if r < 0:
        problems.append(f"markov_rank must be >= 0, got {r}")
    if r and head not in HEAD_TYPES:
        problems.append(f"unknown markov_head_type '{hf.get('markov_head_type')}' (supported: {', '.join(HEAD_TYPES)})")
    mask = hf.get("mask_token_id")
    V = target_cfg.vocab_size
    if mask is None or not 0 <= int(mask) < V:
        problems.append(f"mask_token_id {mask} is outside the target vocabulary (0..{V - 1})")
    gamma = hf.get("block_size")
    if gamma is None or int(gamma) < 1:
        problems.append(f"block_size must be >= 1 (draft tokens per round), got {gamma}")
    n_layers = int(hf.get("num_hidden_layers", 0))
    if n_layers < 1:
        problems.append(f"num_hidden_layers must be >= 1, got {n_layers}")
    types = set(hf.get("layer_types") or ["full_attention"])
    window = None
    if types == {"sliding_attention"}:
        window = hf.get("sliding_window")
    elif types != {"full_attention"}:
        problems.append(f"layer_types {sorted(types)}: "
                        "only all full_attention or all sliding_attention layers are supported")
    if problems:
        raise ConversionError(f"{source} does not fit the target:\n  " + "\n  ".join(problems))
    conf = bool(hf.get("enable_confidence_head", False))
    with_markov = bool(hf.get("confidence_head_with_markov", bool(r))) if conf else False
    kind = (DSPARK if (r or conf) else DFLASH).name
    dcfg = DrafterSection(kind=kind, num_layers=n_layers, gamma=int(gamma), target_layer_ids=tuple(ids),
                          num_target_features=len(ids), markov_rank=r, head_type=head, confidence_head=conf,
                          mask_token_id=int(mask), sliding_window=window)
    return registry.resolve(target_cfg, dcfg), with_markov and bool(r)


def _expected(target_cfg: ModelConfig, dcfg: DrafterSection, conf_with_markov: bool) -> dict[str, tuple]:
    shapes = drafter_io.param_shapes(target_cfg, dcfg)
    H, V = target_cfg.hidden_size, target_cfg.vocab_size
    if dcfg.confidence_head and dcfg.markov_rank and not conf_with_markov:
        shapes["conf_kernel"] = (H, 1)
    return {"embed": (V, H), "lm_head": (H, V), **shapes}


# ---------------------------------------------------------------------------- import / export


def _check_same(name: str, ref: np.ndarray, ours: np.ndarray):
    """The drafter's embedding / LM head must be the target's (up to bfloat16 rounding)."""
    a, b = np.asarray(ref, np.float32), np.asarray(ours, np.float32)
    if not np.allclose(a, b, rtol=2.0**-7, atol=1e-6):
        diff = float(np.max(np.abs(a - b)))
        raise ConversionError(
            f"{name} differs from the target's (max abs difference {diff:.3g}): this drafter was trained for a "
            "different target; pass the target checkpoint it was trained with (--target)"
        )


def read_reference(ref_dir: str | Path, target, param_dtype=jnp.float32, mesh=None) -> Drafter:
    """Load a DeepSpec drafter directory into our Drafter, attached to `target`."""
    ref_dir = Path(ref_dir)
    tmodel = _target_model(target, mesh)
    cfg_file = ref_dir / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"'{ref_dir}' has no config.json: "
                                "pass a DeepSpec drafter directory (config.json + model.safetensors)")
    hf = json.loads(cfg_file.read_text())
    dcfg, with_markov = parse_reference_config(hf, tmodel.cfg, str(cfg_file))

    tensors = read_weights(ref_dir)
    expected = _expected(tmodel.cfg, dcfg, with_markov)
    try:
        pure = import_tensors(tensors, REFERENCE_KEY_TABLE, expected, dcfg.num_layers,
                              source=str(ref_dir), ignore=IGNORED_KEYS)
    except CheckpointMismatchError as e:
        raise ConversionError(str(e)) from None
    _check_same("embed_tokens.weight", pure.pop("embed"), np.asarray(tmodel.embed[...]))
    _check_same("lm_head.weight", pure.pop("lm_head"), np.asarray(tmodel.lm_head_weight()))
    if "conf_kernel" in pure and pure["conf_kernel"].shape[0] == tmodel.cfg.hidden_size and dcfg.markov_rank:
        k = pure["conf_kernel"]
        pure["conf_kernel"] = np.concatenate([k, np.zeros((dcfg.markov_rank, 1), k.dtype)], axis=0)
    return drafter_io.from_params(tmodel, dcfg, pure, param_dtype=param_dtype, mesh=mesh, source=str(ref_dir))


def reference_tensors(drafter: Drafter, dtype: str = "bfloat16") -> dict[str, np.ndarray]:
    """Our drafter -> the reference layout's tensors (incl. embed_tokens / lm_head)."""
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    # arrays spread over several processes (a multi-host run's drafter) are gathered: a collective
    pure = host_arrays({**nnx.to_pure_dict(trainable_state(drafter)), "embed": drafter.embed[...],
                        "lm_head": drafter.lm_head[...]})
    pure = jax.tree.map(lambda a: a.astype(np_dtype), pure)
    return export_tensors(pure, REFERENCE_KEY_TABLE, drafter.dcfg.num_layers)


def write_reference(drafter: Drafter, ref_dir: str | Path, dtype: str, num_anchors: int, write: bool = True) -> None:
    """Write the reference layout. Every process of a multi-host run calls it (gathering the tensors
    is a collective); only those with ``write`` write."""
    tensors = reference_tensors(drafter, dtype)
    if not write:
        return
    ref_dir = Path(ref_dir)
    ref_dir.mkdir(parents=True, exist_ok=True)
    safetensors_io.save_file(tensors, ref_dir / REF_WEIGHTS, metadata={"format": "pt"})
    (ref_dir / "config.json").write_text(json.dumps(reference_config(drafter, num_anchors, dtype), indent=2))


def import_reference(ref_dir, out_dir, target, mesh=None) -> Drafter:
    drafter = read_reference(ref_dir, target, mesh=mesh)
    hf = json.loads((Path(ref_dir) / "config.json").read_text())
    # keep the run's num_anchors, so an export of the imported drafter writes it back
    training = {"num_anchors": int(hf["num_anchors"])} if isinstance(hf.get("num_anchors"), int) else None
    drafter_io.save(drafter, out_dir, training=training)
    return drafter


def recorded_num_anchors(our_dir) -> int:
    """data.num_anchors of the run that trained the drafter in `our_dir` (`training.num_anchors` in
    its drafter_config.json, which training writes); ConversionError when it records none."""
    n = drafter_io.read_training(our_dir).get("num_anchors")
    if not isinstance(n, int):
        raise ConversionError(f"{Path(our_dir) / drafter_io.CONFIG_FILE} records no training num_anchors "
                              "(training.num_anchors): pass --num-anchors N, the run's data.num_anchors")
    return n


def export_reference(our_dir, ref_dir, target, dtype: str = "bfloat16", num_anchors: int | None = None,
                     mesh=None, log=None) -> Drafter:
    """Write `our_dir`'s drafter in the reference layout. `num_anchors` None: the run's
    recorded value (`recorded_num_anchors`)."""
    log = log or logging.getLogger(__name__).info
    dcfg, _ = drafter_io.read_config(our_dir)
    kind = registry.get_kind(dcfg.kind)
    if not kind.has_reference_layout:
        raise ConversionError(f"{our_dir} holds a {kind.name} drafter, which has no DeepSpec reference layout; "
                              f"only {', '.join(k for k, a in registry.KINDS.items() if a.has_reference_layout)} "
                              f"drafters export: {kind.reference_refusal}")
    if num_anchors is None:
        num_anchors = recorded_num_anchors(our_dir)
        log(f"num_anchors {num_anchors} (read from {Path(our_dir) / drafter_io.CONFIG_FILE})")
    drafter = drafter_io.load(our_dir, _target_model(target, mesh), mesh=mesh)
    for note in engine_notes(drafter.dcfg):
        log(f"note: {note}")
    write_reference(drafter, ref_dir, dtype, num_anchors)
    return drafter
