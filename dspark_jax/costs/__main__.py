import sys

from dspark_jax.scheduler.costs import main

sys.exit(main())
