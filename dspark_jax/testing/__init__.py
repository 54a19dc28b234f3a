"""Test tools, never used on the production path: tiny random targets and drafters (tiny.py)
and deliberately broken verifiers and schedulers that the tests must catch (broken.py)."""
