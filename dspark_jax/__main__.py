"""`python -m dspark_jax <command> [options]` (or `dspark-jax <command>`): every command in one place.

Every command is a module of `dspark_jax.commands` (parse the arguments, call the library, print);
`python -m dspark_jax.train` also runs the trainer directly, as the TPU launch scripts do. Each
command's module is imported only when it runs, so listing the commands needs no JAX.

Naming rule: a command is one lowercase word, a verb for what it does (`train`, `generate`,
`serve`, `convert`) or the noun of the thing it makes or works on (`costs`, `models`, `features`);
variants of one kind of work are subcommands of one command, never hyphenated names of their own
(`plan train` and `plan engine`, `bench serve` and `bench tpu-memory`, `convert gguf`). An old
spelling stays for one release as an alias (`ALIASES`) that runs the new command after a one-line
notice on stderr.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import NamedTuple

from dspark_jax.cli import skip_absent_tpu
from dspark_jax.console import show_logs


class Command(NamedTuple):
    module: str  # holds `main(argv) -> int`
    summary: str


class Alias(NamedTuple):
    """An old spelling: `old [drop] args...` runs `new args...` (`drop`: a word the old form had)."""

    new: tuple[str, ...]
    drop: str | None = None


COMMANDS = {
    "train": Command("dspark_jax.commands.train",
                     "train a drafter (dspark, dflash, eagle3, mtp1); no arguments = the embedded default"),
    "plan": Command("dspark_jax.commands.plan",
                    "per-chip memory without devices: plan train (a preset's train / eval steps), "
                    "plan engine (serving)"),
    "embedded": Command("dspark_jax.commands.embedded",
                        "build / locate / verify / report the embedded default target"),
    "models": Command("dspark_jax.commands.models",
                      "fetch a real target (SmolLM2-135M-Instruct from its GGUF) into the user cache"),
    "recipe": Command("dspark_jax.commands.recipe",
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
    "costs": Command("dspark_jax.commands.costs",
                     "measure / predict / roofline / show / plot verification cost tables"),
    "serve": Command("dspark_jax.commands.serve",
                     "an OpenAI-compatible HTTP server (completions, chat, streaming) with continuous batching"),
    "simulate": Command("dspark_jax.commands.simulate", "serving simulation of the schedulers under concurrency"),
    "convert": Command("dspark_jax.commands.convert",
                       "drafters to / from DeepSpec's layout (what vLLM / SGLang load); a GGUF model "
                       "as a Hugging Face checkpoint"),
    "bench": Command("dspark_jax.commands.bench",
                     "benchmarks and the TPU reports of docs/ (regen, train, engine, serve, roofline, "
                     "tpu-memory, tpu-predict, ...)"),
}

# old spelling -> the command it is now; kept for one release
ALIASES = {
    "train-plan": Alias(("plan", "train")),
    "engine-plan": Alias(("plan", "engine")),
    "tpu-memory": Alias(("bench", "tpu-memory")),
    "tpu-predict": Alias(("bench", "tpu-predict")),
    "gguf": Alias(("convert", "gguf"), drop="import"),
}


def resolve_alias(name: str, rest: list[str]) -> tuple[str, list[str]]:
    """An old spelling -> (the command, its arguments), with the notice on stderr; others as they are."""
    alias = ALIASES.get(name)
    if alias is None:
        return name, rest
    if alias.drop is not None and rest[:1] == [alias.drop]:
        rest = rest[1:]
    old = " ".join([name] + ([alias.drop] if alias.drop else []))
    print(f"note: `{old}` is now `{' '.join(alias.new)}`; the old name goes away in the next release",
          file=sys.stderr)
    return alias.new[0], list(alias.new[1:]) + rest


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {c.summary}" for name, c in COMMANDS.items()]
    return ("usage: python -m dspark_jax [--no-compile-cache] <command> [options]   (or: dspark-jax ...)\n\n"
            "Compiled programs are kept in the user cache ($DSPARK_JAX_COMPILE_CACHE, default\n"
            "~/.cache/dspark_jax/xla; 'off' or --no-compile-cache keeps them in memory only).\n\n"
            "commands (each answers --help):\n" + "\n".join(lines) +
            "\n\nold names, for one more release: " +
            ", ".join(f"{old} (now {' '.join(a.new)})" for old, a in ALIASES.items()))


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
    name, rest = resolve_alias(argv[0], argv[1:])
    if name not in COMMANDS:
        print(f"error: unknown command {name!r}; the commands are: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    show_logs()  # library progress lines (logging) on stderr
    skip_absent_tpu()  # before jax is imported: no libtpu start-up errors on a host without a TPU
    if not any(a in ("-h", "--help") for a in rest):  # --help answers without starting JAX
        use_compile_cache()
    return importlib.import_module(COMMANDS[name].module).main(rest)


if __name__ == "__main__":
    sys.exit(main())
