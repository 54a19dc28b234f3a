"""`python -m dspark_jax`: the commands, each run as `python -m dspark_jax.<command> --help` for its options."""

from __future__ import annotations

import sys

COMMANDS = {
    "train": "train a drafter (dspark, dflash, eagle3, mtp1); no arguments = the embedded default",
    "train.plan": "sharding check and per-device memory estimate of a preset, no devices needed",
    "engine.plan": "per-chip serving memory of the engine (weights, KV caches, compiled round) for a preset",
    "parallel.tpu_memory": "docs/tpu_memory.md: every preset compiled by the TPU compiler for its slice (resumable)",
    "embedded": "build / locate / verify / report the embedded default target",
    "models": "fetch a real target (SmolLM2-135M-Instruct from its GGUF) into the user cache",
    "recipe": "a whole recipe, resumable: fetch, train DSpark and DFlash, evaluate, time (e.g. smollm2-135m-instruct)",
    "data.prepare": "users' answered chats (OpenAI, ShareGPT, parquet, ...) -> a training dataset with the answer mask",
    "regenerate": "regenerate assistant turns with the target into a training dataset",
    "generate": "speculative (or target-only) decoding of prompts",
    "eval": "tau with intervals, conditional acceptance, calibration report and plots",
    "calibrate": "fit Sequential Temperature Scaling on engine traces",
    "costs": "measure / show verification cost tables",
    "serve": "an OpenAI-compatible HTTP server (completions, chat, streaming) with continuous batching",
    "simulate": "serving simulation of the schedulers under concurrency",
    "convert": "import / export DeepSpec reference-layout drafters",
    "bench": "benchmarks (regen, train, engine, vs-torch, sampling, grid)",
}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    print("usage: python -m dspark_jax.<command> [options]\n\ncommands:")
    for name, what in COMMANDS.items():
        print(f"  {name:<19} {what}")
    return 0 if not argv or argv[0] in ("-h", "--help") else 2


if __name__ == "__main__":
    sys.exit(main())
