"""Roofline arithmetic of the engine's decode programs (`python -m dspark_jax bench roofline`).

A program cannot beat its roofline: the bytes it must read over the memory bandwidth, or the
FLOPs it must do over the matmul rate, whichever is longer. The bytes and FLOPs here are that
minimum, counted from the arrays the program takes, so measured over roofline says how far the
compiled program is from the hardware and not from some other implementation:

- weights: each array the program needs read once (every target weight for a forward, the
  LM head only where it computes logits); tables a token looks a row up in (`embed`, the Markov
  head's `markov_w1`) count one row per token, not the whole table;
- KV: what attention reads, the filled length of every row it attends for (layers x 2 x KV heads
  x head dim x itemsize per token); nothing for a prefill, which attends to its own new keys;
- FLOPs: 2 per weight element per token for every product (norms and biases are not products),
  and 4 x heads x head dim per query per key for attention (QK^T and PV).

Writes (new KV, logits, the draft's distributions) are not counted. Each figure comes as the
whole program's and one chip's: on a mesh a chip reads its shards and does its share of the
products (tokens split over `data`, weights and KV heads as the rules table splits them).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np

from dspark_jax.target.config import ModelConfig

__all__ = ["Leaf", "named_leaves", "ModelShapes", "model_shapes", "Footprint", "target_step", "round_footprint",
           "draft_footprint", "prefill_footprint", "roofline", "GATHERED", "BLOCK_KINDS"]

GATHERED = ("embed", "markov_w1")  # looked up a row per token: never read whole
BLOCK_KINDS = ("dspark", "dflash")  # the drafters whose arrays this arithmetic knows
_UPDATE = ("fc", "hidden_norm", "layers/k_proj", "layers/v_proj", "layers/k_norm")  # the context update's


class Leaf(NamedTuple):
    """One weight array: its elements and bytes, one chip's shard of them, one row's bytes."""

    elems: int
    nbytes: int
    chip_elems: int
    chip_bytes: int
    row_bytes: int


def _key(k) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def named_leaves(tree, shardings=None) -> dict[str, Leaf]:
    """{"layers/0/q_proj": Leaf, ...} for the arrays of `tree` (concrete or ShapeDtypeStructs);
    `shardings`: a tree of the same leaves' shardings where the leaves carry none (nnx states)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    shs = jax.tree.leaves(shardings) if shardings is not None else [getattr(x, "sharding", None) for _, x in flat]
    if len(shs) != len(flat):
        raise ValueError(f"{len(shs)} shardings for {len(flat)} arrays")
    out = {}
    for (path, x), sh in zip(flat, shs):
        name = "/".join(_key(k) for k in path if _key(k) != "value")
        item = np.dtype(x.dtype).itemsize
        elems = int(np.prod(x.shape))
        chip = int(np.prod(sh.shard_shape(x.shape))) if hasattr(sh, "shard_shape") else elems
        out[name] = Leaf(elems, elems * item, chip, chip * item, int(x.shape[-1]) * item if x.shape else item)
    return out


class ModelShapes(NamedTuple):
    """What the arithmetic reads of an engine: its weights by name, the layer shapes, and the KV
    bytes of one row's token (whole and one chip's share)."""

    target: dict  # name -> Leaf, the target's weights as the programs take them (`engine.tp`)
    drafter: dict  # name -> Leaf, the drafter's (`engine.dp`); {} for target-only
    tcfg: ModelConfig
    dcfg: ModelConfig | None  # the drafter's layers
    G: int
    kv: tuple[float, float]  # target KV bytes per row per token: whole, one chip's
    dkv: tuple[float, float]  # the drafter's
    data_frac: float  # the share of the slots (tokens) one chip holds


def _cache_bytes(cache, sharding) -> tuple[float, float]:
    """Bytes of K and V per row per token: whole, and one chip's shard (KV heads and slots split)."""
    k = cache.k
    R, S = k.shape[1], cache.max_len  # dense [L, R, Nkv, S, D]
    item = np.dtype(k.dtype).itemsize
    whole = 2 * int(np.prod(k.shape)) * item
    chip = 2 * int(np.prod(sharding.shard_shape(k.shape))) * item if sharding is not None else whole
    return whole / (R * S), chip / (R * S)


