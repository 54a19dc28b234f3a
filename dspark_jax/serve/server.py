"""A ready server from a configuration: models loaded (serve/models.py), the engine and its loop
started, the limits resolved from the context length, the app made (serve/app.py). What
`python -m dspark_jax serve`, the serving benchmark and the tests start; running it is
serve/run.py."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import jax

from dspark_jax.calibration.calibrate import load_temperatures, stored_temperatures
from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.engine.config import AUTO
from dspark_jax.scheduler.costs import load_cost_table
from dspark_jax.serve.app import make_app
from dspark_jax.serve.defaults import SERVE_PREFILL_CHUNK
from dspark_jax.serve.loop import EngineLoop
from dspark_jax.serve.metrics import ServerMetrics
from dspark_jax.serve.models import ServedModels, load_served_models
from dspark_jax.serve.served import Access, Limits, Served


@dataclass
class ServerConfig:
    """Everything `build` needs besides the model directories (the `serve` command's flags).
    `policy` / `skip_drafting` "auto": the drafter kind's scheduling (engine/config.py), on a cost
    table the engine measures itself unless `costs` names one. `calibrated`: the STS fit at that
    sampling temperature; "auto": the drafter's stored fit at temperature 1 when it has one;
    None: no STS. `prefill_chunk`:
    joining requests' prompts ride in the rounds (None / 0: whole prefills). `warmup`: compile
    the engine's programs before /health says "ok". `header_timeout` / `body_timeout`: seconds
    a client may take to send a request's headers / its body (serve/timeouts.py)."""

    policy: str = "auto"
    threshold: float = 0.0
    costs: str | None = None
    calibrated: float | str | None = "auto"
    slots: int = 8
    max_len: int = 1024
    max_queue: int = 64
    model_name: str | None = None
    dtype: str = "float32"
    mesh: object = None
    skip_drafting: bool | str | None = "auto"
    kv_pages: tuple[int, int] | None = None
    prefill_chunk: int | None = SERVE_PREFILL_CHUNK
    warmup: bool = False
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    docs: bool = False
    max_body_bytes: int | None = None  # default: max(4 MiB, 8 x max_prompt_chars)
    max_prompt_chars: int | None = None  # default: max(65536, 32 x max_len)
    max_messages: int = 2048
    header_timeout: float = 30.0
    body_timeout: float = 60.0

    def check(self) -> None:
        for name, seconds in (("--header-timeout", self.header_timeout), ("--body-timeout", self.body_timeout)):
            if not seconds > 0:
                raise ValueError(f"{name} must be a number of seconds > 0, got {seconds}")

    def limits(self, max_len: int) -> Limits:
        chars = int(self.max_prompt_chars or max(65536, 32 * max_len))
        return Limits(max_body_bytes=int(self.max_body_bytes or max(4 << 20, 8 * chars)), max_prompt_chars=chars,
                      max_messages=int(self.max_messages), header_timeout=float(self.header_timeout),
                      body_timeout=float(self.body_timeout))

    def access(self) -> Access:
        return Access(api_key=self.api_key or None, cors_origins=tuple(self.cors_origins), docs=bool(self.docs))


def build(target=None, drafter=None, config: ServerConfig | None = None, **fields):
    """(FastAPI app, Served): models loaded, loop thread started (with `warmup`, compiling the
    engine's programs first: /health says "starting" until then; else they compile on first use).
    `target`: a checkpoint directory (None: the embedded target). `drafter`: a directory, "none",
    or None (one trained for this target, else none). `fields` override `config`'s."""
    cfg = dataclasses.replace(config or ServerConfig(), **fields)
    cfg.check()
    models = load_served_models(target, drafter, cfg.dtype, cfg.mesh)
    if cfg.calibrated not in (None, AUTO) and models.drafter_dir is None:
        raise ValueError("--calibrated reads the drafter's STS temperatures: it needs a drafter")
    tok = models.target.require_tokenizer()
    max_len = min(int(cfg.max_len), models.target.cfg.max_position_embeddings)
    loop, metrics = _start_loop(models, cfg, max_len)
    served = Served(loop, tok, models.target.chat_template, cfg.model_name or Path(str(models.target.path)).name,
                    metrics, cfg.limits(max_len))
    eng = loop.engine
    served.about = {"drafter": models.drafter_dir, "drafter_why": models.why, "policy": eng.scheduling,
                    "costs": f"given: {cfg.costs}" if cfg.costs else eng.table_source}
    return make_app(served, cfg.access()), served


def _start_loop(models: ServedModels, cfg: ServerConfig, max_len: int) -> tuple[EngineLoop, ServerMetrics]:
    """The engine over `models` as `cfg` asks (`max_len`: context per slot), its loop started."""
    lt = models.target
    table = load_cost_table(cfg.costs, expect_backend=jax.default_backend()) if cfg.costs else None
    sts = None
    if cfg.calibrated == AUTO:
        sts = stored_temperatures(models.drafter_dir, SamplingParams(1.0, 0, 1.0))
    elif cfg.calibrated is not None:
        sts = load_temperatures(models.drafter_dir, SamplingParams(float(cfg.calibrated), 0, 1.0))
    config = EngineConfig(num_slots=cfg.slots, max_len=max_len, policy=cfg.policy, skip_drafting=cfg.skip_drafting,
                          kv_pages=cfg.kv_pages, prefill_chunk=cfg.prefill_chunk or None)
    eng = Engine(lt.model, models.drafter, config, table=table, mesh=cfg.mesh)
    metrics = ServerMetrics(eng.G)
    loop = EngineLoop(eng, max_queue=cfg.max_queue, metrics=metrics, threshold=cfg.threshold, sts=sts,
                      warmup=cfg.warmup).start()
    return loop, metrics
