"""Tiny random targets and drafters for the tests and the smoke benchmarks (tiny.py): the smallest
shapes over the library's random models (drafter/random_models.py), which timing uses too."""
