"""Prometheus metrics of one server instance.

Each app gets its own ``CollectorRegistry`` (never the process-global one), so several apps in one process (tests,
or a server embedded in another program) do not collide or double count. Counters and histograms are updated by
the engine thread and the HTTP middleware; prometheus-client's metric objects are thread-safe.
"""
from __future__ import annotations

from typing import Any, Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from leapdecode.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.http_requests = Counter("leapdecode_http_requests", "HTTP requests by route and status code",
                                     ["endpoint", "status"], registry=r)
        self.finished = Counter("leapdecode_request_finished", "Engine requests ended, by finish reason "
                                "(per sample: stop, length, abort)", ["finish_reason"], registry=r)
        self.ttft = Histogram("leapdecode_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("leapdecode_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request", buckets=_TPOT_BUCKETS,
                              registry=r)
        self.e2e = Histogram("leapdecode_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=_E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("leapdecode_prompt_tokens", "Prompt tokens of scheduled requests", registry=r)
        self.generation_tokens = Counter("leapdecode_generation_tokens", "Generated tokens", registry=r)
        self.requests_running = Gauge("leapdecode_num_requests_running",
                                      "Requests the engine has started (including preempted ones)", registry=r)
        self.requests_waiting = Gauge("leapdecode_num_requests_waiting",
                                      "Requests accepted but not yet scheduled", registry=r)
        self.kv_blocks_used = Gauge("leapdecode_kv_cache_blocks_used", "KV cache blocks in use", registry=r)
        self.kv_blocks_free = Gauge("leapdecode_kv_cache_blocks_free", "KV cache blocks free", registry=r)
        self.kv_blocks_total = Gauge("leapdecode_kv_cache_blocks_total", "KV cache blocks in the pool", registry=r)
        self.spec_draft_tokens = Counter("leapdecode_spec_draft_tokens", "Draft tokens proposed", registry=r)
        self.spec_accepted_tokens = Counter("leapdecode_spec_accepted_tokens", "Draft tokens accepted", registry=r)

        self.failures = Counter("leapdecode_request_failures", "Requests that failed, by cause (the error code: "
                                "invalid_value, invalid_request, context_length_exceeded, queue_full, "
                                "request_failed, engine_unavailable, preprocessing_timeout, client_gone, ...)",
                                ["cause"], registry=r)
        self.cache_entries = Gauge("leapdecode_cache_entries", "Entries in each bounded cache", ["cache"],
                                   registry=r)
        self.cache_capacity = Gauge("leapdecode_cache_capacity", "Size limit of each bounded cache", ["cache"],
                                    registry=r)

    def watch_caches(self, engine: Any, formatter: Any) -> None:
        """Report the bounded caches' sizes and limits at every scrape (read from the objects that own them)."""
        def sizes() -> dict[str, tuple[Callable[[], int], Callable[[], int]]]:
            out = {"token_text": (lambda: len(formatter._token_text), lambda: formatter.max_cached_tokens)}
            structured = engine.structured
            out["grammar_tries"] = (lambda: len(structured.tries), lambda: _max_asap_tries())
            backend = structured._backend
            if backend is not None and hasattr(backend, "_cache"):
                out["grammar"] = (lambda: len(backend._cache), lambda: backend._cache_size)
            drafter = getattr(getattr(engine, "speculator", None), "drafter", None)
            if drafter is not None and hasattr(drafter, "global_max_tokens") and hasattr(drafter, "_global"):
                out["suffix_global_tokens"] = (lambda: len(drafter._global), lambda: drafter.global_max_tokens)
            return out

        def refresh() -> None:
            for name, (size, limit) in sizes().items():
                try:
                    self.cache_entries.labels(cache=name).set(size())
                    self.cache_capacity.labels(cache=name).set(limit() or 0)
                except Exception:        # an engine-side cache that changed shape: report nothing, never fail
                    pass

        self._refresh_caches = refresh

    def observe_finished(self, out: RequestOutput) -> None:
        """Latency histograms and finish reasons of a request that ran to completion."""
        m = out.metrics
        for c in out.outputs:
            self.finished.labels(finish_reason=c.finish_reason or "unknown").inc()
        if m.first_token_time is not None:
            self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
            num_tokens = max((len(c.token_ids) for c in out.outputs), default=0)
            if m.finished_time is not None:
                self.e2e.observe(max(0.0, m.finished_time - m.arrival_time))
                if num_tokens > 1:
                    self.tpot.observe(max(0.0, m.finished_time - m.first_token_time) / (num_tokens - 1))

    def render(self) -> bytes:
        refresh = getattr(self, "_refresh_caches", None)
        if refresh is not None:
            refresh()
        return generate_latest(self.registry)


def _max_asap_tries() -> int:
    from leapdecode.engine import structured_output
    return getattr(structured_output, "MAX_ASAP_TRIES", 0)
