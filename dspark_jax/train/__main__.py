"""`python -m dspark_jax.train`: the trainer as the TPU launch scripts start it on every host; the
same command as `python -m dspark_jax train` (commands/train.py)."""

import sys

from dspark_jax.cli import skip_absent_tpu
from dspark_jax.commands.train import main

if __name__ == "__main__":
    skip_absent_tpu()  # before jax is imported (commands/train.py imports it inside main)
    sys.exit(main())
