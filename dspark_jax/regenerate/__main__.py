import sys

from dspark_jax.data.regenerate import main

sys.exit(main())
