import sys

from dspark_jax.io.reference import main

sys.exit(main())
