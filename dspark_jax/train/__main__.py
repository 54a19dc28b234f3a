"""`python -m dspark_jax.train`: the trainer as the TPU launch scripts start it on every host; the
same command as `python -m dspark_jax train` (commands/train.py)."""

import sys

from dspark_jax.commands.train import main

if __name__ == "__main__":
    sys.exit(main())
