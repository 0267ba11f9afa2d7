"""Guarded self-healing: `kvheat serve --self-heal` acts on what `kvheat doctor` finds.

Every `self_heal_interval_s` a thread of its own reads this server's metrics registry
(the figures the doctor scrapes from /metrics), scores the window since its previous read
with the doctor's own cause functions (`kvheat.doctor.causes`) and acts:

    cause                  action (its end)
    tier_fault, tier_slow  bypass: the tier is skipped (its blocks are recomputed) and
                           probed off the request path; restore once self_heal_probe_ok
                           probes in a row pass, then recalibrate it
    tier_slow, tier fast   recalibrate: its transfer timings are stale (the tier is fast
                           again by its probe): forget them and measure again
    (the doctor's tier_slow, and a tier whose latest reads took DRIFT times what its
    transfer model predicts: a tier that just turned slow still gets loads)
    overload               shed: refuse the lowest priority class (tenant priority, then
                           the priority of the arm the tenant's name reaches: the
                           operator's, never the client's `user`) with 429 and
                           Retry-After; one more class per step,
                           never the highest; one class back per step once the overload
                           has been gone self_heal_hold_s
    overload               scale_signal: the requests refused in the window are added to
                           kvheat_queue_length{queue="waiting"}, the series the HPA scales
                           on (deploy/k8s), so shedding does not hide the demand from it

Guards: a cause starts an action at score ENTER and ends it below EXIT only (hysteresis),
an action in force lasts at least `self_heal_hold_s`, the same action on the same tier
starts at most once per `self_heal_min_gap_s`, and every step is contained (an error is
logged and counted in kvheat_internal_errors_total{where="self_heal"}; serving goes on).
The engine loop is never blocked: the healer reads the registry and flips flags, and its
probes and recalibrations run on its own thread. Each action is a Prometheus counter and
gauge (kvheat_self_heal_*), an OpenTelemetry span event and a log line. With
`self_heal = "dry-run"` it decides the same way and only reports (dry_run="true"): no tier
is bypassed or probed, nothing is shed or recalibrated, the HPA's series is untouched.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import Counter, Gauge, generate_latest

from ..doctor.causes import FLOOR, Finding, Snapshot, overload, tier_fault, tier_slow
from ..doctor.scrape import DoctorError, Scrape, parse_metrics
from ..tiers.manager import TierHealth
from .arms import arm_user
from .config import ServerConfig, TenantConfig
from .metrics import ServerMetrics

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

log = logging.getLogger("kvheat.server.selfheal")

ENTER = 0.5  # a cause's score that starts an action (the doctor reports from FLOOR)
EXIT = FLOOR / 2  # below it the cause counts as gone
# A tier whose latest reads took this many times what its transfer model predicts has
# changed speed: its load-or-recompute timings are stale (`TransferModel.drift`).
DRIFT = 2.0
ACTIONS = ("bypass", "restore", "recalibrate", "shed", "unshed", "scale_signal",
           "scale_signal_end")
# What the healer reads of the registry: the series its causes use (not the kernel
# signals, which cost a socket walk per read).
SERIES = ("kvheat_requests", "kvheat_rejected_requests", "kvheat_queue_length",
          "kvheat_tier_up", "kvheat_tier_writable", "kvheat_tier_faults",
          "kvheat_tier_load_faults", "kvheat_load_decisions",
          "kvheat_tier_bandwidth_bytes_per_second", "kvheat_self_heal_shed_requests")
_TIER_RE = re.compile(r"\btier=([A-Za-z0-9_.-]+)")

# (tenant priority, arm priority): lower is shed first. Both are the operator's: the
# tenant is the API key's, the arm the one its tenant's name reaches (`_class`).
Priority = tuple[int, int]


class HealMetrics:
    """The healer's series, on the server's registry.

    Labels are bounded: the fixed actions and causes, the configured tiers, dry_run."""

    def __init__(self, registry: Any) -> None:
        self.actions = Counter(
            "kvheat_self_heal_actions", "Self-healing actions taken (or, dry_run=\"true\", "
            "that would have been), by action, the doctor's cause and tier (\"\": none).",
            ["action", "cause", "tier", "dry_run"], registry=registry)
        self.active = Gauge(
            "kvheat_self_heal_active", "Self-healing actions in force: 1 per bypassed tier, "
            "the number of priority classes shed, the requests added to the autoscaler's "
            "signal; 0 once ended.", ["action", "cause", "tier", "dry_run"], registry=registry)
        self.shed_requests = Counter(
            "kvheat_self_heal_shed_requests", "Requests refused (429) by load shedding, or "
            "that would have been (dry_run=\"true\").", ["dry_run"], registry=registry)


@dataclass
class Bypass:
    """A tier bypassed: why, since when, and its probes passed in a row."""

    cause: str
    since: float
    probes_ok: int = 0
    clear_since: float | None = None  # dry-run: since when the cause has been gone


class HealedTiers(Protocol):
    """What the healer asks of one engine's tiers (`kvheat.tiers.TierManager`)."""

    def health(self) -> list[TierHealth]:
        """Each tier's state, top first."""

    def set_bypass(self, name: str, on: bool) -> bool:
        """Skip tier `name` (its blocks are recomputed) or use it again."""

    def probe(self, name: str) -> tuple[bool, float | None]:
        """(healthy, read seconds) of tier `name` now."""

    def recalibrate(self, name: str, rounds: int = 3) -> bool:
        """Re-measure tier `name`'s transfers from scratch."""


