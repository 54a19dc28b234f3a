"""Device meshes and the one table of logical axis names -> mesh axes (sharding.py)."""
