import sys

from dspark_jax.engine.generate import main

sys.exit(main())
