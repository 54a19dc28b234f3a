"""`python -m dspark_jax recipe NAME --out DIR [section.key=value ...]`: a whole recipe, resumable.

    python -m dspark_jax recipe smollm2-135m-instruct --out runs/smollm2
    python -m dspark_jax recipe smollm2-135m-instruct --out runs/smollm2 data.num_prompts=400 train.steps=60
    python -m dspark_jax recipe embedded-study --out runs/study   (DSpark, DFlash and ablations with seeds:
                                                                   recipe/study.py, its own options)

Fetches the target (or takes --target), trains every drafter of the recipe on the same regenerated
data, evaluates them side by side on the public prompt sets at each temperature (tau with 95 %
intervals, per-position acceptance, STS before / after) and times them against target-only decoding;
writes OUT/report.md and OUT/summary.json. Rerun the same command after an interruption: finished
stages are skipped, training resumes from its checkpoints, regeneration from its cache.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from dspark_jax.cli import parse_stages
from dspark_jax.recipe.recipes import RECIPES

DEFAULT_EVAL_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "eval_datasets"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["embedded-study"]:  # its own options: recipe/study.py
        from dspark_jax.commands.study import main as study_main

        return study_main(argv[1:])
    from dspark_jax.recipe.run import STAGES, RecipeError, record_time, run_recipe

    ap = argparse.ArgumentParser(prog="python -m dspark_jax recipe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", choices=sorted(RECIPES) + ["embedded-study"], help="the recipe")
    ap.add_argument("overrides", nargs="*", help="section.key=value overrides for every training run")
    ap.add_argument("--out", required=True, help="output directory (one subfolder per drafter, eval_T*, logs)")
    ap.add_argument("--target", default=None, help="HF checkpoint directory instead of fetching the recipe's model")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="weights of the fetched target")
    ap.add_argument("--eval-dir", default=str(DEFAULT_EVAL_DIR),
                    help=f"folder of the prompt-set jsonl files (default {DEFAULT_EVAL_DIR})")
    ap.add_argument("--num-eval-prompts", type=int, default=80, help="prompts per set (default 80)")
    ap.add_argument("--eval-max-new-tokens", type=int, default=64,
                    help="new tokens per prompt in the evaluation (default 64: about 50 rounds a prompt)")
    ap.add_argument("--speed-prompts", type=int, default=8)
    ap.add_argument("--speed-max-new-tokens", type=int, default=64)
    ap.add_argument("--speed-repeats", type=int, default=2, help="alternating runs per speed row (default 2)")
    ap.add_argument("--speed-batch-sizes", default="1,8", help="comma-separated batch sizes timed (default 1,8)")
    ap.add_argument("--temperatures", default=None, help="evaluation temperatures, comma-separated (default: the "
                                                           "recipe's, 0,1)")
    ap.add_argument("--speed-temperatures", default=None,
                    help="temperatures of the wall-clock rows, comma-separated (default: the recipe's)")
    ap.add_argument("--stages", default=",".join(STAGES), help=f"which of {','.join(STAGES)} to run (default all)")
    args = ap.parse_intermixed_args(argv)  # overrides before or after the options
    recipe = RECIPES[args.name]
    stages = parse_stages(ap, args.stages, STAGES)
    try:
        batch_sizes = tuple(int(b) for b in args.speed_batch_sizes.split(","))
    except ValueError:
        ap.error(f"--speed-batch-sizes {args.speed_batch_sizes!r}: give comma-separated integers, e.g. 1,8")
    temps = None if args.temperatures is None else tuple(float(t) for t in args.temperatures.split(","))
    speed_temps = None if args.speed_temperatures is None else \
        tuple(float(t) for t in args.speed_temperatures.split(","))
    try:
        if args.target:
            target = Path(args.target)
        elif recipe.model:
            from dspark_jax.io.models import fetch

            t0 = time.perf_counter()
            target = fetch(recipe.model, args.dtype)
            record_time(Path(args.out) / "logs", "fetch target", time.perf_counter() - t0)
        else:
            raise RecipeError(f"recipe {recipe.name} has no model to fetch: pass --target DIR")
        run_recipe(recipe, Path(args.out), target, overrides=args.overrides, eval_dir=Path(args.eval_dir),
                   num_eval_prompts=args.num_eval_prompts, eval_max_new_tokens=args.eval_max_new_tokens,
                   speed_prompts=args.speed_prompts, speed_max_new_tokens=args.speed_max_new_tokens,
                   speed_repeats=args.speed_repeats, speed_batch_sizes=batch_sizes,
                   temperatures=temps, speed_temperatures=speed_temps, stages=stages)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
