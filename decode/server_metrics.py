"""The server's Prometheus metrics (prometheus-client), every request metric labelled by A/B arm.

Arms: "spec" (speculative decoding) and "plain" (the same engine and batch, nothing drafted), so one
scrape compares TTFT, TPOT and tokens/s with and without speculation on the same traffic. Each server
has its own registry (tests run several in one process).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

ARMS = ("spec", "plain")
WINDOW = 10_000  # requests the summary's quantiles cover (the latest; the histograms keep everything)
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10, 30, 60)
disable_created_metrics()  # no *_created series: they double the scrape and say nothing a server reader needs

TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.5, 1)


@dataclass
class ArmTotals:
    """Plain sums behind the summary endpoint and log line (Prometheus keeps the same, labelled)."""

    requests: int = 0
    completion_tokens: int = 0
    decode_tokens: int = 0  # tokens after the first (TPOT's numerator)
    decode_s: float = 0.0  # time after the first token
    ttft_s: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    tpot_s: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    steps: int = 0
    step_tokens: int = 0  # tokens the verify steps appended (tau's numerator)
    drafted: int = 0
    accepted: int = 0
    drafted_at: list[int] = field(default_factory=list)  # per position (1-based at index 0)
    accepted_at: list[int] = field(default_factory=list)

    def summary(self) -> dict:
        def quantile(values, q):
            ordered = sorted(values)
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None

        return {
            "requests": self.requests, "completion_tokens": self.completion_tokens,
            # one request's speed after its first token (1 / mean TPOT): the arms share the batch, so this is
            # what speculation changes for each of them
            "request_tokens_per_s": self.decode_tokens / self.decode_s if self.decode_s > 0 else None,
            "tpot_s_mean": self.decode_s / self.decode_tokens if self.decode_tokens else None,
            "ttft_s_p50": quantile(self.ttft_s, 0.5), "ttft_s_p99": quantile(self.ttft_s, 0.99),
            "tpot_s_p50": quantile(self.tpot_s, 0.5), "tpot_s_p99": quantile(self.tpot_s, 0.99),
            "tau": self.step_tokens / self.steps if self.steps else None,
            "drafted": self.drafted, "accepted": self.accepted,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
            "acceptance_by_position": [a / d if d else None for a, d in zip(self.accepted_at, self.drafted_at)],
        }


class ServerMetrics:
    """Everything /metrics exposes; the engine worker calls `step`, `finished`, `set_load` and `set_memory`."""

    def __init__(self):
        self.registry = registry = CollectorRegistry()
        self.totals = {arm: ArmTotals() for arm in ARMS}

        def metric(kind, name, doc, labels=(), **kw):
            return kind(f"specdraft_{name}", doc, labels, registry=registry, **kw)

        self.requests = metric(Counter, "requests", "Requests finished, by arm and finish reason",
                               ("arm", "finish_reason"))
        self.errors = metric(Counter, "request_errors", "Requests refused or failed, by HTTP status", ("status",))
        self.prompt_tokens = metric(Counter, "prompt_tokens", "Prompt tokens of finished requests", ("arm",))
        self.generation_tokens = metric(Counter, "generation_tokens", "Tokens generated", ("arm",))
        self.steps = metric(Counter, "verify_steps", "Target verify steps a request took part in", ("arm",))
        self.drafted = metric(Counter, "drafted_tokens", "Drafted tokens verified", ("arm",))
        self.accepted = metric(Counter, "accepted_tokens", "Drafted tokens accepted", ("arm",))
        self.drafted_at = metric(Counter, "drafted_at_position", "Steps that verified a drafted token at this position",
                                 ("arm", "position"))
        self.accepted_at = metric(Counter, "accepted_at_position", "Steps that accepted the drafted token at this position",
                                  ("arm", "position"))
        self.fallbacks = metric(Counter, "fallback_steps",
                                "Steps of speculative requests that drafted nothing (the scheduler or backoff decided)",
                                ("arm",))
        self.acceptance = metric(Gauge, "acceptance_rate", "Accepted / drafted tokens so far", ("arm",))
        self.tau = metric(Gauge, "mean_accepted_length", "Mean tokens per verify step (tau) so far", ("arm",))
        self.admitted = metric(Histogram, "step_admitted_positions",
                               "Drafted positions verified per engine step (all requests of the step)",
                               buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128))
        self.batch_rows = metric(Histogram, "step_batch_rows", "Requests in an engine step",
                                 buckets=(1, 2, 4, 8, 16, 32, 64))
        self.ttft = metric(Histogram, "ttft_seconds", "Time to first token (queue wait included)", ("arm",),
                           buckets=LATENCY_BUCKETS)
        self.tpot = metric(Histogram, "tpot_seconds", "Time per output token after the first, per request", ("arm",),
                           buckets=TPOT_BUCKETS)
        self.e2e = metric(Histogram, "request_seconds", "Request latency from arrival to the last token", ("arm",),
                          buckets=LATENCY_BUCKETS)
        self.queue_depth = metric(Gauge, "queue_depth", "Requests waiting for a slot")
        self.running = metric(Gauge, "running_requests", "Requests in the running batch")
        self.memory = metric(Gauge, "memory_bytes", "Memory by part: target weights, the fast backend's packed "
                             "copies, drafter weights, KV cache", ("part",))
        for arm in ARMS:  # every arm's series exists from the start (a scrape shows zeros, not gaps)
            for child in (self.prompt_tokens, self.generation_tokens, self.steps, self.drafted, self.accepted,
                          self.fallbacks, self.ttft, self.tpot, self.e2e):
                child.labels(arm)
            self.acceptance.labels(arm).set_function(lambda arm=arm: self._rate(arm))
            self.tau.labels(arm).set_function(lambda arm=arm: self._tau(arm))

    def _rate(self, arm: str) -> float:
        totals = self.totals[arm]
        return totals.accepted / totals.drafted if totals.drafted else 0.0

    def _tau(self, arm: str) -> float:
        totals = self.totals[arm]
        return totals.step_tokens / totals.steps if totals.steps else 0.0

    def step(self, arm: str, drafted: int, accepted: int, tokens: int, speculating: bool) -> None:
        """One request's part of a verify step."""
        totals = self.totals[arm]
        totals.steps += 1
        totals.step_tokens += tokens
        self.steps.labels(arm).inc()
        self.generation_tokens.labels(arm).inc(tokens)
        if speculating and drafted == 0:
            self.fallbacks.labels(arm).inc()
        if drafted:
            totals.drafted += drafted
            totals.accepted += accepted
            self.drafted.labels(arm).inc(drafted)
            self.accepted.labels(arm).inc(accepted)
            while len(totals.drafted_at) < drafted:
                totals.drafted_at.append(0)
                totals.accepted_at.append(0)
            for position in range(1, drafted + 1):
                totals.drafted_at[position - 1] += 1
                self.drafted_at.labels(arm, str(position)).inc()
                if position <= accepted:
                    totals.accepted_at[position - 1] += 1
                    self.accepted_at.labels(arm, str(position)).inc()

    def first_token(self, arm: str) -> None:
        self.generation_tokens.labels(arm).inc()

    def engine_step(self, rows: int, admitted: int) -> None:
        self.batch_rows.observe(rows)
        self.admitted.observe(admitted)

    def finished(self, arm: str, finish_reason: str, prompt_tokens: int, completion_tokens: int,
                 ttft_s: float | None, total_s: float) -> None:
        """A request ended; ttft_s (None: no token came) and total_s from its arrival. Latencies count only
        requests that ran to their end (stop or length), not cancelled, timed-out or failed ones."""
        totals = self.totals[arm]
        totals.requests += 1
        totals.completion_tokens += completion_tokens
        self.requests.labels(arm, finish_reason).inc()
        self.prompt_tokens.labels(arm).inc(prompt_tokens)
        if finish_reason not in ("stop", "length") or ttft_s is None:
            return
        self.ttft.labels(arm).observe(ttft_s)
        totals.ttft_s.append(ttft_s)
        self.e2e.labels(arm).observe(total_s)
        if completion_tokens > 1:
            decode_s = max(total_s - ttft_s, 0.0)
            tpot = decode_s / (completion_tokens - 1)
            self.tpot.labels(arm).observe(tpot)
            totals.tpot_s.append(tpot)
            totals.decode_tokens += completion_tokens - 1
            totals.decode_s += decode_s

    def set_load(self, waiting: int, running: int) -> None:
        self.queue_depth.set(waiting)
        self.running.set(running)

    def set_memory(self, part: str, nbytes: int) -> None:
        self.memory.labels(part).set(nbytes)

    def summary(self) -> dict:
        return {arm: totals.summary() for arm, totals in self.totals.items()}

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
