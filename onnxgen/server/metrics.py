"""The server's counters in Prometheus' text exposition format (GET /metrics).

Written here rather than taken from prometheus_client: a handful of series, no registry, no
process-wide state (each app has its own ``Metrics``, so in-process test servers do not share
counts). Every update happens on the event loop's thread, so nothing needs a lock.

Series: requests by endpoint and status, prompt and generated tokens (and of the prompt tokens,
those reused; for a hybrid decoder, the state snapshots its prefix reuse restored and took), the
queue depth and running requests (read from the scheduler at each scrape), time to first token and the time between a
request's consecutive tokens (histograms, seconds, measured where the engine produced the tokens).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

PREFIX = "onnxgen"
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and abs(value) < 2**53 else repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...]) -> None:  # noqa: A002
        self.name, self.help, self.buckets = name, help, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bucket (+Inf only)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for bound, count in zip(self.buckets, self.counts):
            total += count
            lines.append(f'{self.name}_bucket{{le="{_number(bound)}"}} {total}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines += [f"{self.name}_sum {repr(self.sum)}", f"{self.name}_count {self.count}"]
        return lines


class Metrics:
    """The counters of one server. ``queue_depth`` and ``running`` are read at each scrape."""

    def __init__(self, queue_depth: Callable[[], int] = lambda: 0, running: Callable[[], int] = lambda: 0) -> None:
        self.queue_depth = queue_depth
        self.running = running
        self.requests: dict[tuple[str, int], int] = {}
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.state_snapshot_hits = 0
        self.state_snapshot_takes = 0
        self.generation_tokens = 0
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "Request arrival to its first token.", TTFT_BUCKETS
        )
        self.per_token = Histogram(
            f"{PREFIX}_time_per_output_token_seconds", "Time between a request's consecutive tokens.", TOKEN_BUCKETS
        )
        self.duration = Histogram(
            f"{PREFIX}_request_duration_seconds", "Request arrival to the end of its response.", DURATION_BUCKETS
        )

    def count_request(self, endpoint: str, status: int) -> None:
        key = (endpoint, status)
        self.requests[key] = self.requests.get(key, 0) + 1

    def render(self) -> str:
        lines = [
            f"# HELP {PREFIX}_requests_total HTTP requests answered, by endpoint and status.",
            f"# TYPE {PREFIX}_requests_total counter",
        ]
        for (endpoint, status), count in sorted(self.requests.items()):
            lines.append(f'{PREFIX}_requests_total{{endpoint="{_escape(endpoint)}",status="{status}"}} {count}')
        for name, help_text, value, kind in (
            ("prompt_tokens_total", "Prompt tokens of the generations run.", self.prompt_tokens, "counter"),
            (
                "prompt_tokens_cached_total",
                "Prompt tokens whose KV was reused (prefix caching).",
                self.cached_prompt_tokens,
                "counter",
            ),
            (
                "prefix_state_snapshot_hits_total",
                "Prompts whose reused prefix's carried states came from a state snapshot (hybrid decoders).",
                self.state_snapshot_hits,
                "counter",
            ),
            (
                "prefix_state_snapshots_taken_total",
                "State snapshots taken after a shared prompt prefix (hybrid decoders).",
                self.state_snapshot_takes,
                "counter",
            ),
            ("generation_tokens_total", "Tokens generated and handed out.", self.generation_tokens, "counter"),
            ("queue_depth", "Requests waiting for the engine.", self.queue_depth(), "gauge"),
            ("requests_running", "Requests being decoded.", self.running(), "gauge"),
        ):
            lines += [f"# HELP {PREFIX}_{name} {help_text}", f"# TYPE {PREFIX}_{name} {kind}"]
            lines.append(f"{PREFIX}_{name} {_number(value)}")
        for histogram in (self.ttft, self.per_token, self.duration):
            lines += histogram.render()
        return "\n".join(lines) + "\n"
