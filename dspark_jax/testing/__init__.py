"""Tiny random targets and drafters (tiny.py), for the tests and the smoke benchmarks; never
used on the production path."""
