"""Convert drafters between DeepSpec's checkpoint layout (spec section 8) and ours.

    python -m dspark_jax.convert import REF_DIR OUT_DIR --target TARGET_DIR
    python -m dspark_jax.convert export OUR_DIR REF_DIR --target TARGET_DIR [--dtype bfloat16]

Reference layout: Hugging Face `save_pretrained` of `Qwen3DSparkModel` (config.json +
safetensors, keys without a `model.` prefix, torch Linear weights (out, in)). Ours: a
directory with `drafter.safetensors` + `drafter_config.json` (dspark_jax.drafter.model).
The target checkpoint is needed both ways: import checks the drafter against it (widths,
vocabulary, layer ids, the embedding / LM head the drafter carries) and export writes its
embedding / LM head, which the reference layout holds.

A reference confidence head without the Markov input (`confidence_head_with_markov`
false while markov_rank > 0) is imported with zero weights on the W1[x] part: the same
function; it is then exported with the Markov input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from dspark_jax.io import safetensors_io
from dspark_jax.config import DrafterSection
from dspark_jax.drafter.frozen import trainable_state
from dspark_jax.drafter import registry
from dspark_jax.drafter.kinds.block import DFLASH, DSPARK
from dspark_jax.drafter.model import HEAD_TYPES, Drafter, DrafterConfigError, validate_layer_ids
from dspark_jax.io import drafter_dir as drafter_io
from dspark_jax.io.hf import decoder_layer_rules
from dspark_jax.io.keymap import CheckpointMismatchError, KeyRule, export_tensors, import_tensors
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
    KeyRule(r"markov_head\.joint_proj\.weight", "joint_kernel", transpose=True),  # input [s; W1[x]; h], out gate|cand|out
    KeyRule(r"markov_head\.joint_proj\.bias", "joint_bias"),
    KeyRule(r"confidence_head\.proj\.weight", "conf_kernel", transpose=True),  # input [h; W1[x]]
    KeyRule(r"confidence_head\.proj\.bias", "conf_bias"),
]
IGNORED_KEYS = (r".*rotary_emb\.inv_freq",)
# Width fields that must equal the target's (the drafter shares its embedding and LM head).
_WIDTH_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim", "rms_norm_eps")


class ConversionError(ValueError):
    pass


def _target_model(target, mesh=None):
    if isinstance(target, (str, Path)):
        from dspark_jax.io.hf import load_target

        # as stored (bf16 halves the memory); on a mesh each chip holds its share
        return load_target(target, dtype="auto", load_tokenizer=False, mesh=mesh).model
    return target if hasattr(target, "lm_head_weight") else target.model


# ---------------------------------------------------------------------------- config


def reference_config(drafter: Drafter, num_anchors: int = 512, dtype: str = "float32") -> dict:
    """config.json of the reference layout for `drafter`."""
    d = drafter.dcfg
    r = d.markov_rank
    sliding = d.sliding_window is not None
    hf = drafter.cfg.to_hf(torch_dtype=dtype)
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
    )
    if r:
        hf["markov_head_type"] = d.head_type
    if d.confidence_head:
        hf["confidence_head_with_markov"] = bool(r)
    return hf


def parse_reference_config(hf: dict, target_cfg: ModelConfig, source: str = "config.json") -> tuple[DrafterSection, bool]:
    """Reference config.json -> (our resolved DrafterSection, confidence_head_with_markov).

    Every problem found is reported in one ConversionError.
    """
    problems = []
    archs = hf.get("architectures") or []
    if ARCHITECTURE not in archs:
        raise ConversionError(f"{source}: architectures {archs} is not ['{ARCHITECTURE}']: not a DeepSpec DSpark/DFlash drafter checkpoint")
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
        problems.append(f"layer_types {sorted(types)}: only all full_attention or all sliding_attention layers are supported")
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
        raise FileNotFoundError(f"'{ref_dir}' has no config.json: pass a DeepSpec drafter directory (config.json + model.safetensors)")
    hf = json.loads(cfg_file.read_text())
    dcfg, with_markov = parse_reference_config(hf, tmodel.cfg, str(cfg_file))
    from dspark_jax.io.hf import read_weights

    tensors = read_weights(ref_dir)
    expected = _expected(tmodel.cfg, dcfg, with_markov)
    try:
        pure = import_tensors(tensors, REFERENCE_KEY_TABLE, expected, dcfg.num_layers, source=str(ref_dir), ignore=IGNORED_KEYS)
    except CheckpointMismatchError as e:
        raise ConversionError(str(e)) from None
    _check_same("embed_tokens.weight", pure.pop("embed"), np.asarray(tmodel.embed[...]))
    _check_same("lm_head.weight", pure.pop("lm_head"), np.asarray(tmodel.lm_head_weight()))
    if "conf_kernel" in pure and pure["conf_kernel"].shape[0] == tmodel.cfg.hidden_size and dcfg.markov_rank:
        k = pure["conf_kernel"]
        pure["conf_kernel"] = np.concatenate([k, np.zeros((dcfg.markov_rank, 1), k.dtype)], axis=0)
    return drafter_io.from_params(tmodel, dcfg, pure, param_dtype=param_dtype, mesh=mesh, source=str(ref_dir))


def reference_tensors(drafter: Drafter, dtype: str = "float32") -> dict[str, np.ndarray]:
    """Our drafter -> the reference layout's tensors (incl. embed_tokens / lm_head)."""
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    pure = jax.tree.map(lambda a: np.asarray(jax.device_get(a)), nnx.to_pure_dict(trainable_state(drafter)))
    pure["embed"] = np.asarray(jax.device_get(drafter.embed[...]))
    pure["lm_head"] = np.asarray(jax.device_get(drafter.lm_head[...]))
    pure = jax.tree.map(lambda a: a.astype(np_dtype), pure)
    return export_tensors(pure, REFERENCE_KEY_TABLE, drafter.dcfg.num_layers)


