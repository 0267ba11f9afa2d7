"""The replicas behind `kvheat route`: who they are, whether they are in rotation (health
checks), where their KV events come from, and how they join and leave (the admin API or
DNS discovery)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from ..kvevents import KVEventSubscriber
from ..kvevents.secret import EventSecret
from .config import ReplicaSpec, RouterConfig
from .index import DEVICE, LOCAL_TIER, SHARED_TIER, PrefixIndex
from .keys import ArmLayout
from .metrics import EVENT_ERRORS, RouterMetrics
from .routing import ReplicaState, RoutingPolicy

log = logging.getLogger("kvheat.router")
_MAX_INFO_BYTES = 64 << 10  # the largest /kv_events answer read
_PLACES = ((DEVICE, "device"), (LOCAL_TIER, "local"), (SHARED_TIER, "shared"))


@dataclass(slots=True)
class Replica:
    """One replica as the router tracks it: health, load, events, arms."""

    spec: ReplicaSpec
    state: ReplicaState
    block_size: int
    healthy: bool = False  # until the first health check passes
    report_failed: bool = False  # the last cluster-entropy report was not taken
    failures: int = 0
    events: KVEventSubscriber | None = None
    arms: ArmLayout | None = None  # a kvheat replica's A/B arms (None: one arm)
    pending: dict[int, float] = field(default_factory=dict)  # request -> expected prefill
    prewarming: bool = False
    failures_seen: bool = False  # was out of rotation since its events were subscribed
    first_routed_at: float | None = None  # time.monotonic() of the first request sent
    events_flowing: bool = False  # a batch arrived since it was subscribed
    warned_silent: bool = False
    routed: int = 0

    @property
    def name(self) -> str:
        """The replica's URL."""
        return self.spec.url


