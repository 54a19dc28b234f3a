import sys

from dspark_jax.scheduler.simulate import main

sys.exit(main())
