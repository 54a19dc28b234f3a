"""Trace files: per round and request records of speculative decoding, for calibration and simulation.

One file = one drafter under one sampling setting. ``.npz`` holding the arrays below plus
``meta`` (a JSON string), so a file is self-describing and loads without pickle:

=============  ===========  ====================================================
conf_logits    f32 [N, G]   raw confidence logits z_j of the round's drafts
accepted       int [N]      accepted draft tokens (0..verify_len)
verify_len     int [N]      draft tokens verified (l_r)
full           bool [N]     verified at the full block G (uncensored labels)
request        int [N]      request id
round          int [N]      round index (engine step, or the request's own round)
=============  ===========  ====================================================

``meta``: ``drafter_kind`` (dspark / dflash / eagle3 / mtp1), ``gamma`` (= G),
``sampling`` ({temperature, top_k, top_p}), ``target_fingerprint``,
``drafter_fingerprint``, ``source`` ("engine" or "synthetic: ..."), free extras.

The engine records rounds into :class:`Traces` and :func:`from_engine` turns them into a TraceSet.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dspark_jax.drafter.registry import get_kind

__all__ = ["Traces", "TraceSet", "TraceError", "sampling_key", "save_traces", "load_traces", "recorded_sampling",
           "from_engine", "concat", "synthetic_traces", "SYNTHETIC_PRESETS"]

FORMAT = "dspark_traces/1"
_FIELDS = ("conf_logits", "accepted", "verify_len", "full", "request", "round")


class TraceError(ValueError):
    pass


def sampling_key(sampling) -> str:
    """Canonical key of a sampling setting (dict, SamplingParams or (T, top_k, top_p)):
    ``"T1_k0_p1"``. STS temperatures are stored and looked up under this key."""
    if isinstance(sampling, str):
        return sampling
    d = _sampling_dict(sampling)
    return f"T{d['temperature']:g}_k{d['top_k']}_p{d['top_p']:g}"


def _sampling_dict(sampling) -> dict:
    """{temperature, top_k, top_p} as plain numbers (array leaves: their first entry)."""
    if sampling is None:
        return {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    if isinstance(sampling, dict):
        t, k, p = sampling.get("temperature", 1.0), sampling.get("top_k", 0), sampling.get("top_p", 1.0)
    else:
        t, k, p = tuple(sampling)[:3]
    t, k, p = (float(np.asarray(v).reshape(-1)[0]) for v in (t, k, p))
    return {"temperature": t, "top_k": int(k), "top_p": p}


@dataclass
class TraceSet:
    conf_logits: np.ndarray
    accepted: np.ndarray
    verify_len: np.ndarray
    full: np.ndarray
    request: np.ndarray
    round: np.ndarray
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        self.conf_logits = np.asarray(self.conf_logits, np.float32)
        if self.conf_logits.ndim != 2:
            raise TraceError(f"conf_logits must be [N, G], got shape {self.conf_logits.shape}")
        n, g = self.conf_logits.shape
        for name, dt in (("accepted", np.int64), ("verify_len", np.int64), ("full", bool), ("request", np.int64),
                         ("round", np.int64)):
            v = np.asarray(getattr(self, name)).astype(dt).reshape(-1)
            if v.shape != (n,):
                raise TraceError(f"trace field {name!r} has {v.shape[0]} rows, conf_logits has {n}: "
                                 "every field needs one entry per round and request")
            setattr(self, name, v)
        if n and (self.verify_len.min() < 0 or self.verify_len.max() > g):
            raise TraceError(f"verify_len must lie in 0..{g} (gamma)")
        if n and (np.any(self.accepted < 0) or np.any(self.accepted > self.verify_len)):
            raise TraceError("accepted must lie in 0..verify_len for every row")
        self.meta = dict(self.meta)
        self.meta.setdefault("gamma", g)
        if int(self.meta["gamma"]) != g:
            raise TraceError(f"meta gamma {self.meta['gamma']} != conf_logits width {g}")
        self.meta["sampling"] = _sampling_dict(self.meta.get("sampling"))
        for k in ("drafter_kind", "target_fingerprint", "drafter_fingerprint", "source"):
            self.meta.setdefault(k, None)

    # ------------------------------------------------------------------ views
    def __len__(self) -> int:
        return int(self.accepted.shape[0])

    @property
    def gamma(self) -> int:
        return int(self.conf_logits.shape[1])

    @property
    def sampling(self) -> dict:
        return self.meta["sampling"]

    @property
    def key(self) -> str:
        return sampling_key(self.sampling)

    def select(self, mask) -> "TraceSet":
        m = np.asarray(mask)
        return TraceSet(*(getattr(self, f)[m] for f in _FIELDS), meta=self.meta)

    def full_gamma(self) -> "TraceSet":
        """Only the rounds verified at the full block (the uncensored ones)."""
        return self.select(self.full)

    def tau(self) -> float:
        """Mean accepted length (accepted + 1) over the rounds."""
        return float(np.mean(self.accepted + 1)) if len(self) else float("nan")


class Traces:
    """The engine's per-round recorder (`Engine.generate(traces=True)`); `from_engine` makes a TraceSet of it."""
    def __init__(self, G: int):
        self.G = G
        self._rows: list[tuple] = []

    def add(self, step: int, slot_req: np.ndarray, ro) -> None:
        """One round: `slot_req[r]` = request id in slot r (-1 = empty); `ro` = RoundOut (device arrays)."""
        z, l, acc, act, cut = (np.asarray(x) for x in (ro.z, ro.lengths, ro.accepted, ro.active, ro.cut))
        for r in np.flatnonzero(act):
            self._rows.append((int(slot_req[r]), step, z[r].astype(np.float32), int(l[r]), int(acc[r]), bool(cut[r])))

    def __len__(self) -> int:
        return len(self._rows)

    def arrays(self) -> dict[str, np.ndarray]:
        n, g = len(self._rows), max(self.G, 1)
        z = np.stack([r[2] for r in self._rows]) if n else np.zeros((0, g), np.float32)
        length = np.asarray([r[3] for r in self._rows], np.int64)
        cut = np.asarray([r[5] for r in self._rows], bool)
        # `full`: every one of the G drafts verified and its outcome kept (what STS fits on); a
        # round cut by a stop token or max_new discarded some, which are not rejections
        return {"request": np.asarray([r[0] for r in self._rows], np.int64),
                "round": np.asarray([r[1] for r in self._rows], np.int64),
                "conf_logits": z, "length": length,
                "accepted": np.asarray([r[4] for r in self._rows], np.int64),
                "full": (length == self.G) & ~cut, "cut": cut}

    def save(self, path) -> Path:
        """`.npz` (arrays) or `.jsonl` (one record per round and request)."""
        path = Path(path)
        a = self.arrays()
        if path.suffix == ".npz":
            np.savez(path, **a)
        else:
            with path.open("w") as f:
                for i in range(len(a["length"])):
                    f.write(json.dumps({"request": int(a["request"][i]), "round": int(a["round"][i]),
                                        "conf_logits": [float(x) for x in a["conf_logits"][i]],
                                        "length": int(a["length"][i]), "accepted": int(a["accepted"][i]),
                                        "full": bool(a["full"][i]), "cut": bool(a["cut"][i])}) + "\n")
        return path