def write_reference(drafter: Drafter, ref_dir: str | Path, dtype: str = "float32", num_anchors: int = 512) -> None:
    ref_dir = Path(ref_dir)
    ref_dir.mkdir(parents=True, exist_ok=True)
    safetensors_io.save_file(reference_tensors(drafter, dtype), ref_dir / REF_WEIGHTS, metadata={"format": "pt"})
    (ref_dir / "config.json").write_text(json.dumps(reference_config(drafter, num_anchors, dtype), indent=2))


def import_reference(ref_dir, out_dir, target, mesh=None) -> Drafter:
    drafter = read_reference(ref_dir, target, mesh=mesh)
    drafter_io.save(drafter, out_dir)
    return drafter


def export_reference(our_dir, ref_dir, target, dtype: str = "float32", num_anchors: int = 512, mesh=None) -> Drafter:
    drafter = drafter_io.load(our_dir, _target_model(target, mesh), mesh=mesh)
    kind = registry.kind_of(drafter)
    if not kind.has_reference_layout:
        raise ConversionError(f"{our_dir} holds a {kind.name} drafter, which has no DeepSpec reference layout; "
                              f"only {', '.join(k for k, a in registry.KINDS.items() if a.has_reference_layout)} "
                              "drafters export")
    write_reference(drafter, ref_dir, dtype, num_anchors)
    return drafter


# ---------------------------------------------------------------------------- CLI


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m dspark_jax.convert",
        description="Convert DSpark/DFlash drafters between the DeepSpec (PyTorch, Hugging Face save_pretrained) "
                    "layout and dspark_jax's drafter directory (drafter.safetensors + drafter_config.json).",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    imp = sub.add_parser("import", help="DeepSpec drafter directory -> dspark_jax drafter directory",
                         description="Read REF_DIR (config.json with architectures [Qwen3DSparkModel] + safetensors), "
                                     "check it against the target, write OUT_DIR.")
    imp.add_argument("ref_dir", metavar="REF_DIR", help="DeepSpec drafter checkpoint directory")
    imp.add_argument("out_dir", metavar="OUT_DIR", help="where to write the dspark_jax drafter")
    exp = sub.add_parser("export", help="dspark_jax drafter directory -> DeepSpec drafter directory",
                         description="Read OUR_DIR (drafter.safetensors + drafter_config.json), write REF_DIR in the "
                                     "DeepSpec layout including the target's embedding and LM head.")
    exp.add_argument("our_dir", metavar="OUR_DIR", help="dspark_jax drafter directory")
    exp.add_argument("ref_dir", metavar="REF_DIR", help="where to write the DeepSpec layout")
    exp.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                     help="tensor dtype written (default float32; DeepSpec trains in bfloat16)")
    exp.add_argument("--num-anchors", type=int, default=512, help="num_anchors recorded in config.json (default 512)")
    from dspark_jax.parallel.sharding import add_mesh_argument, parse_mesh

    for p in (imp, exp):
        p.add_argument("--target", required=True, metavar="TARGET_DIR",
                       help="the target's Hugging Face checkpoint directory (the drafter's embedding / LM head come from it)")
        add_mesh_argument(p, "so a target larger than one chip can be read (the converted files are the same)")
    args = ap.parse_args(argv)
    try:
        mesh = parse_mesh(args.mesh)
        if args.cmd == "import":
            d = import_reference(args.ref_dir, args.out_dir, args.target, mesh=mesh)
            print(f"imported {args.ref_dir} -> {args.out_dir} ({d.dcfg.kind}, {d.dcfg.num_layers} layers, gamma {d.gamma})")
        else:
            d = export_reference(args.our_dir, args.ref_dir, args.target, args.dtype, args.num_anchors, mesh=mesh)
            print(f"exported {args.our_dir} -> {args.ref_dir} ({d.dcfg.kind}, {args.dtype})")
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
