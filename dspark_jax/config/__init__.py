"""Configuration: the typed schema (schema.py), YAML presets and `section.key=value` overrides (loader.py)."""

from dspark_jax.config.loader import ConfigError, to_dict
from dspark_jax.config.schema import *  # noqa: F401,F403  (the schema is this package's API)
from dspark_jax.config.schema import __all__ as _schema_all

__all__ = ["ConfigError", "to_dict", *_schema_all]
