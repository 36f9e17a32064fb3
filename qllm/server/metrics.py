"""Server metrics in the Prometheus text exposition format (no client library needed).

The engine thread records into ``ServerMetrics``; ``GET /metrics`` renders it from the event
loop thread. One lock guards both sides.
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)

# CacheRegistry.prefix_cache_stats() keys as metrics qllm_prefix_cache_<key>[_total]
PREFIX_CACHE_METRICS = (
    ("queries", "counter", "Admissions (readmissions included) that looked up the prefix cache."),
    ("query_tokens", "counter", "Tokens of the sequences that looked up the prefix cache."),
    ("hit_tokens", "counter", "Tokens served from the prefix cache."),
    ("recomputed_tokens", "counter",
     "Tokens whose KV blocks were cached but that were recomputed: no recurrent-state "
     "checkpoint reached that far."),
    ("state_checkpoints", "gauge", "Recurrent-state checkpoints held."),
    ("state_checkpoint_capacity", "gauge", "Recurrent-state checkpoint slots."),
    ("state_checkpoints_saved", "counter", "Recurrent-state checkpoints saved."),
    ("state_checkpoints_restored", "counter", "Recurrent-state checkpoints restored at a hit."),
    ("state_checkpoints_evicted", "counter",
     "Recurrent-state checkpoints dropped (LRU, or their KV blocks left the cache)."),
)


class Histogram:
    """Cumulative-bucket histogram of seconds."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, name: str) -> list[str]:
        lines, cumulative = [], 0
        for bound, count in zip((*map(repr, self.buckets), "+Inf"), self.counts):
            cumulative += count
            lines.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
        lines += [f"{name}_sum {self.sum!r}", f"{name}_count {self.count}"]
        return lines


class ServerMetrics:
    """Request, token and latency statistics of one server, plus the engine's last state."""

    def __init__(self):
        self._lock = threading.Lock()
        self.num_running = 0
        self.num_waiting = 0
        self.cache_usage: dict[str, float] = {}
        self.prefix_cache: dict[str, int] = {}  # CacheRegistry.prefix_cache_stats()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: Counter[str] = Counter()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)

    def set_engine_state(self, running: int, waiting: int, cache_usage: dict[str, float]):
        with self._lock:
            self.num_running, self.num_waiting, self.cache_usage = running, waiting, cache_usage

    def set_prefix_cache_stats(self, stats: dict[str, int]) -> None:
        with self._lock:
            self.prefix_cache = dict(stats)

    def request_added(self, num_prompt_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += num_prompt_tokens

    def tokens_generated(self, first_token_latencies: list[float],
                         inter_token_latencies: list[float]) -> None:
        """One engine step's tokens: the first token of some requests, later ones of others."""
        with self._lock:
            self.generation_tokens += len(first_token_latencies) + len(inter_token_latencies)
            for value in first_token_latencies:
                self.ttft.observe(value)
            for value in inter_token_latencies:
                self.itl.observe(value)

    def request_finished(self, reason: str) -> None:
        with self._lock:
            self.finished[reason] += 1

    def render(self) -> str:
        """The Prometheus text format of every metric."""
        with self._lock:
            out: list[str] = []

            def metric(name: str, kind: str, help_text: str, lines: list[str]) -> None:
                out.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *lines])

            metric("qllm_num_requests_running", "gauge", "Sequences in the running batch.",
                   [f"qllm_num_requests_running {self.num_running}"])
            metric("qllm_num_requests_waiting", "gauge", "Sequences waiting to be scheduled.",
                   [f"qllm_num_requests_waiting {self.num_waiting}"])
            metric("qllm_cache_usage_ratio", "gauge", "Fraction of each cache pool in use.",
                   [f'qllm_cache_usage_ratio{{kind="{kind}"}} {usage!r}'
                    for kind, usage in sorted(self.cache_usage.items())])
            for key, kind, help_text in PREFIX_CACHE_METRICS:
                if key in self.prefix_cache:
                    name = f"qllm_prefix_cache_{key}" + ("_total" if kind == "counter" else "")
                    metric(name, kind, help_text, [f"{name} {self.prefix_cache[key]}"])
            metric("qllm_prompt_tokens_total", "counter", "Prompt tokens of accepted requests.",
                   [f"qllm_prompt_tokens_total {self.prompt_tokens}"])
            metric("qllm_generation_tokens_total", "counter", "Tokens generated.",
                   [f"qllm_generation_tokens_total {self.generation_tokens}"])
            metric("qllm_request_finished_total", "counter",
                   "Finished requests (one per choice) by finish reason.",
                   [f'qllm_request_finished_total{{finish_reason="{reason}"}} {count}'
                    for reason, count in sorted(self.finished.items())])
            metric("qllm_time_to_first_token_seconds", "histogram",
                   "Time from arrival to the first generated token.",
                   self.ttft.render("qllm_time_to_first_token_seconds"))
            metric("qllm_inter_token_latency_seconds", "histogram",
                   "Time between consecutive tokens of one request.",
                   self.itl.render("qllm_inter_token_latency_seconds"))
            return "\n".join(out) + "\n"
