"""`python -m dspark_jax regenerate`: every assistant turn of a chat set answered again by the
target (in process, or through an OpenAI-compatible server), written as a training dataset
(dspark_jax/data/regenerate.py, data/regen_server.py).
"""

from __future__ import annotations

import argparse
import sys

from dspark_jax.cli import add_dtype_argument, add_mesh_argument, report_user_errors
from dspark_jax.data.regen_defaults import (
    DEFAULT_MAX_NEW,
    DEFAULT_MAX_PROMPT,
    DEFAULT_SAMPLING,
    default_lengths,
)
from dspark_jax.decoding.params import SamplingParams


@report_user_errors
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m dspark_jax regenerate",
        allow_abbrev=False,  # --num / --model are not taken for --num-prompts / --model-name
        description="Regenerate every assistant turn of a chat set with the target (in process, or through an "
                    "OpenAI-compatible server) and write a training dataset.",
        epilog="examples:\n  python -m dspark_jax regenerate --target DIR --prompts chats.jsonl --out data/train\n"
               "  python -m dspark_jax regenerate --target DIR --prompts chats.jsonl --out data/train \\\n"
               "      --server http://127.0.0.1:8000 --model-name Qwen/Qwen3-8B --concurrency 64   # vLLM / SGLang\n"
               "Rerun with --resume after an interruption: no record is lost or written twice.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="HF checkpoint directory (default: the embedded target); with "
                                                   "--server only its tokenizer and chat template are read")
    add_dtype_argument(ap)
    add_mesh_argument(ap, "each batch's rows over data x fsdp, KV heads over tensor")
    ap.add_argument("--prompts", default=None,
                    help="chats in any format `data.prepare` reads (OpenAI messages, ShareGPT, turns; jsonl, json, "
                         "parquet, a saved datasets directory; default: the embedded corpora's train split)")
    ap.add_argument("--out", required=True, help="output dataset directory")
    ap.add_argument("--num-prompts", dest="num", type=int, default=None, help="number of chats (default: all)")
    ap.add_argument("--batch", type=int, default=16, help="chats per compiled batch (in process)")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help=f"per answer (default {DEFAULT_MAX_NEW}, as the reference, or half the target's context)")
    ap.add_argument("--max-prompt-len", type=int, default=None,
                    help=f"prompt tokens kept, the last ones (in process; default {DEFAULT_MAX_PROMPT} or what the "
                         "context leaves)")
    ap.add_argument("--thinking", choices=("on", "off"), default="off",
                    help="the chat template's enable_thinking (Qwen3); default off")
    ap.add_argument("--temperature", type=float, default=DEFAULT_SAMPLING.temperature)
    ap.add_argument("--top-k", type=int, default=DEFAULT_SAMPLING.top_k)
    ap.add_argument("--top-p", type=float, default=DEFAULT_SAMPLING.top_p)
    ap.add_argument("--seed", type=int, default=0)
    srv = ap.add_argument_group("through a server")
    srv.add_argument("--server", default=None, metavar="URL",
                     help="an OpenAI-compatible server (vLLM, SGLang, python -m dspark_jax serve) serving the target")
    srv.add_argument("--model-name", dest="model", default=None,
                     help="the model name the server serves (default: its first /v1/models)")
    srv.add_argument("--concurrency", type=int, default=16, help="chats in flight at once (default 16)")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--resume", action="store_true", help="continue an interrupted (or extend a finished) run")
    g.add_argument("--overwrite", action="store_true", help="replace an existing dataset")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    from dspark_jax.data.formats import read_conversations
    from dspark_jax.data.regen_server import regenerate_via_server
    from dspark_jax.data.regenerate import as_loaded, default_prompts, regenerate
    from dspark_jax.embedded.target import embedded_target_dir
    from dspark_jax.parallel.sharding import parse_mesh

    thinking = a.thinking == "on"
    sampling = SamplingParams(a.temperature, a.top_k, a.top_p)
    try:
        target = a.target or embedded_target_dir()
        if a.prompts:
            convs = read_conversations(a.prompts)
        else:
            convs = default_prompts(a.seed)
        if a.server:
            max_new = a.max_new_tokens or DEFAULT_MAX_NEW
            regenerate_via_server(a.server, a.model, target, convs, a.out, num=a.num, concurrency=a.concurrency,
                                  max_new_tokens=max_new, sampling=sampling, seed=a.seed, thinking=thinking,
                                  resume=a.resume, overwrite=a.overwrite, progress=not a.no_progress)
            return 0
        mesh = parse_mesh(a.mesh)
        lt = as_loaded(target, a.dtype, mesh)
        max_new, max_prompt = default_lengths(lt.cfg.max_position_embeddings, a.max_new_tokens, a.max_prompt_len)
        regenerate(lt, convs, a.out, num=a.num, batch_size=a.batch, max_new_tokens=max_new, max_prompt_len=max_prompt,
                   sampling=sampling, seed=a.seed, resume=a.resume, overwrite=a.overwrite,
                   progress=not a.no_progress, mesh=mesh, thinking=thinking)
    except (ValueError, FileNotFoundError, FileExistsError, ConnectionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