def save_traces(path, ts: TraceSet) -> Path:
    path = Path(path)
    if path.suffix != ".npz":
        raise TraceError(f"trace files are .npz, got {path.name!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, meta=np.asarray(json.dumps({"format": FORMAT, **ts.meta})),
             **{f: getattr(ts, f) for f in _FIELDS})
    return path


def load_traces(path, meta: dict | None = None) -> TraceSet:
    """Load a trace file. Also reads the engine's raw ``Traces.save(.npz)`` output (field
    ``length`` instead of ``verify_len``, no ``meta``): pass its ``meta`` then."""
    path = Path(path)
    if not path.exists():
        raise TraceError(f"trace file {path} does not exist")
    with np.load(path, allow_pickle=False) as z:
        d = {k: z[k] for k in z.files}
    m = json.loads(str(d.pop("meta"))) if "meta" in d else {}
    if m.get("format", FORMAT) != FORMAT:
        raise TraceError(f"{path}: unknown trace format {m.get('format')!r} (expected {FORMAT})")
    m.pop("format", None)
    m.update(meta or {})
    if "verify_len" not in d and "length" in d:
        d["verify_len"] = d.pop("length")
    missing = [f for f in _FIELDS if f not in d]
    if missing:
        raise TraceError(f"{path}: trace file lacks field(s) {missing}; "
                         "write it with dspark_jax.calibration.traces.save_traces")
    return TraceSet(*(d[f] for f in _FIELDS), meta=m)


def recorded_sampling(path) -> dict | None:
    """The sampling setting a trace file records, or None (the engine's raw `Traces.save`
    output records none)."""
    with np.load(Path(path), allow_pickle=False) as z:
        meta = json.loads(str(z["meta"])) if "meta" in z.files else {}
    return _sampling_dict(meta["sampling"]) if meta.get("sampling") else None