class ReplicaRegistry:
    """The replicas by URL, kept in step with the prefix index and the policy."""

    def __init__(self, config: RouterConfig, index: PrefixIndex, policy: RoutingPolicy,
                 metrics: RouterMetrics, secret: EventSecret | None = None) -> None:
        self.config = config
        self.secret = secret
        self._warned_no_secret = False
        self.index = index
        self.policy = policy
        self.metrics = metrics
        index.overflow.on_count = metrics.index_overflows.inc
        self.replicas: dict[str, Replica] = {}
        self.client: aiohttp.ClientSession | None = None  # set while the app runs
        self._discovered_missing: dict[str, int] = {}
        for spec in config.replicas:
            self.add(spec)

    def add(self, spec: ReplicaSpec) -> Replica:
        """Add a replica (once per URL), subscribing to a vLLM replica's events."""
        if spec.url in self.replicas:
            return self.replicas[spec.url]
        r = Replica(spec, ReplicaState(spec.url, healthy=False),
                    spec.block_size or self.config.block_size)
        self.replicas[spec.url] = r
        self.index.add_replica(spec.url, foreign_hashes=spec.kind == "vllm")
        if spec.kind == "vllm" and spec.events:
            self._subscribe(r, spec.events, spec.replay)
        return r

    def remove(self, url: str) -> bool:
        """Remove the replica of `url` from the registry, the index, the policy and the metrics."""
        r = self.replicas.pop(url, None)
        if r is None:
            return False
        if r.events is not None:
            r.events.close(timeout_s=0.5)
        self.index.remove_replica(url)
        self.policy.forget_replica(url)
        self.metrics.forget(url)
        return True

    def close(self) -> None:
        """Close every replica's event subscription."""
        for r in self.replicas.values():
            if r.events is not None:
                r.events.close(timeout_s=0.5)

    def _subscribe(self, r: Replica, endpoint: str, replay: str | None) -> None:
        # kvheat replicas' sockets are CURVE under the events secret; vLLM's are plain.
        r.events = KVEventSubscriber(r.name, endpoint, replay, self.index.apply,
                                     self.index.clear_replica,
                                     secret=self.secret if r.spec.kind == "kvheat" else None,
                                     max_queue_messages=self.config.event_queue_messages,
                                     max_queue_bytes=self.config.event_queue_bytes)

    async def _discover_events(self, r: Replica) -> None:
        """Ask a kvheat replica where it publishes (GET /kv_events) and subscribe."""
        if r.events is not None or r.spec.kind != "kvheat" or self.client is None:
            return
        if self.secret is None:
            if not self._warned_no_secret:
                self._warned_no_secret = True
                log.warning("no events secret (--events-secret or KVHEAT_EVENTS_SECRET): kvheat "
                            "replicas' KV events are keyed under theirs, so they are not "
                            "subscribed to and routing does not see their caches")
            return
        try:
            async with self.client.get(r.name + "/kv_events",
                                       timeout=aiohttp.ClientTimeout(total=2.0)) as resp:
                if resp.status != 200:
                    return
                # Bounded: a few hundred bytes in practice; a replica's bytes are outside bytes.
                raw = await resp.content.read(_MAX_INFO_BYTES + 1)
            if len(raw) > _MAX_INFO_BYTES:
                return
            info = json.loads(raw)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, RecursionError):
            return
        if not isinstance(info, dict):
            return
        host = r.spec.host
        if ":" in host:
            host = f"[{host}]"
        port, rport = _port(info.get("port")), _port(info.get("replay_port"))
        endpoint = info.get("endpoint")
        ep = f"tcp://{host}:{port}" if port else (
            endpoint if isinstance(endpoint, str) and endpoint.startswith("ipc://") else None)
        rp = f"tcp://{host}:{rport}" if rport else None
        bs = info.get("block_size")
        if r.spec.block_size is None and type(bs) is int and 1 <= bs <= 1 << 16:
            r.block_size = bs
        r.arms = ArmLayout.from_info(info.get("arms"))
        if ep:
            self._subscribe(r, ep, rp)

    async def check_all(self) -> None:
        """Check every replica's health at once."""
        await asyncio.gather(*(self.check(r) for r in list(self.replicas.values())))

    async def health_loop(self) -> None:
        """Discover, check and refresh the replicas forever, one round per interval."""
        while True:
            try:
                if self.config.discover:
                    await self._discover()
                await self.check_all()
                self.refresh_gauges()
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop outlives any one bad check
                log.exception("health check round")
            await asyncio.sleep(self.config.health_interval_s)

    async def check(self, r: Replica) -> None:
        """Check one replica's /health: in rotation when it answers, out after failures."""
        assert self.client is not None
        try:
            async with self.client.get(r.name + "/health", timeout=aiohttp.ClientTimeout(
                    total=max(0.5, self.config.health_interval_s))) as resp:
                ok = resp.status == 200
                await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            ok = False
        if ok:
            r.failures = 0
            if not r.healthy:
                log.info("replica %s is in rotation", r.name)
                if r.events is not None and r.failures_seen:
                    r.events.resync()  # what it holds now, not what it held before
                r.failures_seen = False
            r.healthy = r.state.healthy = True
            await self._discover_events(r)
        else:
            r.failures += 1
            if r.healthy and r.failures >= self.config.health_failures:
                log.warning("replica %s failed %d health checks: out of rotation", r.name,
                            r.failures)
                self._out(r)

    async def report_entropy(self, r: Replica, bits: float, token: str) -> bool:
        """PUT the cluster's entropy to one replica's admin API; False when it did not take it.

        Logged once per replica, never raised: a replica without the admin API, or another
        token, keeps its own regime."""
        assert self.client is not None
        try:
            async with self.client.put(
                    r.name + "/admin/cluster", json={"entropy_bits": round(bits, 4)},
                    headers={"Authorization": f"Bearer {token}"},
                    timeout=aiohttp.ClientTimeout(
                        total=max(0.5, self.config.health_interval_s))) as resp:
                await resp.read()
                ok = resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            ok = False
        if not ok and not r.report_failed:
            log.warning("replica %s did not take the cluster entropy (admin API off, or "
                        "another token): it keeps its own eviction regime", r.name)
        r.report_failed = not ok
        return ok

    def mark_failed(self, r: Replica) -> None:
        """A request could not reach `r`: out of rotation until a health check passes."""
        r.failures = max(r.failures, self.config.health_failures)
        self._out(r)

    def _out(self, r: Replica) -> None:
        """Out of rotation; what the index says it holds is forgotten (a replica that died
        lost it; one that comes back is resynced from its snapshot)."""
        r.healthy = r.state.healthy = False
        r.failures_seen = True
        self.index.clear_replica(r.name)

    async def _discover(self) -> None:
        discover = self.config.discover
        if discover is None:
            return
        host, port = discover.rsplit(":", 1)
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except OSError:
            return
        addrs = {str(a[4][0]) for a in infos}
        urls = {f"http://{'[' + a + ']' if ':' in a else a}:{port}" for a in addrs}
        for u in urls:
            self._discovered_missing.pop(u, None)
            if u not in self.replicas:
                log.info("replica %s joined (DNS)", u)
                self.add(ReplicaSpec(u))
        for u in list(self.replicas):
            if u not in urls and u not in {s.url for s in self.config.replicas}:
                n = self._discovered_missing.get(u, 0) + 1
                self._discovered_missing[u] = n
                if n >= self.config.health_failures:
                    log.info("replica %s left (DNS)", u)
                    self.remove(u)

    def routed_to(self, r: Replica) -> None:
        """Count a request routed to `r`."""
        r.routed += 1
        if r.first_routed_at is None:
            r.first_routed_at = time.monotonic()

    def check_events(self, r: Replica) -> None:
        """Check whether `r`'s events arrive, and warn once if they do not.

        A replica that has been sent requests and published no batch within `events_grace_s`
        is routed blind: say so once, loudly, with the usual cause (a vLLM publisher given a
        connect address)."""
        if r.spec.kind == "openai":
            return
        ev = r.events
        r.events_flowing = ev is not None and ev.stats.batches > 0
        if r.events_flowing or r.first_routed_at is None or r.warned_silent or \
                time.monotonic() - r.first_routed_at < self.config.events_grace_s:
            return
        r.warned_silent = True
        endpoint = ev.endpoint if ev is not None else r.spec.events
        if r.spec.kind == "vllm":
            hint = ("vLLM binds its event socket only when given a bind address: start it "
                    "with --kv-events-config '{\"enable_kv_cache_events\": true, "
                    "\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:PORT\"}' (with "
                    "tcp://HOST:PORT it connects instead, and nothing reaches the router) and "
                    "give the router events=tcp://HOST:PORT")
        elif ev is None:
            hint = ("no subscription: give the router the replicas' events secret "
                    "(--events-secret or KVHEAT_EVENTS_SECRET) and start the replica with "
                    "--kv-events-endpoint")
        else:
            hint = ("check that the replica's kv_events_secret equals the router's "
                    "--events-secret (CURVE refuses another) and that the event ports are "
                    "reachable from the router")
        log.warning("replica %s answered requests but published no KV event batch in %.0f s "
                    "(events endpoint %s): routing is blind to its cache. %s", r.name,
                    self.config.events_grace_s, endpoint or "unknown", hint)

    def events_ready(self) -> bool:
        """Whether the events of every healthy replica that publishes them arrive.

        Do the events of every healthy replica that publishes them arrive?"""
        return all(r.events is not None and r.events.stats.batches > 0
                   for r in self.replicas.values() if r.healthy and r.spec.kind != "openai")

    def refresh_gauges(self) -> None:
        """Set the per-replica gauges: health, load, events, indexed blocks."""
        m = self.metrics
        for r in self.replicas.values():
            self.check_events(r)
            if r.spec.kind != "openai":
                m.events_flowing.labels(r.name).set(1 if r.events_flowing else 0)
            m.healthy.labels(r.name).set(1 if r.healthy else 0)
            m.in_flight.labels(r.name).set(r.state.in_flight)
            for place, label in _PLACES:
                m.index_blocks.labels(r.name, label).set(self.index.blocks_of(r.name, place))
            if r.events is not None:
                st = r.events.stats
                m.event_batches.labels(r.name).set(st.batches)
                m.event_resets.labels(r.name).set(st.resets)
                for kind in EVENT_ERRORS:
                    m.event_errors.labels(r.name, kind).set(getattr(st, kind))

    def describe(self, r: Replica) -> dict[str, Any]:
        """The replica's state, as the router's admin API shows it."""
        sub = r.events
        return {"url": r.name, "kind": r.spec.kind, "healthy": r.healthy,
                "events_flowing": r.events_flowing if r.spec.kind != "openai" else None,
                "in_flight": r.state.in_flight, "routed": r.routed,
                "block_size": r.block_size,
                "index_blocks": {label: self.index.blocks_of(r.name, place)
                                 for place, label in _PLACES},
                "events": None if sub is None else {
                    "batches": sub.stats.batches, "gaps": sub.stats.gaps,
                    "resets": sub.stats.resets, "bad": sub.stats.bad,
                    "handler_errors": sub.stats.handler_errors, "restarts": sub.stats.restarts,
                    "timeouts": sub.stats.timeouts, "overflows": sub.stats.overflows,
                    "subscribed": sub.alive}}


def _port(v: object) -> int | None:
    """A TCP port from a replica's /kv_events answer, or None (anything else is ignored)."""
    return v if type(v) is int and 0 < v < 65536 else None
