"""`python -m dspark_jax convert import|export|gguf ...`: drafters between DeepSpec's layout (what
vLLM / SGLang load) and ours (`dspark_jax.io.reference`), and a GGUF model (llama.cpp's format) as a
Hugging Face checkpoint directory (`dspark_jax.io.gguf`)."""

from __future__ import annotations

import argparse
import sys

from dspark_jax.cli import add_mesh_argument, report_user_errors


@report_user_errors
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m dspark_jax convert",
        description="Convert DSpark/DFlash drafters between the DeepSpec (PyTorch, Hugging Face save_pretrained) "
                    "layout and dspark_jax's drafter directory (drafter.safetensors + drafter_config.json), or "
                    "a GGUF model into a Hugging Face checkpoint directory.",
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
    exp.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                     help="tensor dtype written (default bfloat16, as DeepSpec ships; "
                          "float32 keeps our master weights)")
    exp.add_argument("--num-anchors", type=int, default=None,
                     help="num_anchors recorded in config.json (default: the training run's data.num_anchors, "
                          "which training records in drafter_config.json)")
    for p in (imp, exp):
        p.add_argument("--target", required=True, metavar="TARGET_DIR",
                       help="the target's Hugging Face checkpoint directory "
                            "(the drafter's embedding / LM head come from it)")
        add_mesh_argument(p, "so a target larger than one chip can be read (the converted files are the same)")
    gguf = sub.add_parser("gguf", help="GGUF file -> HF directory (config, safetensors, tokenizer, chat template)")
    gguf.add_argument("gguf", help="the .gguf file")
    gguf.add_argument("out_dir", help="directory to write (replaced if it exists)")
    gguf.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args(argv)
    if args.cmd == "gguf":
        return _gguf(args)
    from dspark_jax.io.reference import (  # jax: after --help
        export_reference,
        import_reference,
    )
    from dspark_jax.parallel.sharding import parse_mesh

    try:
        mesh = parse_mesh(args.mesh)
        if args.cmd == "import":
            d = import_reference(args.ref_dir, args.out_dir, args.target, mesh=mesh)
            print(f"imported {args.ref_dir} -> {args.out_dir} "
                  f"({d.dcfg.kind}, {d.dcfg.num_layers} layers, gamma {d.gamma})")
        else:
            d = export_reference(args.our_dir, args.ref_dir, args.target, args.dtype, args.num_anchors, mesh=mesh)
            print(f"exported {args.our_dir} -> {args.ref_dir} ({d.dcfg.kind}, {args.dtype})")
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _gguf(args) -> int:
    from dspark_jax.io.gguf import GGUFError, import_gguf

    try:
        out = import_gguf(args.gguf, args.out_dir, args.dtype)
    except GGUFError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0