class SelfHealer:
    """Acts on the doctor's causes: tiers bypassed and restored, load shed.

    It sees the server's config, its metrics (the registry it reads and reports on, the
    waiting-queue boost it sets), a tracer, the tiers of every arm's engine now (`tiers`:
    arm -> its tiers or None; engines may be rebuilt, so asked each time) and `arm_for`
    (the arm a user name reaches), never the server object."""

    def __init__(self, config: ServerConfig, metrics: ServerMetrics, tracer: Tracer,
                 tiers: Callable[[], Mapping[str, HealedTiers | None]],
                 arm_for: Callable[[str], str],
                 clock: Callable[[], float] = time.monotonic) -> None:
        cfg = config
        self.server_metrics = metrics
        self.tracer = tracer
        self.tiers = tiers
        self.clock = clock
        self.dry_run = cfg.self_heal == "dry-run"
        self.dry = "true" if self.dry_run else "false"
        self.interval_s = cfg.self_heal_interval_s
        self.hold_s = cfg.self_heal_hold_s
        self.min_gap_s = cfg.self_heal_min_gap_s
        self.probe_ok = cfg.self_heal_probe_ok
        self.metrics = HealMetrics(metrics.registry)
        arm_priority = {a.name: a.priority for a in cfg.arm_list}
        tenants: list[TenantConfig | None] = list(cfg.tenants) or [None]
        # Each tenant's class, fixed by the config: the client's `user` picks the arm that
        # serves a request (an A/B split), never how early it is shed.
        self._class: dict[str | None, Priority] = {
            t.name if t else None: (t.priority if t else 0, arm_priority.get(
                arm_for(arm_user(None, t.name if t else None)), 0))
            for t in tenants}
        # The priority classes present, lowest first; shedding never reaches the last.
        self.classes: list[Priority] = sorted(set(self._class.values()))
        self.shed_level = 0  # the lowest `shed_level` classes are refused
        self.bypassed: dict[str, Bypass] = {}  # tier name -> its bypass
        self.boost = 0.0  # requests added to the HPA's waiting-queue series
        self._last_start: dict[tuple[str, str], float] = {}
        self._overload_clear_since: float | None = None
        self._shed_changed = float("-inf")
        self._shed_count = 0  # requests shed since the last step (request handlers add)
        self._shed_lock = threading.Lock()
        self._prev: Scrape | None = None
        self._prev_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned_nothing_to_shed = False

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        """Start the healer's thread (one look every interval)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvheat-selfheal",
                                            daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the healer's thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.tick()

    def tick(self) -> None:
        """One look at the metrics and the actions it calls for; never raises."""
        try:
            now = self.clock()
            b = self.read()
            if self._prev is not None:
                self.step(Snapshot(self._prev, b, now - self._prev_at), now)
            self._prev, self._prev_at = b, now
        except Exception as e:
            self._error(e)

    def _error(self, exc: BaseException) -> None:
        try:
            log.error("self-heal step failed (serving goes on): %r", exc, exc_info=exc)
            self.server_metrics.internal_errors.labels("self_heal").inc()
        except Exception:  # logging or metrics broken too: nothing more to do
            pass

    # ---- what it reads ------------------------------------------------------------------
    def read(self) -> Scrape:
        """This server's series the causes use, as the doctor's scrape parses them.

        The healer's own addition to the waiting queue is taken out (else its signal to
        the autoscaler would read as overload to itself)."""
        reg = self.server_metrics.registry.restricted_registry(
            [n + s for n in SERIES for s in ("", "_total")])
        try:
            out = parse_metrics(generate_latest(reg), "the server's registry")
        except DoctorError:  # nothing labelled yet (before the engine's first refresh)
            return {}
        boosts = self.server_metrics.queue_boost
        for (name, labels), v in list(out.items()):
            d = dict(labels)
            if name == "kvheat_queue_length" and d.get("queue") == "waiting":
                out[(name, labels)] = max(0.0, v - boosts.get(d.get("arm", ""), 0.0))
        return out

    # ---- deciding -----------------------------------------------------------------------
    def step(self, snap: Snapshot, now: float) -> None:
        """Score one window and act on it (each part contained on its own)."""
        for part in (lambda: self._tiers(tier_fault(snap), tier_slow(snap), now),
                     lambda: self._overload(overload(snap), overload(_shed_as_refused(snap)),
                                            snap, now),
                     lambda: self._apply()):
            try:
                part()
            except Exception as e:
                self._error(e)

    def _may_start(self, action: str, tier: str, now: float) -> bool:
        return now - self._last_start.get((action, tier), float("-inf")) >= self.min_gap_s

    def _tiers(self, fault: Finding, slow: Finding, now: float) -> None:
        named = {c.cause: _tiers_named(c) for c in (fault, slow) if c.score >= ENTER}
        for tier in sorted(named.get("tier_fault", set())):
            if tier not in self.bypassed and tier in self._tier_names():
                self._bypass(tier, "tier_fault", fault.score, now)
        # Slow: what the doctor finds (its blocks mostly recomputed), and tiers whose
        # latest reads are far slower than their model says, which the doctor cannot
        # see while the stale model still sends loads there.
        drifting = self._drifting_tiers()
        if drifting:
            slow = Finding("tier_slow", max(slow.score, 1.0), slow.evidence, slow.action)
        for tier in sorted(named.get("tier_slow", set()) | drifting):
            if tier in self.bypassed or tier not in self._slow_tier_names():
                continue
            if self.dry_run:  # a probe writes to the tier: not in a dry run
                self._bypass(tier, "tier_slow", slow.score, now)
                continue
            healthy, seconds = self._probe(tier)
            if not healthy:
                self._bypass(tier, "tier_slow", slow.score, now, probe_s=seconds)
            elif self._may_start("recalibrate", tier, now):
                # Fast by its probe, yet judged slow: the timings the decisions use are
                # stale (a slow spell that ended). Measure it again from scratch.
                self._recalibrate(tier, "tier_slow", slow.score, now)
        gone = max(fault.score, slow.score) < EXIT
        for tier, b in list(self.bypassed.items()):
            if self.dry_run:  # no probes: the cause's absence ends it
                b.clear_since = (b.clear_since or now) if gone else None
                if b.clear_since is not None and now - b.clear_since >= self.hold_s \
                        and now - b.since >= self.hold_s:
                    self._restore(tier, b, now)
                continue
            healthy, seconds = self._probe(tier)
            b.probes_ok = b.probes_ok + 1 if healthy else 0
            if b.probes_ok >= self.probe_ok and now - b.since >= self.hold_s:
                self._restore(tier, b, now, seconds)

    def _bypass(self, tier: str, cause: str, score: float, now: float,
                probe_s: float | None = None) -> None:
        if not self._may_start("bypass", tier, now):
            return
        self._last_start[("bypass", tier)] = now
        self.bypassed[tier] = Bypass(cause, now)
        self._apply()  # in effect before it is reported
        self._record("bypass", cause, tier, score, 1.0,
                     "its blocks are recomputed until its probes pass"
                     + (f" (probe read {probe_s * 1000:.1f} ms)" if probe_s else ""))

    def _restore(self, tier: str, b: Bypass, now: float, probe_s: float | None = None) -> None:
        del self.bypassed[tier]
        # No new bypass of this tier within the gap: a store back from an outage may fail
        # loads of what it lost for a while (the index learns), and must not flap.
        self._last_start[("bypass", tier)] = now
        self.metrics.active.labels("bypass", b.cause, tier, self.dry).set(0)
        self._record("restore", b.cause, tier, 0.0, None,
                     f"in use again after {now - b.since:.1f} s"
                     + (f" ({self.probe_ok} probes passed, last read "
                        f"{probe_s * 1000:.1f} ms)" if probe_s is not None else ""))
        self._apply()  # before the recalibration: it measures the tier as it serves
        self._recalibrate(tier, b.cause, 0.0, now)

    def _recalibrate(self, tier: str, cause: str, score: float, now: float) -> None:
        self._last_start[("recalibrate", tier)] = now
        if not self.dry_run:
            for tc in self._engine_tiers():
                tc.recalibrate(tier)
        self._record("recalibrate", cause, tier, score, None,
                     "load-or-recompute timings measured again")

    def _overload(self, f: Finding, offered: Finding, snap: Snapshot, now: float) -> None:
        """`f`: the overload of the traffic served (raises the shed level); `offered`: the
        same with the requests shed counted as refused, as they would be without the
        shedding (only its absence lowers the level again: no flapping while the
        demand lasts)."""
        with self._shed_lock:
            shed_now, self._shed_count = self._shed_count, 0
        refused = snap.deltas("kvheat_rejected_requests_total", "status").get("503", 0.0)
        if f.score >= ENTER:
            self._overload_clear_since = None
            top = len(self.classes) - 1
            if self.shed_level < top and self._may_start("shed", "", now):
                self._last_start[("shed", "")] = now
                self._shed_changed = now
                self.shed_level += 1
                self._record("shed", "overload", "", f.score, float(self.shed_level),
                             f"refusing priority classes {self.classes[:self.shed_level]} "
                             f"with 429 (of {self.classes})")
            elif top == 0 and not self._warned_nothing_to_shed:
                self._warned_nothing_to_shed = True
                log.warning("self-heal: overloaded, but every request has one priority "
                            "(set tenant or arm priority to shed the lowest first)")
            boost = refused + shed_now
            if boost > 0 and (self.boost > 0 or self._may_start("scale_signal", "", now)):
                if self.boost == 0:
                    self._last_start[("scale_signal", "")] = now
                    self._record("scale_signal", "overload", "", f.score, boost,
                                 f"kvheat_queue_length{{queue=\"waiting\"}} raised by "
                                 f"{boost:g} refused requests")
                self._set_boost(boost)
            return
        if max(f.score, offered.score) >= EXIT:
            self._overload_clear_since = None
            return
        if self._overload_clear_since is None:
            self._overload_clear_since = now
        clear_for = now - self._overload_clear_since
        if clear_for < self.hold_s:
            return
        if self.boost > 0:
            self._set_boost(0.0)
            self._record("scale_signal_end", "overload", "", f.score, None,
                         f"overload gone for {clear_for:.1f} s")
        if self.shed_level > 0 and now - self._shed_changed >= self.hold_s:
            self.shed_level -= 1
            self._shed_changed = now
            self._overload_clear_since = now  # the next class back only after another hold
            self.metrics.active.labels("shed", "overload", "", self.dry).set(self.shed_level)
            self._record("unshed", "overload", "", f.score, None,
                         f"overload gone for {clear_for:.1f} s; refusing "
                         f"{self.classes[:self.shed_level] or 'nothing'}")

    def _set_boost(self, boost: float) -> None:
        self.boost = boost
        self.metrics.active.labels("scale_signal", "overload", "", self.dry).set(boost)

    # ---- acting -------------------------------------------------------------------------
    def _apply(self) -> None:
        """Bring the engines in line with the decisions (an engine rebuilt after a failure
        starts with its tiers in use, and the HPA's series follows the boost)."""
        if self.dry_run:
            return
        for tc in self._engine_tiers():
            for h in tc.health():
                tc.set_bypass(h.name, h.name in self.bypassed)
        arms = list(self.tiers())
        self.server_metrics.queue_boost = {a: self.boost / len(arms) for a in arms} \
            if self.boost > 0 and arms else {}

    def admit(self, tenant: TenantConfig | None) -> int | None:
        """None to serve the request; else the Retry-After seconds of its refusal.

        Refused when its tenant's priority class is shed now; in a dry run it is only
        counted."""
        if self.shed_level == 0:
            return None
        cls = self._class.get(tenant.name if tenant else None, (0, 0))
        if cls not in self.classes[:self.shed_level]:
            return None
        with self._shed_lock:
            self._shed_count += 1
        self.metrics.shed_requests.labels(self.dry).inc()
        return None if self.dry_run else max(1, math.ceil(self.hold_s))

    def _probe(self, tier: str) -> tuple[bool, float | None]:
        tc = next((tc for tc in self._engine_tiers()
                   if any(h.name == tier for h in tc.health())), None)
        return tc.probe(tier) if tc is not None else (False, None)

    def _engine_tiers(self) -> list[HealedTiers]:
        return [tc for tc in list(self.tiers().values()) if tc is not None]

    def _health(self) -> list[TierHealth]:
        return [h for tc in self._engine_tiers() for h in tc.health()]

    def _tier_names(self) -> set[str]:
        return {h.name for h in self._health()}

    def _drifting_tiers(self) -> set[str]:
        """Tiers in use whose latest reads took DRIFT times their model's estimate."""
        return {h.name for h in self._health() if h.slow and not h.bypassed
                and h.drift is not None and h.drift >= DRIFT}

    def _slow_tier_names(self) -> set[str]:
        """Tiers the load-or-recompute model can judge too slow (host copies never are)."""
        return {h.name for h in self._health() if h.slow}

    # ---- recording ----------------------------------------------------------------------
    def _record(self, action: str, cause: str, tier: str, score: float,
                active: float | None, detail: str) -> None:
        """One action: a counter (and its gauge), a span event and a log line."""
        self.metrics.actions.labels(action, cause, tier, self.dry).inc()
        if active is not None:  # the gauge of an action in force (ends set it to 0)
            self.metrics.active.labels(action, cause, tier, self.dry).set(active)
        attrs: dict[str, str | bool | float] = {
            "kvheat.self_heal.action": action, "kvheat.self_heal.cause": cause,
            "kvheat.self_heal.tier": tier, "kvheat.self_heal.score": round(score, 3),
            "kvheat.self_heal.dry_run": self.dry_run, "kvheat.self_heal.detail": detail}
        try:
            span = self.tracer.start_span("kvheat.self_heal", attributes=attrs)
            span.add_event(f"self_heal.{action}", attrs)
            span.end()
        except Exception as e:  # tracing must not stop the healing
            self._error(e)
        log.warning("self-heal%s: %s%s (cause %s, score %.2f): %s",
                    " (dry-run, not done)" if self.dry_run else "", action,
                    f" tier {tier}" if tier else "", cause, score, detail)


def _tiers_named(f: Finding) -> set[str]:
    """The tiers a finding's evidence names (its series' tier label). A tier that only
    refuses writes (a full disk) is left out: it still serves reads, and its store has
    already paused demotions to it."""
    return {m.group(1) for k in f.evidence if not k.startswith("kvheat_tier_writable")
            for m in _TIER_RE.finditer(k)}


def _shed_as_refused(snap: Snapshot) -> Snapshot:
    """`snap` with the requests the healer shed added to the 503 refusals."""
    def fold(sc: Scrape) -> Scrape:
        out = dict(sc)
        shed = sum(v for (n, lab), v in sc.items() if n == "kvheat_self_heal_shed_requests_total"
                   and dict(lab).get("dry_run") == "false")
        key = ("kvheat_rejected_requests_total", (("status", "503"),))
        out[key] = out.get(key, 0.0) + shed
        return out

    return Snapshot(fold(snap.a), fold(snap.b), snap.dt, snap.admin_a, snap.admin_b)
