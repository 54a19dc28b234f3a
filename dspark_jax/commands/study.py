"""`python -m dspark_jax recipe embedded-study --out DIR`: DSpark against DFlash and four ablations
over seeds on the embedded target (recipe/study.py, whose docstring `--help` shows), resumable."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from dspark_jax.cli import parse_stages


def _sampling(text: str) -> tuple[float, float, int]:
    """"T" or "T/top_p/top_k" -> (T, top_p, top_k); a bare T samples the whole distribution."""
    parts = text.split("/")
    if len(parts) not in (1, 3):
        raise ValueError(text)
    return (float(parts[0]), 1.0, 0) if len(parts) == 1 else (float(parts[0]), float(parts[1]), int(parts[2]))


def main(argv=None) -> int:
    from dspark_jax.recipe import study
    from dspark_jax.recipe.run import RecipeError
    from dspark_jax.recipe.study import DEFAULT_VARIANTS, STAGES, VARIANTS, Study, run_study

    ap = argparse.ArgumentParser(prog="python -m dspark_jax recipe embedded-study", description=study.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="section.key=value overrides for every training run")
    ap.add_argument("--out", required=True, help="output directory (data, runs, eval, logs, report.md)")
    ap.add_argument("--target", default=None, help="HF checkpoint directory (default: the embedded target)")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                    help=f"comma-separated, from {', '.join(VARIANTS)} (default {','.join(DEFAULT_VARIANTS)})")
    ap.add_argument("--seeds", default="0,1,2", help="training seeds, comma-separated (default 0,1,2)")
    ap.add_argument("--steps", type=int, default=None, help="training steps of every run (default: the study's)")
    ap.add_argument("--num-train-prompts", type=int, default=Study.num_train_prompts)
    ap.add_argument("--num-heldout-prompts", type=int, default=Study.num_heldout_prompts)
    ap.add_argument("--regen-max-new-tokens", type=int, default=Study.regen_max_new_tokens)
    ap.add_argument("--eval-max-new-tokens", type=int, default=Study.eval_max_new_tokens)
    ap.add_argument("--regen-sampling", default=",".join(map(str, Study.regen_sampling)),
                    help="temperature,top_p,top_k of the regenerated responses (default 0.7,0.8,20)")
    ap.add_argument("--seq-len", type=int, default=Study.seq_len, help="training sequence length")
    ap.add_argument("--eval-sampling", "--temperatures", dest="eval_sampling",
                    default="1,0,0.7/0.8/20",
                    help="evaluation settings, comma-separated, each T or T/top_p/top_k (default "
                         "1,0,0.7/0.8/20: T = 1, exact greedy, the regenerated data's sampling)")
    ap.add_argument("--stages", default=",".join(STAGES),
                    help=f"which of {','.join(STAGES)} to run (default all)")
    ap.add_argument("--docs", default=None, help="also render the report into this markdown file (docs/study.md)")
    args = ap.parse_intermixed_args(argv)
    stages = parse_stages(ap, args.stages, STAGES)
    try:
        seeds = tuple(int(x) for x in args.seeds.split(","))
        samplings = tuple(_sampling(x) for x in args.eval_sampling.split(","))
        rt, rp, rk = args.regen_sampling.split(",")
        regen = (float(rt), float(rp), int(rk))
    except ValueError:
        ap.error("--seeds, --eval-sampling and --regen-sampling take comma-separated numbers, e.g. --seeds 0,1,2 "
                 "--eval-sampling 1,0,0.7/0.8/20 --regen-sampling 0.7,0.8,20")
    train = Study.train + ((f"train.steps={args.steps}", f"train.eval_every={max(args.steps // 4, 1)}",
                            f"train.checkpoint_every={max(args.steps // 2, 1)}") if args.steps else ())
    t0 = time.perf_counter()
    try:
        plan = Study(variants=tuple(x for x in args.variants.split(",") if x), seeds=seeds,
                     num_train_prompts=args.num_train_prompts, num_heldout_prompts=args.num_heldout_prompts,
                     regen_max_new_tokens=args.regen_max_new_tokens, regen_sampling=regen, seq_len=args.seq_len,
                     eval_max_new_tokens=args.eval_max_new_tokens,
                     samplings=samplings, train=train, overrides=tuple(args.overrides))
        run_study(plan, Path(args.out), Path(args.target) if args.target else None, stages=stages,
                  docs=Path(args.docs) if args.docs else None)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[study] {time.perf_counter() - t0:.0f} s", flush=True)
    return 0