def model_shapes(spec, tp, drafter: dict, state, state_sh=None) -> ModelShapes:
    """The shapes of an engine's programs: `spec` its Spec, `tp` its target weights (arrays, or
    the abstract engine's with shardings), `drafter` its drafter's `named_leaves` ({} for
    target-only), `state` its decode state (`state_sh` its layout on a mesh)."""
    if spec.G and spec.kind.name not in BLOCK_KINDS:
        raise ValueError(f"the roofline arithmetic knows the block drafters ({', '.join(BLOCK_KINDS)}), "
                         f"not {spec.kind.name!r}: use a preset of one of those")
    csh = None if state_sh is None else state_sh.cache.k
    dsh = None if state_sh is None else state_sh.dcache.k
    rows = state.anchor.shape[0]
    frac = 1.0 if state_sh is None else state_sh.anchor.shard_shape(state.anchor.shape)[0] / rows
    return ModelShapes(target=named_leaves(tp), drafter=drafter if spec.G else {}, tcfg=spec.tcfg,
                       dcfg=spec.draft.cfg if spec.G else None, G=spec.G,
                       kv=_cache_bytes(state.cache, csh),
                       dkv=_cache_bytes(state.dcache, dsh) if spec.G else (0.0, 0.0), data_frac=frac)


class Footprint(NamedTuple):
    """The least a program reads and computes: whole and one chip's share."""

    name: str
    tokens: int  # tokens the program's target forward (or the draft) handles usefully
    bytes: float
    chip_bytes: float
    flops: float
    chip_flops: float
    parts: dict  # bytes by what they are (whole program): weights, kv, rows (looked-up table rows)


def _is_product(name: str) -> bool:
    return not (name.endswith("norm") or name.endswith("bias"))


class _Sum(NamedTuple):
    products: float  # product elements: what each token multiplies
    chip_products: float
    row: float  # bytes of one row of each looked-up table


def _sum(leaves: dict, names) -> _Sum:
    names = set(names)
    prod = [v for n, v in leaves.items() if n in names and n not in GATHERED and _is_product(n)]
    rows = [v for n, v in leaves.items() if n in names and n in GATHERED]
    return _Sum(sum(v.elems for v in prod), sum(v.chip_elems for v in prod), sum(v.row_bytes for v in rows))


def _attention(cfg: ModelConfig, key_reads: float) -> float:
    """FLOPs of attention over `key_reads` (query, key) pairs per layer: QK^T and PV."""
    return 4.0 * cfg.num_heads * cfg.head_dim * cfg.num_layers * key_reads


def _target_names(m: ModelShapes, logits: bool):
    return [n for n in m.target if logits or n != "lm_head"]


def _draft_names(m: ModelShapes):
    """The draft's arrays: all the drafter's but the context fusion (`fc`, `hidden_norm`)."""
    return [n for n in m.drafter if n not in _UPDATE[:2]]


def _update_names(m: ModelShapes):
    """The context update's: the fusion and each layer's K / V projection."""
    return [n for n in m.drafter if n in _UPDATE]


def _footprint(m: ModelShapes, name: str, tokens: int, groups, kv: tuple[float, float], attn) -> Footprint:
    """groups: (leaves, names, tokens through them); kv: (bytes whole, chip); attn: [(cfg,
    key reads, chip share)]."""
    weights = chip_w = rows = flops = chip_flops = 0.0
    seen = {}
    for leaves, names, n_tok in groups:
        s = _sum(leaves, names)
        flops += 2.0 * n_tok * s.products
        chip_flops += 2.0 * n_tok * m.data_frac * s.chip_products
        rows += n_tok * s.row
        seen.update({(id(leaves), n): leaves[n] for n in names})  # a weight two groups use is read once
    for (_, n), leaf in seen.items():
        if n not in GATHERED:
            weights, chip_w = weights + leaf.nbytes, chip_w + leaf.chip_bytes
    for cfg, reads, share in attn:
        flops += _attention(cfg, reads)
        chip_flops += _attention(cfg, reads) * share
    return Footprint(name, tokens, weights + rows + kv[0], chip_w + rows * m.data_frac + kv[1], flops, chip_flops,
                     {"weights": weights, "kv": kv[0], "rows": rows})


def _kv(per_token: tuple[float, float], rows: int, fill: int) -> tuple[float, float]:
    return per_token[0] * rows * fill, per_token[1] * rows * fill


def target_step(m: ModelShapes, rows: int, fill: int, name: str = "target_step") -> Footprint:
    """A target-only step: one token per row through every weight, attending to `fill` + 1 keys."""
    return _footprint(m, name, rows, [(m.target, _target_names(m, True), rows)], _kv(m.kv, rows, fill),
                      [(m.tcfg, rows * (fill + 1.0), m.kv[1] / m.kv[0])])


def round_footprint(m: ModelShapes, k: int, g: int, fill: int, name: str) -> Footprint:
    """A round with `k` rows verifying `g` drafts each: the k rows' drafts (G per row; the
    drafter's weights and its context KV), the target over k * (1 + g) tokens attending to
    `fill` + j keys, and the drafter's context update over those tokens."""
    n = k * (1 + g)
    kv_t, kv_d = _kv(m.kv, k, fill), _kv(m.dkv, k, fill)
    groups = [(m.target, _target_names(m, True), n),
              (m.drafter, _draft_names(m), k * m.G),
              (m.drafter, _update_names(m), n)]
    attn = [(m.tcfg, k * ((g + 1) * fill + (g + 1) * (g + 2) / 2), m.kv[1] / m.kv[0]),
            (m.dcfg, k * m.G * (fill + m.G), m.dkv[1] / m.dkv[0])]
    return _footprint(m, name, n, groups, (kv_t[0] + kv_d[0], kv_t[1] + kv_d[1]), attn)


