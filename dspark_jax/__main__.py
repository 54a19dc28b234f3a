"""`python -m dspark_jax <command> [options]` (or `dspark-jax <command>`): every command in one place.

`python -m dspark_jax.train` also runs the trainer directly, as the TPU launch scripts do.
Each command's module is imported only when it runs, so listing the commands needs no JAX.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import NamedTuple

from dspark_jax.console import show_logs


class Command(NamedTuple):
    module: str  # holds `main(argv) -> int`
    summary: str


COMMANDS = {
    "train": Command("dspark_jax.train.__main__",
                     "train a drafter (dspark, dflash, eagle3, mtp1); no arguments = the embedded default"),
    "train-plan": Command("dspark_jax.commands.train_plan",
                          "sharding check and per-chip memory of a preset's train / eval steps, no devices needed"),
    "engine-plan": Command("dspark_jax.commands.engine_plan",
                           "per-chip serving memory of the engine (weights, KV caches, compiled round) for a preset"),
    "tpu-memory": Command("dspark_jax.bench.tpu_memory",
                          "docs/tpu_memory.md: every preset compiled by the TPU compiler for its slice (resumable)"),
    "tpu-predict": Command("dspark_jax.bench.tpu_predict",
                           "docs/tpu_predictions.md: DSpark's speed on TPU slices from the TPU compiler's cost "
                           "model, beside published TPU runs (resumable)"),
    "embedded": Command("dspark_jax.embedded.__main__", "build / locate / verify / report the embedded default target"),
    "models": Command("dspark_jax.commands.models",
                      "fetch a real target (SmolLM2-135M-Instruct from its GGUF) into the user cache"),
    "gguf": Command("dspark_jax.commands.gguf", "import a GGUF model as a Hugging Face checkpoint directory"),
    "recipe": Command("dspark_jax.recipe.__main__",
                      "a whole recipe, resumable: fetch, train DSpark and DFlash, evaluate, time "
                      "(e.g. smollm2-135m-instruct)"),
    "prepare": Command("dspark_jax.commands.prepare",
                       "users' answered chats (OpenAI, ShareGPT, parquet, ...) -> a training dataset "
                       "with the answer mask"),
    "regenerate": Command("dspark_jax.commands.regenerate",
                          "regenerate assistant turns with the target into a training dataset"),
    "features": Command("dspark_jax.commands.features",
                        "the target's drafter inputs for a config's training set, computed once "
                        "(train with data.features=cache)"),
    "generate": Command("dspark_jax.commands.generate", "speculative (or target-only) decoding of prompts"),
    "eval": Command("dspark_jax.commands.eval",
                    "tau with intervals, conditional acceptance, calibration report and plots"),
    "calibrate": Command("dspark_jax.commands.calibrate", "fit Sequential Temperature Scaling on engine traces"),
    "costs": Command("dspark_jax.commands.costs", "measure / show verification cost tables"),
    "serve": Command("dspark_jax.serve.__main__",
                     "an OpenAI-compatible HTTP server (completions, chat, streaming) with continuous batching"),
    "simulate": Command("dspark_jax.commands.simulate", "serving simulation of the schedulers under concurrency"),
    "convert": Command("dspark_jax.commands.convert",
                       "import / export DeepSpec reference-layout drafters (what vLLM / SGLang load)"),
    "bench": Command("dspark_jax.bench.__main__", "benchmarks (regen, train, engine, vs-torch, sampling, grid, serve)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {c.summary}" for name, c in COMMANDS.items()]
    return ("usage: python -m dspark_jax [--no-compile-cache] <command> [options]   (or: dspark-jax ...)\n\n"
            "Compiled programs are kept in the user cache ($DSPARK_JAX_COMPILE_CACHE, default\n"
            "~/.cache/dspark_jax/xla; 'off' or --no-compile-cache keeps them in memory only).\n\n"
            "commands (each answers --help):\n" + "\n".join(lines))


def use_compile_cache() -> None:
    """JAX's persistent compilation cache for this command (io/compile_cache.py)."""
    from dspark_jax.io.compile_cache import enable_compile_cache

    enable_compile_cache()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] == "--no-compile-cache":
        os.environ["DSPARK_JAX_COMPILE_CACHE"] = "off"
        argv = argv[1:]
        if not argv:
            print(usage())
            return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: unknown command {name!r}; the commands are: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    show_logs()  # library progress lines (logging) on stderr
    if not any(a in ("-h", "--help") for a in rest):  # --help answers without starting JAX
        use_compile_cache()
    return importlib.import_module(COMMANDS[name].module).main(rest)


if __name__ == "__main__":
    sys.exit(main())
