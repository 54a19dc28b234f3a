import sys

from dspark_jax.eval.evaluate import main

sys.exit(main())
