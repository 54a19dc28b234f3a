"""Declarative weight-name tables: checkpoint key pattern -> our parameter path.

A rule maps a regex over checkpoint keys to a dotted path in our parameter tree, with a
transform (`T`: torch Linear (out, in) -> JAX kernel (in, out)) and, for per-layer keys,
stacking on a leading `layers` axis by the captured layer index. Import collects every
missing, unexpected and mis-shaped key and reports them all in one error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class KeyRule:
    pattern: str  # regex over checkpoint keys; a group named `layer` stacks
    path: str  # dotted path in our pure-dict parameter tree
    transpose: bool = False  # torch Linear (out, in) -> kernel (in, out)

    def key_for(self, layer: int | None = None) -> str:
        """The checkpoint key for export (the pattern with the layer index filled in)."""
        key = self.pattern.replace(r"(?P<layer>\d+)", str(layer)) if layer is not None else self.pattern
        return key.replace("\\.", ".")


class CheckpointMismatchError(ValueError):
    pass


def set_path(tree: dict, path: str, value):
    parts = path.split(".")
    for part in parts[:-1]:
        tree = tree.setdefault(part, {})
    tree[parts[-1]] = value


def flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def import_tensors(tensors: dict[str, np.ndarray], rules: list[KeyRule], expected: dict[str, tuple],
                   num_layers: int, source: str = "checkpoint", ignore: tuple[str, ...] = (),
                   lazy: bool = False) -> dict:
    """Checkpoint tensors -> nested dict matching `expected` (flat path -> full shape).

    `lazy`: per-layer tensors become a `LayerStack` (nothing copied until indexed) instead of
    one stacked array. Raises CheckpointMismatchError listing all missing, unexpected and
    mis-shaped keys.
    """
    compiled = [(re.compile(r.pattern + "$"), r) for r in rules]
    found: dict[str, dict] = {}
    unexpected, misshaped = [], []
    misshaped_keys: set[str] = set()
    for key in sorted(tensors):
        rule, layer = None, None
        for rx, r in compiled:
            mt = rx.match(key)
            if mt:
                rule, layer = r, mt.groupdict().get("layer")
                break
        if rule is None or rule.path not in expected:
            if not any(re.match(p + "$", key) for p in ignore):
                unexpected.append(key)
            continue
        arr = tensors[key]
        if rule.transpose:
            arr = arr.T
        want = expected[rule.path]
        per = want[1:] if layer is not None else want
        if tuple(arr.shape) != tuple(per):
            misshaped.append(f"{key}: shape {tuple(tensors[key].shape)}, "
                             f"expected {tuple(per[::-1]) if rule.transpose else tuple(per)}")
            misshaped_keys.add(key)
            continue
        if layer is not None:
            li = int(layer)
            if li >= num_layers:
                unexpected.append(key)
                continue
            found.setdefault(rule.path, {})[li] = arr
        else:
            found[rule.path] = arr
    missing = []
    for path, shape in expected.items():
        rule = next((r for r in rules if r.path == path), None)
        if rule is None:
            missing.append(f"(no rule for parameter {path})")
            continue
        stacked = "(?P<layer>" in rule.pattern
        if stacked:
            have = found.get(path, {})
            missing += [rule.key_for(i) for i in range(num_layers)
                        if i not in have and rule.key_for(i) not in misshaped_keys]
        elif path not in found and rule.key_for() not in misshaped_keys:
            missing.append(rule.key_for())
    if missing or unexpected or misshaped:
        lines = [f"{source} does not match the model:"]
        if missing:
            lines.append(f"  missing keys ({len(missing)}): " + ", ".join(missing[:20])
                         + (" ..." if len(missing) > 20 else ""))
        if unexpected:
            lines.append(f"  unexpected keys ({len(unexpected)}): " + ", ".join(unexpected[:20])
                         + (" ..." if len(unexpected) > 20 else ""))
        if misshaped:
            lines.append(f"  wrong shapes ({len(misshaped)}): " + "; ".join(misshaped[:20]))
        raise CheckpointMismatchError("\n".join(lines))
    out: dict = {}
    for path, shape in expected.items():
        v = found[path]
        if isinstance(v, dict):
            v = LayerStack([v[i] for i in range(num_layers)]) if lazy else np.stack([v[i] for i in range(num_layers)])
        set_path(out, path, v)
    return out


class LayerStack:
    """Per-layer arrays (memory-mapped views) seen as one [layers, ...] array that reads only
    what is indexed: `stack[index]` for an index tuple of slices materialises that block alone.
    `jax.make_array_from_callback` asks for each local device's block, so a host loads just
    the parts of a checkpoint its chips hold."""

    def __init__(self, layers: list):
        self.layers = layers
        self.shape = (len(layers), *layers[0].shape)
        self.dtype = layers[0].dtype
        self.ndim = len(self.shape)

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        first, rest = index[0], index[1:]
        picked = self.layers[first] if isinstance(first, slice) else [self.layers[first]]
        block = np.stack([np.asarray(a[rest]) for a in picked])
        return block if isinstance(first, slice) else block[0]


def export_tensors(tree: dict, rules: list[KeyRule], num_layers: int) -> dict[str, np.ndarray]:
    """Inverse of `import_tensors`: our nested dict -> checkpoint keys (unstacked, transposed back)."""
    flat = flatten(tree)
    out = {}
    for r in rules:
        if r.path not in flat:
            continue
        arr = np.asarray(flat[r.path])
        if "(?P<layer>" in r.pattern:
            for i in range(num_layers):
                a = arr[i]
                out[r.key_for(i)] = np.ascontiguousarray(a.T if r.transpose else a)
        else:
            out[r.key_for()] = np.ascontiguousarray(arr.T if r.transpose else arr)
    return out
