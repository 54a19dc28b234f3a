import sys

from dspark_jax.io.models import main

sys.exit(main())
