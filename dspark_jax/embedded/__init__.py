"""The embedded default target: a small Qwen3 pretrained here on offline corpora and cached per
user (target.py), its held-out report (report.py), and `python -m dspark_jax embedded`."""

from dspark_jax.embedded.target import build_embedded_target, embedded_target_dir, resolve_target_dir

__all__ = ["build_embedded_target", "embedded_target_dir", "resolve_target_dir"]
