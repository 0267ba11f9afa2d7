"""OpenTelemetry tracing: a span per request, with child spans for the prefix match,
tier loads, prefill and decode. Off by default; on with an OTLP/HTTP endpoint (or an
exporter given in code, as the tests do).

The engine records perf_counter times; `RequestSpans` turns them into the wall-clock
nanoseconds OpenTelemetry wants, so the child spans sit at the times the work happened.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter

if TYPE_CHECKING:
    from ..engine.engine import RequestOutput

log = logging.getLogger("kvheat.server")

# One fixed pairing of the two clocks: wall_ns = _WALL0 + (perf - _PERF0) * 1e9.
_PERF0 = time.perf_counter()
_WALL0 = time.time_ns()


def perf_to_ns(t: float) -> int:
    """A `time.perf_counter()` reading as wall-clock nanoseconds (a span's timestamp)."""
    return _WALL0 + int((t - _PERF0) * 1e9)


class Tracing:
    """Owns this server's TracerProvider (not the global one, so servers do not clash)."""

    def __init__(self, otlp_endpoint: str | None = None, exporter: SpanExporter | None = None,
                 service_name: str = "kvheat") -> None:
        self.provider: TracerProvider | None = None
        if exporter is None and otlp_endpoint:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            endpoint = otlp_endpoint.rstrip("/")
            if not endpoint.endswith("/v1/traces"):
                endpoint += "/v1/traces"
            exporter = OTLPSpanExporter(endpoint=endpoint)
            processor: Any = BatchSpanProcessor(exporter)
        elif exporter is not None:
            processor = SimpleSpanProcessor(exporter)
        if exporter is None:
            self.tracer: trace.Tracer = trace.NoOpTracer()
            return
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("kvheat.server")

    @property
    def enabled(self) -> bool:
        """Whether spans are exported."""
        return self.provider is not None

    def start_request(self, name: str, attributes: dict[str, Any]) -> trace.Span:
        """A request's root span (an invalid one if starting fails)."""
        try:
            return self.tracer.start_span(name, attributes=attributes)
        except Exception:  # tracing must never fail a request
            log.exception("starting a span failed")
            return trace.INVALID_SPAN

    def child(self, parent: trace.Span, name: str, start: float, end: float,
              attributes: dict[str, Any] | None = None) -> None:
        """A finished child span over [start, end] (perf_counter seconds)."""
        if not self.enabled:
            return
        ctx = trace.set_span_in_context(parent)  # errors: the worker's guard counts them
        span = self.tracer.start_span(name, context=ctx, start_time=perf_to_ns(start),
                                      attributes=attributes or {})
        span.end(end_time=perf_to_ns(max(start, end)))

    def request_done(self, span: Any, out: RequestOutput, arm: str, reason: str,
                     prompt_tokens: int, cached: int, match: tuple[float, float, int],
                     tier_load: bool) -> None:
        """Add a finished request's child spans and outcome.

        `match`: when the prefix match ran (start, end) and the tokens it found cached."""
        if span is None or not self.enabled:
            return
        m = out.metrics
        start, end, matched = match
        self.child(span, "prefix_match", start, end,
                   {"kvheat.matched_tokens": matched, "kvheat.prompt_tokens": prompt_tokens})
        if tier_load:
            self.child(span, "tier_load", m.arrival, m.first_token or m.arrival, {})
        if m.first_token is not None:
            self.child(span, "prefill", m.arrival, m.first_token,
                       {"kvheat.cached_tokens": cached,
                        "kvheat.computed_tokens": prompt_tokens - cached,
                        "kvheat.preemptions": m.num_preemptions})
            self.child(span, "decode", m.first_token, m.finished or m.first_token,
                       {"kvheat.generated_tokens": len(out.output_token_ids)})
        span.set_attribute("kvheat.arm", arm)
        span.set_attribute("kvheat.cached_tokens", cached)
        span.set_attribute("kvheat.finish_reason", reason)

    def shutdown(self) -> None:
        """Flush and stop the exporter."""
        if self.provider is not None:
            with contextlib.suppress(Exception):  # a dead collector must not block shutdown
                self.provider.shutdown()


def end_span(span: Any) -> None:
    """End a request span; an exporter that raises must not fail the request."""
    if span is None:
        return
    try:
        span.end()
    except Exception:
        log.exception("ending a span failed")
