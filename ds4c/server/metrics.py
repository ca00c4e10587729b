"""The server's Prometheus metrics (prometheus-client), in a registry of their own (``GET /metrics``).

========================================  =========  ======================================================
name                                      type       what
========================================  =========  ======================================================
``ds4c_requests_total``                   counter    requests by ``endpoint`` and ``outcome``: ``ok``,
                                                     ``length``, ``cancelled`` (the client went away),
                                                     ``timeout``, ``rejected`` (queue full / draining),
                                                     ``invalid`` (4xx), ``slow_client`` (buffer overflow),
                                                     ``failed`` (engine error)
``ds4c_queue_depth``                      gauge      requests admitted, waiting for a sequence slot
``ds4c_running_sequences``                gauge      sequences the engine runs
``ds4c_pages_in_use``                     gauge      KV pages (128 tokens) the running sequences hold
``ds4c_prefix_cache_pages``               gauge      pages the prefix cache holds (``--lanes``)
``ds4c_prefix_reused_tokens``             gauge      prompt positions taken from the prefix cache instead of
                                                     prefilled, since the start (``--lanes``)
``ds4c_prompt_tokens_total``              counter    prompt tokens of generations that ran (counted when
                                                     the engine ends one, also a cancelled one)
``ds4c_generation_tokens_total``          counter    tokens generated (likewise)
``ds4c_time_to_first_token_seconds``      histogram  request arrival to its first text
``ds4c_inter_token_latency_seconds``      histogram  between a request's streamed pieces, per token
``ds4c_request_latency_seconds``          histogram  arrival to the end of an admitted request (every
                                                     outcome but ``rejected`` and ``invalid``)
========================================  =========  ======================================================
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

OUTCOMES = ("ok", "length", "cancelled", "timeout", "rejected", "invalid", "slow_client", "failed")
#: Outcomes of requests that were refused before they ran (no request latency observed).
REFUSED = ("rejected", "invalid")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    """The metric objects (module table), registered in their own :class:`CollectorRegistry`."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("ds4c_requests", "Requests by endpoint and outcome", ["endpoint", "outcome"],
                                registry=r)
        self.queue_depth = Gauge("ds4c_queue_depth", "Requests waiting for a sequence slot", registry=r)
        self.running = Gauge("ds4c_running_sequences", "Sequences the engine runs", registry=r)
        self.pages = Gauge("ds4c_pages_in_use", "KV pages the running sequences hold (128 tokens for DeepSeek-V4-Flash)", registry=r)
        self.prefix_pages = Gauge("ds4c_prefix_cache_pages", "Pages the prefix cache holds", registry=r)
        self.prefix_reused = Gauge("ds4c_prefix_reused_tokens",
                                   "Prompt positions taken from the prefix cache since the start", registry=r)
        self.prompt_tokens = Counter("ds4c_prompt_tokens", "Prompt tokens of requests that ran", registry=r)
        self.generation_tokens = Counter("ds4c_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("ds4c_time_to_first_token_seconds", "Request arrival to its first text",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("ds4c_inter_token_latency_seconds", "Time between tokens of a request",
                             buckets=_ITL_BUCKETS, registry=r)
        self.latency = Histogram("ds4c_request_latency_seconds", "Request arrival to its end",
                                 buckets=_LATENCY_BUCKETS, registry=r)

    def count(self, endpoint: str, outcome: str, seconds: float) -> None:
        """One request of ``endpoint`` ended with ``outcome`` (one of :data:`OUTCOMES`), ``seconds`` after it
        arrived (observed unless it was refused)."""
        assert outcome in OUTCOMES, outcome
        self.requests.labels(endpoint=endpoint, outcome=outcome).inc()
        if outcome not in REFUSED:
            self.latency.observe(seconds)

    def render(self) -> bytes:
        """The exposition text."""
        return generate_latest(self.registry)
