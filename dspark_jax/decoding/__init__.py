"""Both sides of speculative decoding's math: the sampling distribution (sampling.py) and
lossless verification by rejection sampling (rejection.py)."""
