"""Typed configuration: nested dataclasses, YAML presets and `section.key=value` overrides.

Every command takes `[CONFIG.yaml] [section.key=value ...]`. Values are checked against
the dataclass annotations, so a typo or a wrong type fails before any work starts, with
one message naming the key and what it accepts.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml


class ConfigError(ValueError):
    """A configuration problem; the message names the key and the valid choices."""


def _type_name(tp) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if origin in (tuple, list):
        args = [a for a in get_args(tp) if a is not Ellipsis]
        return f"a list of {_type_name(args[0]) if args else 'values'}"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp, key: str):
    """Return `value` converted to annotation `tp`, or raise ConfigError naming `key`."""
    origin = get_origin(tp)
    bad = ConfigError(f"config key '{key}': got {value!r}, expected {_type_name(tp)}")
    if tp is Any:
        return value
    if origin is Literal:
        if value in get_args(tp):
            return value
        raise bad
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in get_args(tp):
            return None
        non_null = [a for a in get_args(tp) if a is not type(None)]
        if len(non_null) == 1:  # Optional[X]: X's own, more precise message
            return _coerce(value, non_null[0], key)
        for arg in get_args(tp):
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                pass
        raise bad
    if origin in (tuple, list):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise bad
        args = [a for a in get_args(tp) if a is not Ellipsis]
        elem = args[0] if args else Any
        items = [_coerce(v, elem, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise bad
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise bad
        return from_dict(tp, value, prefix=key + ".")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise bad
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise bad


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_dict(cls, data: dict, prefix: str = ""):
    """Build dataclass `cls` from a nested dict, rejecting unknown keys and wrong types."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config section '{prefix.rstrip('.') or '<root>'}' must be a mapping, got {data!r}")
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown config key '{prefix}{unknown[0]}'; valid keys in "
            f"'{prefix.rstrip('.') or '<root>'}': {', '.join(sorted(fields))}"
        )
    kwargs = {name: _coerce(value, hints[name], prefix + name) for name, value in data.items()}
    try:
        obj = cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:  # validation inside __post_init__
        raise ConfigError(f"config section '{prefix.rstrip('.') or '<root>'}': {e}") from e
    return obj


def to_dict(obj) -> dict:
    """Plain nested dict (tuples as lists) suitable for YAML/JSON."""

    def conv(v):
        if dataclasses.is_dataclass(v):
            return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v

    return conv(obj)


def _set_path(d: dict, path: list[str], value, cls, full: str, where: str = "<root>"):
    """Set d[path] = value, checking each key exists in the schema `cls`."""
    hints = _hints(cls)
    head = path[0]
    if head not in hints:
        valid = ", ".join(sorted(f.name for f in dataclasses.fields(cls)))
        raise ConfigError(f"unknown config key '{full}'; valid keys in '{where}': {valid}")
    if len(path) == 1:
        d[head] = value
        return
    sub_tp = hints[head]
    if get_origin(sub_tp) in (typing.Union, types.UnionType):
        sub_tp = next(a for a in get_args(sub_tp) if a is not type(None))
    if not dataclasses.is_dataclass(sub_tp):
        raise ConfigError(f"config key '{full}': '{head}' is not a section")
    sub = d.get(head)
    if not isinstance(sub, dict):
        sub = {} if sub is None else sub
        d[head] = sub
    _set_path(sub, path[1:], value, sub_tp, full, head if where == "<root>" else f"{where}.{head}")


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override '{text}' is not of the form section.key=value")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def load_config(cls, path: str | Path | None = None, overrides: list[str] = (), base: dict | None = None):
    """Preset file (YAML, may `inherit:` another preset by name or path) + overrides -> `cls`."""
    data: dict = dict(base or {})
    if path is not None:
        data = _deep_merge(data, read_yaml(path))
    for text in overrides:
        keys, value = parse_override(text)
        _set_path(data, keys, value, cls, ".".join(keys))
    return from_dict(cls, data)


def read_yaml(path: str | Path) -> dict:
    path = resolve_preset(path)
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config file must hold a mapping of sections")
    parent = data.pop("inherit", None)
    if parent:
        data = _deep_merge(read_yaml(resolve_preset(parent, relative_to=path.parent)), data)
    return data


def _config_dir() -> Path:
    """The presets: package data `dspark_jax/configs/` (in the source tree a symlink to the
    repository's top-level `configs/`, in a wheel the copied files), else the checkout's configs/."""
    packaged = importlib.resources.files("dspark_jax") / "configs"
    if isinstance(packaged, Path) and packaged.is_dir():
        return packaged.resolve()
    return Path(__file__).resolve().parents[2] / "configs"  # a checkout without the symlink


CONFIG_DIR = _config_dir()


def resolve_preset(name: str | Path, relative_to: Path | None = None) -> Path:
    """A path, or a preset name like `micro` / `micro.yaml` from the shipped presets (configs/)."""
    p = Path(name)
    candidates = [p]
    if relative_to is not None:
        candidates.append(relative_to / p)
    stem = p.name if p.suffix in (".yaml", ".yml") else p.name + ".yaml"
    candidates.append(CONFIG_DIR / stem)
    for c in candidates:
        if c.is_file():
            return c
    raise ConfigError(f"config file '{name}' not found; presets: {', '.join(preset_names()) or 'none'}")


def preset_names() -> list[str]:
    """Names of the shipped presets (`python -m dspark_jax.train NAME`)."""
    return sorted(x.stem for x in CONFIG_DIR.glob("*.yaml")) if CONFIG_DIR.is_dir() else []


def _deep_merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def split_cli(argv: list[str]) -> tuple[str | None, list[str]]:
    """`[CONFIG.yaml] [a.b=c ...]` -> (config path or None, overrides)."""
    path = None
    overrides = []
    for i, arg in enumerate(argv):
        if "=" in arg:
            overrides.append(arg)
        elif i == 0 and path is None:
            path = arg
        else:
            raise ConfigError(f"unexpected argument '{arg}': give at most one config file first, "
                              "then section.key=value overrides")
    return path, overrides
