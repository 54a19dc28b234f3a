import sys

from dspark_jax.calibration.calibrate import main

sys.exit(main())
