"""Prometheus metrics of `kvheat route`: one registry per router, and each replica's
labelled children looked up once (a `labels()` call takes a lock and builds a tuple; the
proxy path touches six of them per request)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
            10.0, 30.0)


EVENT_ERRORS = ("bad", "handler_errors", "restarts", "timeouts", "overflows")


@dataclass(slots=True)
class ReplicaMetrics:
    """The children of one replica's labels, in the order the proxy path uses them."""

    prompt_tokens: Counter
    expected_hit_tokens: Counter
    cached_tokens: Counter
    ttft: Histogram
    stream_errors: Counter


if TYPE_CHECKING:
    from ..server.netsignals import NetSignalsCollector


class RouterMetrics:
    """The router's Prometheus metrics, in a registry of its own."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.net_signals: NetSignalsCollector | None = None  # see watch_network
        self.requests = Counter("kvheat_router_requests", "Requests answered, by endpoint and "
                                "HTTP status.", ["endpoint", "status"], registry=r)
        self.decisions = Counter("kvheat_router_decisions", "Routing decisions, by replica, "
                                 "mode (affinity, home, shard, balance, overload, ...) and "
                                 "entropy regime.", ["replica", "mode", "regime"], registry=r)
        self.decision_seconds = Histogram("kvheat_router_decision_seconds", "Time to key the "
                                          "prompt and choose a replica.", buckets=_LATENCY,
                                          registry=r)
        self.prompt_tokens = Counter("kvheat_router_prompt_tokens", "Prompt tokens routed.",
                                     ["replica"], registry=r)
        self.expected_hit_tokens = Counter("kvheat_router_expected_hit_tokens", "Prompt "
                                           "tokens the index expected cached where routed.",
                                           ["replica"], registry=r)
        self.cached_tokens = Counter("kvheat_router_cached_tokens", "Prompt tokens the "
                                     "replicas reported served from cache (usage).",
                                     ["replica"], registry=r)
        self.failovers = Counter("kvheat_router_failovers", "Requests moved to another "
                                 "replica, by reason.", ["reason"], registry=r)
        self.stream_errors = Counter("kvheat_router_stream_errors", "Streams ended with an "
                                     "error event because their replica failed mid-stream.",
                                     ["replica"], registry=r)
        self.ttft = Histogram("kvheat_router_time_to_first_byte_seconds", "From routing to "
                              "the replica's first response bytes.", ["replica"],
                              buckets=_LATENCY, registry=r)
        self.healthy = Gauge("kvheat_router_replica_healthy", "1 when the replica is in "
                             "rotation.", ["replica"], registry=r)
        self.cluster_entropy = Gauge("kvheat_router_cluster_entropy_bits", "Entropy of the "
                                     "routed prompts' depth-1 keys over about 1024 requests "
                                     "(what the replicas' eviction regime is told).",
                                     registry=r)
        self.in_flight = Gauge("kvheat_router_replica_in_flight", "Requests in flight.",
                               ["replica"], registry=r)
        self.index_blocks = Gauge("kvheat_router_index_blocks", "Blocks the index holds per "
                                  "replica and place.", ["replica", "place"], registry=r)
        self.event_batches = Gauge("kvheat_router_event_batches", "KV event batches "
                                   "received from the replica.", ["replica"], registry=r)
        self.event_resets = Gauge("kvheat_router_event_resets", "Times the replica's view "
                                  "was reset (lost events, restarts).", ["replica"], registry=r)
        self.events_flowing = Gauge("kvheat_router_replica_events_flowing", "1 when the "
                                    "replica's KV events arrive; 0 when it answered requests "
                                    "and none came within the grace time (routing is blind "
                                    "to its cache).", ["replica"], registry=r)
        self.event_errors = Gauge("kvheat_router_event_errors", "KV event failures per "
                                  "replica, by kind (bad batch, handler error, subscription "
                                  "restart, catch-up timeout, batch dropped on a full "
                                  "inbox).", ["replica", "kind"], registry=r)
        self.index_overflows = Counter("kvheat_router_index_overflows", "Times the prefix "
                                       "index met a bound (a replica's blocks, its tier "
                                       "names, sets or ranks): oldest blocks forgotten, or "
                                       "the replica resynced.", registry=r)
        self.blind_routes = Counter("kvheat_router_blind_routes", "Requests routed by load "
                                    "alone because --require-events and some replica's "
                                    "events do not arrive yet.", registry=r)
        self.refused = Counter("kvheat_router_refused", "Requests answered 503 because the "
                               "router held its most requests, or body bytes, in flight.",
                               registry=r)
        self.concurrency_refused = Counter(
            "kvheat_router_concurrency_refused", "HTTP requests answered 503 before their "
            "body was read because max_concurrent_requests were open.", registry=r)
        self.prewarms = Counter("kvheat_router_prewarms", "Hot prefixes sent to replicas "
                                "that lacked them.", ["replica"], registry=r)
        self._replicas: dict[str, ReplicaMetrics] = {}
        self._decisions: dict[tuple[str, str, str], Counter] = {}
        self._requests: dict[tuple[str, str], Counter] = {}

    def watch_network(self, upstreams: Callable[[], Iterable[tuple[str, int, str]]],
                      ebpf: bool = True) -> None:
        """Add kernel network signals per peer (the replicas: `upstreams`), read at scrape time.

        See kvheat/server/netsignals.py; `ebpf`: retransmits from eBPF too."""
        from ..server.netsignals import NetSignalsCollector

        self.net_signals = NetSignalsCollector(upstreams, ebpf=ebpf)
        self.registry.register(self.net_signals)

    def close(self) -> None:
        """Stop what the metrics started (the network signals' eBPF tracer)."""
        if self.net_signals is not None:
            self.net_signals.close()

    def of(self, replica: str) -> ReplicaMetrics:
        """The metrics of `replica` (made on first use)."""
        m = self._replicas.get(replica)
        if m is None:
            m = self._replicas[replica] = ReplicaMetrics(
                self.prompt_tokens.labels(replica), self.expected_hit_tokens.labels(replica),
                self.cached_tokens.labels(replica), self.ttft.labels(replica),
                self.stream_errors.labels(replica))
        return m

    def decision(self, replica: str, mode: str, regime: str) -> Counter:
        """The decisions counter of (replica, mode, regime), made on first use."""
        key = (replica, mode, regime)
        c = self._decisions.get(key)
        if c is None:
            c = self._decisions[key] = self.decisions.labels(replica, mode, regime)
        return c

    def answered(self, endpoint: str, status: int) -> None:
        """Count a request answered on `endpoint` with `status`."""
        key = (endpoint, str(status))
        c = self._requests.get(key)
        if c is None:
            c = self._requests[key] = self.requests.labels(*key)
        c.inc()

    def forget(self, replica: str) -> None:
        """`replica` left: its gauges go (its counters stay, as Prometheus expects)."""
        self._replicas.pop(replica, None)
        self._decisions = {k: v for k, v in self._decisions.items() if k[0] != replica}
        for g in (self.healthy, self.in_flight, self.event_batches, self.event_resets,
                  self.events_flowing):
            with contextlib.suppress(KeyError):
                g.remove(replica)
        for kind in EVENT_ERRORS:
            with contextlib.suppress(KeyError):
                self.event_errors.remove(replica, kind)