def draft_footprint(m: ModelShapes, rows: int, fill: int, name: str = "draft") -> Footprint:
    """The draft alone: G block tokens per row through the drafter's layers and heads (the frozen
    LM head, the Markov head), attending to the row's `fill` context keys and the block."""
    groups = [(m.drafter, _draft_names(m), rows * m.G)]
    return _footprint(m, name, rows * m.G, groups, _kv(m.dkv, rows, fill),
                      [(m.dcfg, rows * m.G * (fill + m.G), m.dkv[1] / m.dkv[0])])


def prefill_footprint(m: ModelShapes, rows: int, prompt: int, name: str) -> Footprint:
    """A prefill of `prompt`-token prompts in `rows` slots: the first prompt - 1 tokens of each
    through the target's layers (no LM head) attending causally to each other, and (with a
    drafter) the drafter's context update over them."""
    n = rows * (prompt - 1)
    groups = [(m.target, _target_names(m, False), n)]
    if m.G:
        groups.append((m.drafter, _update_names(m), n))
    reads = rows * (prompt - 1) * prompt / 2.0
    return _footprint(m, name, n, groups, (0.0, 0.0), [(m.tcfg, reads, m.kv[1] / m.kv[0])])


def roofline(nbytes: float, flops: float, bandwidth: float, flop_rate: float) -> tuple[float, str]:
    """(seconds, "memory" or "compute"): the longer of reading `nbytes` and doing `flops`."""
    t_mem, t_flop = nbytes / bandwidth, flops / flop_rate
    return (t_mem, "memory") if t_mem >= t_flop else (t_flop, "compute")


# ---------------------------------------------------------------------------- the table


def table_rows(programs, bandwidth: float, flop_rate: float, per_chip: bool = False) -> list[dict]:
    """One row per timed program ({"footprint", "timing"}): its best time beside its roofline at
    these rates (one chip's bytes and FLOPs with `per_chip`)."""
    out = []
    for p in programs:
        fp, t = p["footprint"], p["timing"]
        nbytes, flops = (fp.chip_bytes, fp.chip_flops) if per_chip else (fp.bytes, fp.flops)
        roof, bound = roofline(nbytes, flops, bandwidth, flop_rate)
        out.append({"program": fp.name, "tokens": fp.tokens, "ms": 1e3 * t["best_s"], "median_ms": 1e3 * t["median_s"],
                    "repeats": t["repeats"], "bytes": nbytes, "flops": flops, "roofline_ms": 1e3 * roof,
                    "bound": bound, "ratio": t["best_s"] / roof, "bytes_by_part": dict(fp.parts)})
    return out


def format_table(rows: list[dict], predicted: str | None = None) -> str:
    """The table as text; `predicted` (a marking) replaces the measured columns' names and ends
    every row, as each of its times is the compiler's, not a measurement."""
    time_col = f"{'predicted ms':>14}" if predicted else f"{'best ms':>10}{'median ms':>11}"
    per = "/chip" if predicted else ""
    head = (f"{'program':<15}{'tokens':>7}{time_col}{'MB read' + per:>14}{'GFLOP' + per:>13}{'roofline ms':>13}"
            f"  {'bound':<8}{'ratio':>8}")
    lines = [head + ("  source" if predicted else ""), "-" * (len(head) + (2 + len(predicted) if predicted else 0))]
    for r in rows:
        ms = f"{r['ms']:14.4g}" if predicted else f"{r['ms']:10.4g}{r['median_ms']:11.4g}"
        line = (f"{r['program']:<15}{r['tokens']:>7}{ms}{r['bytes'] / 1e6:14.5g}{r['flops'] / 1e9:13.4g}"
                f"{r['roofline_ms']:13.4g}  {r['bound']:<8}{r['ratio']:8.3g}")
        lines.append(line + (f"  {predicted}" if predicted else ""))
    return "\n".join(lines)


def format_memory(memory: dict) -> str:
    """Each compiled program's `memory_analysis()` in MiB."""
    mib = lambda b: f"{b / 2 ** 20:12.2f}"
    lines = [f"{'compiled program':<16}{'arguments':>12}{'outputs':>12}{'temporaries':>12}{'aliased':>12}  (MiB)"]
    for name, m in memory.items():
        lines.append(f"{name:<16}{mib(m['arguments'])}{mib(m['outputs'])}{mib(m['temporaries'])}{mib(m['aliased'])}")
    return "\n".join(lines)