def from_engine(traces, *, drafter_kind: str, sampling=None, target_fingerprint=None, drafter_fingerprint=None,
                **extra) -> TraceSet:
    """Convert the engine's `Traces` (or its ``arrays()`` dict) to a TraceSet."""
    a = traces.arrays() if hasattr(traces, "arrays") else dict(traces)
    return TraceSet(a["conf_logits"], a["accepted"], a.get("verify_len", a.get("length")), a["full"], a["request"],
                    a["round"], meta={"drafter_kind": drafter_kind, "sampling": _sampling_dict(sampling),
                                      "target_fingerprint": target_fingerprint,
                                      "drafter_fingerprint": drafter_fingerprint, "source": "engine", **extra})


def concat(sets) -> TraceSet:
    """Concatenate trace sets of the same drafter, gamma and sampling (request ids kept apart)."""
    sets = list(sets)
    if not sets:
        raise TraceError("no trace sets to concatenate")
    m0 = sets[0].meta
    for s in sets[1:]:
        for k in ("drafter_kind", "gamma", "sampling", "target_fingerprint", "drafter_fingerprint"):
            if s.meta.get(k) != m0.get(k):
                raise TraceError(f"cannot concatenate traces with different {k}: {m0.get(k)!r} vs {s.meta.get(k)!r}")
    off, parts = 0, []
    for s in sets:
        parts.append(s.request + off)
        off = int(parts[-1].max()) + 1 if len(s) else off
    return TraceSet(np.concatenate([s.conf_logits for s in sets]), np.concatenate([s.accepted for s in sets]),
                    np.concatenate([s.verify_len for s in sets]), np.concatenate([s.full for s in sets]),
                    np.concatenate(parts), np.concatenate([s.round for s in sets]), meta=m0)


# ------------------------------------------------------------------ synthetic traces

SYNTHETIC_PRESETS = {
    # conditional acceptance logit of slot j: mu0 - decay * j + u_request + tok_sd * eps
    "dspark": dict(mu0=2.0, decay=0.10),  # semi-autoregressive head: slow suffix decay
    "dflash": dict(mu0=2.0, decay=0.35),  # parallel block: faster suffix decay (docs/method.md §1)
    "mtp1": dict(mu0=2.0, decay=0.0),
}


def synthetic_traces(n_requests: int = 64, rounds_per_request: int = 64, gamma: int = 7, *, kind: str = "dspark",
                     seed: int = 0, mu0: float | None = None, decay: float | None = None, req_sd: float = 0.8,
                     tok_sd: float = 1.0, conf_scale: float = 1.8, conf_noise: float = 0.5,
                     sampling=None) -> TraceSet:
    """Traces from a parametric acceptance model (every round verified at full gamma).

    Request r has a difficulty ``u_r ~ N(0, req_sd)``, fixed over its rounds. In each round
    the true conditional acceptance logit of slot j is
    ``l_j = mu0 - decay * j + u_r + tok_sd * eps_j`` (eps ~ N(0, 1)); slot j is accepted
    with probability sigmoid(l_j) given slots < j were, so ``accepted`` = the number of
    leading successes. The recorded confidence logit is over-confident and noisy:
    ``z_j = conf_scale * (l_j + conf_noise * eta_j)``, so STS has something to fix
    (T_j near conf_scale) and the ranking is informative but imperfect. ``kind`` picks
    preset mu0 / decay (SYNTHETIC_PRESETS); explicit arguments override them.
    """
    if kind not in SYNTHETIC_PRESETS:
        raise TraceError(f"unknown synthetic kind {kind!r}; choose one of {sorted(SYNTHETIC_PRESETS)}")
    p = dict(SYNTHETIC_PRESETS[kind])
    mu0 = p["mu0"] if mu0 is None else mu0
    decay = p["decay"] if decay is None else decay

    gamma = min(gamma, get_kind(kind).max_gamma or gamma)
    rng = np.random.default_rng(seed)
    n = n_requests * rounds_per_request
    u = np.repeat(rng.normal(0.0, req_sd, n_requests), rounds_per_request)
    ell = mu0 - decay * np.arange(gamma)[None] + u[:, None] + tok_sd * rng.normal(size=(n, gamma))
    ok = rng.random((n, gamma)) < 1.0 / (1.0 + np.exp(-ell))
    accepted = np.cumprod(ok, axis=1).sum(axis=1)
    z = conf_scale * (ell + conf_noise * rng.normal(size=(n, gamma)))
    meta = {"drafter_kind": kind, "gamma": gamma, "sampling": _sampling_dict(sampling),
            "source": (f"synthetic: kind={kind} mu0={mu0} decay={decay} req_sd={req_sd} tok_sd={tok_sd} "
                       f"conf_scale={conf_scale} conf_noise={conf_noise} seed={seed}")}
    return TraceSet(z.astype(np.float32), accepted, np.full(n, gamma), np.ones(n, bool),
                    np.repeat(np.arange(n_requests), rounds_per_request),
                    np.tile(np.arange(rounds_per_request), n_requests),
                    meta=meta)
