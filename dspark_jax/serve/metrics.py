"""Prometheus metrics of the server (`/metrics`), in a registry of its own."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)


class ServerMetrics:
    def __init__(self, gamma: int):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("dspark_requests", "HTTP generation requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.loop_errors = Counter("dspark_request_errors", "requests ended by an error in the engine loop",
                                   registry=r)
        self.tokens_in = Counter("dspark_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.tokens_out = Counter("dspark_generated_tokens", "tokens returned to clients", registry=r)
        self.queue_depth = Gauge("dspark_queue_depth", "requests waiting for a slot", registry=r)
        self.slots_in_use = Gauge("dspark_slots_in_use", "slots holding a request", registry=r)
        self.round_seconds = Histogram("dspark_round_seconds", "wall time of one engine round", registry=r,
                                       buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5))
        self.ttft = Histogram("dspark_time_to_first_token_seconds", "arrival to first token", registry=r,
                              buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30))
        self.accepted_length = Histogram("dspark_accepted_length", "accepted drafts + 1 per slot and round",
                                         registry=r, buckets=tuple(range(1, max(gamma, 1) + 2)))
        self.verified = Counter("dspark_verified_drafts", "drafts verified, by position", ["position"], registry=r)
        self.accepted = Counter("dspark_accepted_drafts", "drafts accepted, by position", ["position"], registry=r)
        self.rounds = Counter("dspark_rounds", "engine rounds by the longest verification length a slot got "
                              "(0: none verified a draft)", ["verified_length"], registry=r)
        self.skipped_rounds = Counter("dspark_skipped_rounds", "rounds that skipped drafting (the skip rule)",
                                      registry=r)
        self.table_verify = Gauge("dspark_cost_table_verify_seconds", "the scheduler's price of verifying a "
                                  "bucket: measured, then following the rounds' times", ["bucket"], registry=r)
        self.table_updates = Gauge("dspark_cost_table_updates", "times the rounds moved the cost table",
                                   registry=r)

    def cost_table(self, live) -> None:
        """The scheduler's table as the rounds keep it (engine/live_costs.py `LiveTable`)."""
        for b, t in zip(live.priced, live.t_verify):
            self.table_verify.labels(str(b)).set(float(t))
        self.table_updates.set(live.updates)

    def round(self, seconds: float, accepted, lengths, in_use, gamma: int, drafted: bool | None = None) -> None:
        self.round_seconds.observe(seconds)
        used = [int(lengths[s]) for s, u in enumerate(in_use) if u]
        self.rounds.labels(str(max(used, default=0))).inc()
        if drafted is False and gamma:
            self.skipped_rounds.inc()
        for s, used in enumerate(in_use):
            if not used:
                continue
            self.accepted_length.observe(int(accepted[s]) + 1)
            for j in range(int(lengths[s])):
                self.verified.labels(str(j + 1)).inc()
                if j < int(accepted[s]):
                    self.accepted.labels(str(j + 1)).inc()

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def render(self, queue_depth: int, slots_in_use: int) -> bytes:
        self.queue_depth.set(queue_depth)
        self.slots_in_use.set(slots_in_use)
        return generate_latest(self.registry)
