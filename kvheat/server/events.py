"""The server's KV events: every arm's cache and tiers published on one ZMQ socket.

Each arm is its own engine, published as a data-parallel rank (its index among the
arms). An engine rebuilt after a failure, or one that found KV on disk or in Redis at
start, is announced by a resync (AllBlocksCleared, then a snapshot taken on the engine
thread between steps). The listeners only queue tuples (kvheat.kvevents), so the engine
loop never waits on a socket; the counters are read at scrape time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..kvevents import KVEventPublisher, PublisherConfig, attach, snapshot_items
from ..kvevents.secret import SECRET_ENV, EventSecret
from .config import ServerConfig

log = logging.getLogger("kvheat.server")


class ServerEvents:
    """The server's KV event publisher, one event rank per arm."""

    def __init__(self, config: ServerConfig, arms: Sequence[str]) -> None:
        assert config.kv_events_endpoint is not None
        self.arms = list(arms)
        self.block_size = config.block_size
        self.arm_configs = config.arm_list
        secret = EventSecret.resolve(config.kv_events_secret)
        self.config = PublisherConfig(endpoint=config.kv_events_endpoint,
                                      replay_endpoint=config.kv_events_replay_endpoint,
                                      topic=config.kv_events_topic,
                                      token_ids=config.kv_events_token_ids,
                                      max_queue_size=config.kv_events_queue,
                                      buffer_bytes=int(config.kv_events_buffer_bytes),
                                      secret=secret)
        if not secret.configured:
            log.warning("KV events: no events secret (kv_events_secret or %s): their keys "
                        "are keyed for this process alone, so no router can use them",
                        SECRET_ENV)
        self._engines: dict[str, Any] = {}
        self._call: Callable[[Callable[[], Any]], Any] | None = None
        self.publisher = KVEventPublisher(self.config, snapshot=self._snapshot)

    def bind_worker(self, call: Callable[[Callable[[], Any]], Any]) -> None:
        """`call(fn)` runs fn on the engine thread and returns a Future (EngineWorker.call)."""
        self._call = call

    def engine_built(self, arm: str, engine: Any) -> None:
        """Publish this (new) engine's changes; tell subscribers what it holds now."""
        self._engines[arm] = engine
        attach(self.publisher, engine.cache, engine.tiers,
               rank=self.arms.index(arm))
        self.publisher.request_resync()

    def _snapshot(self) -> list[tuple]:
        def build() -> list[tuple]:
            out: list[tuple] = []
            for arm, eng in list(self._engines.items()):
                out += snapshot_items(eng.cache, eng.tiers,
                                      self.arms.index(arm), self.config.token_ids)
            return out

        call = self._call
        if call is None:
            return build()  # before the engine loop runs nothing else touches the caches
        try:
            return call(build).result(self.config.snapshot_timeout_s)
        except RuntimeError:  # the loop is not running (start-up, shutdown): nothing moves
            return build()

    def info(self) -> dict[str, Any]:
        """What `GET /kv_events` answers: the endpoints, the keys' form and the arms."""
        p = self.publisher
        return {"endpoint": p.endpoint, "replay_endpoint": p.replay_endpoint,
                "port": _port(p.endpoint), "replay_port": _port(p.replay_endpoint),
                "topic": self.config.topic, "block_size": self.block_size,
                "hash": "kvheat-xxh3-128/blake2b-keyed", "token_ids": self.config.token_ids,
                "authenticated": p.authenticated,
                "ranks": {arm: i for i, arm in enumerate(self.arms)},
                # What `kvheat route` needs to key a request as the arm it reaches does.
                "arms": [{"name": a.name, "rank": i, "share": a.share,
                          "prefix_caching": a.prefix_caching}
                         for i, a in enumerate(self.arm_configs)]}

    def close(self) -> None:
        """Stop the publisher."""
        self.publisher.close()


def _port(endpoint: str | None) -> int | None:
    if not endpoint or not endpoint.startswith("tcp://"):
        return None
    try:
        return int(endpoint.rsplit(":", 1)[1])
    except ValueError:
        return None


class EventsCollector(Collector):
    """The publisher's counters, read when Prometheus scrapes."""

    def __init__(self, events: ServerEvents) -> None:
        self.events = events

    def collect(self) -> Iterator[Any]:
        """The publisher's counters as Prometheus metrics."""
        st = self.events.publisher.stats
        c = CounterMetricFamily("kvheat_kv_events", "KV events by outcome (sent, dropped on a "
                                "full queue).", labels=["outcome"])
        c.add_metric(["sent"], st.events)
        c.add_metric(["dropped"], st.dropped)
        yield c
        b = CounterMetricFamily("kvheat_kv_event_batches", "KV event batches sent.")
        b.add_metric([], st.batches)
        yield b
        r = CounterMetricFamily("kvheat_kv_event_resyncs", "Snapshots sent (after drops, an "
                                "engine rebuilt, or asked for by a subscriber).")
        r.add_metric([], st.resyncs)
        yield r
        e = CounterMetricFamily("kvheat_kv_event_errors", "Failures in the event thread.")
        e.add_metric([], st.errors)
        yield e
        q = GaugeMetricFamily("kvheat_kv_events_queued", "KV events waiting to be sent.")
        q.add_metric([], self.events.publisher.queued)
        yield q
