"""The causes `kvheat doctor` knows, each one scoring function over a `Snapshot`.

A score is in [0, 1]; it is built only from ratios, shares and rates of the window (never
an absolute level tuned to one setup), and a cause is reported only at `FLOOR` or above,
so a healthy or idle server yields nothing. Each cause returns its score, the evidence it
used (series -> value) and the action that fixes it.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..cache import hit_rate
from ..replay.curves import KNEE
from .replay import FACTORS, RECOVER, CapacityReplay, replay_all
from .scrape import Scrape

FLOOR = 0.3


def _clamp(x: float) -> float:
    return 0.0 if not math.isfinite(x) or x <= 0 else min(1.0, x)


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 0.0


def _dict(x: object) -> dict[str, Any]:
    """A part of /admin/stats that should be an object; anything else reads as empty."""
    return x if isinstance(x, dict) else {}


def _number(x: object) -> float | None:
    """A figure of /admin/stats: a finite int or float (not a bool), else None."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    return float(x) if math.isfinite(x) else None


@dataclass
class Snapshot:
    """Two scrapes `dt` seconds apart (and /admin/stats at both ends, when given)."""

    a: Scrape
    b: Scrape
    dt: float
    admin_a: dict[str, Any] | None = None
    admin_b: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        # NaN is Prometheus' "no data" (a rate over an empty window, an unset gauge): the
        # series has no value over the window, so it leaves both ends (kept at one end, a
        # counter would count from zero there).
        gone = {k for s in (self.a, self.b) for k, v in s.items() if math.isnan(v)}
        if gone:
            self.a = {k: v for k, v in self.a.items() if k not in gone}
            self.b = {k: v for k, v in self.b.items() if k not in gone}

    @staticmethod
    def _match(labels: tuple[tuple[str, str], ...], want: dict[str, str]) -> bool:
        d = dict(labels)
        return all(d.get(k) == v for k, v in want.items())

    def _sum(self, s: Scrape, name: str, want: dict[str, str]) -> float:
        return sum(v for (n, lab), v in s.items() if n == name and self._match(lab, want))

    def gauge(self, name: str, **want: str) -> float:
        """The gauge summed over the series that match `want`, at the second scrape."""
        return self._sum(self.b, name, want)

    def gauge_min(self, name: str, **want: str) -> float:
        """The lower of the two scrapes' values: a level held through the window."""
        return min(self._sum(self.a, name, want), self._sum(self.b, name, want))

    def delta(self, name: str, **want: str) -> float:
        """A counter's increase over the window (a counter that went down restarted)."""
        return sum(self.deltas(name, "", **want).values())

    def deltas(self, name: str, by: str, **want: str) -> dict[str, float]:
        """A counter's increase per value of the label `by` ("" for one total)."""
        out: dict[str, float] = {}
        for (n, lab), vb in self.b.items():
            if n != name or not self._match(lab, want):
                continue
            va = self.a.get((n, lab), 0.0)
            d = vb - va if vb >= va else vb
            key = dict(lab).get(by, "") if by else ""
            out[key] = out.get(key, 0.0) + d
        return out

    def values(self, name: str, by: str, **want: str) -> dict[str, float]:
        """A gauge per value of the label `by`, at the second scrape."""
        out: dict[str, float] = {}
        for (n, lab), v in self.b.items():
            if n == name and self._match(lab, want):
                key = dict(lab).get(by, "")
                out[key] = out.get(key, 0.0) + v
        return out

    # ---- figures several causes use ---------------------------------------------------
    def finished(self) -> float:
        """Requests finished in the window."""
        return self.delta("kvheat_requests_total")

    def rejected(self) -> float:
        """Requests rejected in the window."""
        return self.delta("kvheat_rejected_requests_total")

    def arms_admin(self, which: str) -> dict[str, Any]:
        """The arms of /admin/stats at scrape `which` ("a" or "b"); empty without it."""
        st = self.admin_a if which == "a" else self.admin_b
        arms = (st or {}).get("arms")
        return arms if isinstance(arms, dict) else {}


@dataclass
class Finding:
    """One possible cause: its score, the evidence behind it and what to do."""

    cause: str
    score: float
    evidence: dict[str, float] = field(default_factory=dict)
    action: str = ""

    def as_json(self) -> dict[str, Any]:
        """The finding as `kvheat doctor --json` prints it."""
        return {"cause": self.cause, "score": round(self.score, 3),
                "evidence": [{"series": k, "value": v} for k, v in self.evidence.items()],
                "action": self.action}


Cause = Callable[[Snapshot], Finding]


def capacity(s: Snapshot) -> Finding:
    """Score capacity misses: blocks evicted, then asked for again.

    They must dominate the misses and cost a real share of the prompt tokens, while the
    device pool keeps evicting."""
    miss = s.deltas("kvheat_prefix_miss_tokens_total", "kind")
    cap, all_miss = miss.get("capacity", 0.0), sum(miss.values())
    prompt = s.delta("kvheat_prompt_tokens_total")
    evicted = s.delta("kvheat_evictions_total", tier="device")
    used = s.gauge("kvheat_blocks", tier="device", state="used")
    free = s.gauge("kvheat_blocks", tier="device", state="free")
    cached = s.gauge("kvheat_blocks", tier="device", state="cached")
    total = used + free + cached
    share = _ratio(cap, all_miss)
    cost = _ratio(cap, prompt)
    # Full weight once capacity misses are most misses and a fifth of all prompt tokens.
    score = _clamp(share / 0.5) * _clamp(cost / 0.2) * (1.0 if evicted > 0 else 0.5)
    ev = {"kvheat_prefix_miss_tokens_total{kind=capacity} Δ": cap,
          "kvheat_prefix_miss_tokens_total Δ": all_miss,
          "kvheat_prompt_tokens_total Δ": prompt,
          "kvheat_evictions_total{tier=device} Δ": evicted,
          "kvheat_blocks{tier=device,state=free}": free,
          "kvheat_blocks{tier=device} total": total}
    recent = (s.admin_b or {}).get("recent_keys")
    # The replay is the expensive part: only for a finding that will be shown.
    replays = replay_all(recent) if score >= FLOOR and isinstance(recent, dict) else []
    if replays:
        return Finding("capacity", score, {**ev, **_replay_evidence(replays)},
                       _replay_action(replays))
    # No replay (no --admin-url, or an older server): a lower bound. Each capacity-miss
    # token was cached once and evicted before its reuse; holding them all needs at least
    # that many more tokens of KV (a longer window sees a longer reuse distance). Blocks:
    # tokens / block size, where /admin/stats gives the block size; /metrics does not.
    bs = next((b for a in s.arms_admin("b").values()
               if (b := _dict(a).get("block_size")) and isinstance(b, int)
               and not isinstance(b, bool) and b > 0), None)
    need = (f"about {math.ceil(cap / bs)} more blocks of {bs} tokens" if bs
            else f"room for about {int(cap)} more tokens of KV")
    why = ("the replay of recent traffic needs --admin-url (GET /admin/recent-keys)"
           if s.admin_b is None else "this server gives no /admin/recent-keys to replay")
    action = (f"Grow the KV pool (num_blocks, now {int(total)} blocks on device): {need} "
              f"would have turned this window's {int(cap)} capacity-miss tokens into hits "
              "(a lower bound: the capacity-miss tokens seen in the window, reused after "
              f"eviction; {why}). Or add a lower tier (host/disk) so evicted blocks are "
              "loaded, not recomputed.")
    return Finding("capacity", score, ev, action)


def _replay_evidence(replays: list[CapacityReplay]) -> dict[str, float]:
    ev: dict[str, float] = {}
    for r in replays:
        ev[f"replay[{r.arm}] requests"] = r.requests
        for n, rate in r.hit_rates.items():
            ev[f"replay[{r.arm}] hit rate @ {n} blocks"] = round(rate, 4)
        ev[f"replay[{r.arm}] hit rate, unbounded"] = round(r.unbounded, 4)
        if r.knee is not None:
            ev[f"replay[{r.arm}] blocks at {KNEE:.0%} of unbounded"] = r.knee
    return ev


def _replay_action(replays: list[CapacityReplay]) -> str:
    parts = []
    for r in replays:
        now = f"arm {r.arm!r} ({r.policy}, {r.blocks} blocks of {r.block_size} tokens"
        if r.recommended is None:
            parts.append(f"{now}): the replay finds no pool size up to x{FACTORS[-1]:g} that "
                         f"closes {RECOVER:.0%} of the gap from {r.current:.1%} to "
                         f"{r.unbounded:.1%} (only num_blocks={r.footprint}, all the "
                         "recent prompts' distinct blocks, gets there); add a lower tier "
                         "(host/disk) instead")
        else:
            parts.append(f"{now}): num_blocks={r.recommended} (x{r.recommended / r.blocks:.3g}), "
                         f"replayed hit rate {r.current:.1%} -> "
                         f"{r.hit_rates[r.recommended]:.1%} of {r.unbounded:.1%} unbounded")
        if r.knee is not None:  # where the curve flattens: more memory buys little past it
            parts[-1] += (f"; its hit-rate curve reaches {KNEE:.0%} of unbounded at about "
                          f"num_blocks={r.knee}")
    return ("Grow the KV pool: " + "; ".join(parts) + ". Rule: the smallest of the pool "
            f"x{', x'.join(f'{f:g}' for f in FACTORS)} whose hit rate, replaying the last "
            f"{max(r.requests for r in replays)} admitted prompts through the arm's own "
            f"policy, closes {RECOVER:.0%} of the gap between now and a cache that never "
            "evicts. Or add a lower tier (host/disk) so evicted blocks are loaded, not "
            "recomputed.")


def tenant_quota(s: Snapshot) -> Finding:
    """Score one named tenant taking most of the preemptions.

    Its quota or its share of the pool runs out, and preemptions are frequent relative to
    the requests finished."""
    pre = {t: v for t, v in s.deltas("kvheat_preemptions_total", "tenant").items() if v > 0}
    total = sum(pre.values())
    if not pre:
        return Finding("tenant_quota", 0.0)
    top, n = max(pre.items(), key=lambda kv: kv[1])
    share = _ratio(n, total)
    rate = _ratio(total, max(s.finished(), 1.0))
    named = top not in ("none", "unknown", "other")
    score = (_clamp((share - 0.5) / 0.3) * _clamp(rate / 0.1)) if named else 0.0
    ev = {f"kvheat_preemptions_total{{tenant={top}}} Δ": n,
          "kvheat_preemptions_total Δ": total,
          "kvheat_requests_total Δ": s.finished()}
    blocks = s.values("kvheat_tenant_blocks", "tenant")
    if top in blocks:
        ev[f"kvheat_tenant_blocks{{tenant={top}}}"] = blocks[top]
    for arm in s.arms_admin("b").values():
        quota = _number(_dict(_dict(_dict(arm).get("tenants")).get(top)).get("quota"))
        if quota:
            ev[f"admin tenants.{top}.quota"] = quota
    action = (f"Tenant {top!r} takes {share:.0%} of the preemptions: raise its quota "
              "(PUT /admin/tenants/{tenant}/quota) if it should have more of the pool, or "
              "rate-limit it; other tenants are unaffected if the quota is what it should be.")
    return Finding("tenant_quota", score, ev, action)


def _hit_rate_drop(s: Snapshot) -> tuple[float, float, float]:
    """(hit rate before the window, hit rate in it, relative drop) from the token counters."""
    # Token counters: whole numbers, as `hit_rate` counts them.
    before = hit_rate(int(sum(v for (n, _), v in s.a.items() if n == "kvheat_cached_tokens_total")),
                      int(sum(v for (n, _), v in s.a.items() if n == "kvheat_prompt_tokens_total")))
    now = hit_rate(int(s.delta("kvheat_cached_tokens_total")),
                   int(s.delta("kvheat_prompt_tokens_total")))
    return before, now, _clamp(_ratio(before - now, before))


def entropy_drift(s: Snapshot) -> Finding:
    """Score a move of the heat policy's entropy regime that cost hits.

    The regime flipped or its traffic entropy moved a lot in the window, and the hit rate
    dropped with it (a young server's regime settling is not a cause). Only /admin/stats
    reports the regime (no /metrics series): needs --admin-url."""
    signal, ev = 0.0, {}
    arms_a, arms_b = s.arms_admin("a"), s.arms_admin("b")
    for name, b in arms_b.items():
        ra = _dict(_dict(arms_a.get(name)).get("regime"))
        rb = _dict(_dict(b).get("regime"))
        if not ra or not rb:
            continue
        ea, eb = _number(ra.get("entropy_bits")), _number(rb.get("entropy_bits"))
        if ea is not None and eb is not None:
            # Below one bit the traffic is about one prefix: changes there are noise.
            rel = abs(eb - ea) / max(ea, eb, 1.0)
            signal = max(signal, _clamp(rel / 0.5))  # entropy moved by half: full weight
            ev[f"admin arms.{name}.regime.entropy_bits before"] = round(ea, 3)
            ev[f"admin arms.{name}.regime.entropy_bits after"] = round(eb, 3)
        if ra.get("mode") != rb.get("mode"):
            signal = max(signal, 1.0)
            ev[f"admin arms.{name}.regime.mode {ra.get('mode')}->{rb.get('mode')}"] = 1.0
    before, now, drop = _hit_rate_drop(s)
    # Weight grows to its top once the window's hit rate is 30% (relative) below the one
    # before it. The top is 0.7, not 1: a regime change is the traffic's doing, so a cause
    # that names what changed (long prompts, a tenant, a fault) ranks above it.
    score = 0.7 * signal * _clamp(drop / 0.3)
    ev["hit rate before the window"] = round(before, 3)
    ev["hit rate in the window"] = round(now, 3)
    action = ("The traffic mix changed (entropy of the prefixes seen): expect the hit rate "
              "to dip while the heat policy re-learns. If it flips back and forth, widen its "
              "window; if the new mix is here to stay, re-check the pool size for it.")
    return Finding("entropy_drift", score, ev, action)


def tier_fault(s: Snapshot) -> Finding:
    """Score a lower tier that is down or refuses writes.

    Or its fault counters rise relative to the traffic."""
    faults = s.deltas("kvheat_tier_faults_total", "tier")
    load_faults = s.deltas("kvheat_tier_load_faults_total", "kind")
    n_faults = sum(faults.values()) + sum(load_faults.values())
    down = {t: v for t, v in s.values("kvheat_tier_up", "tier").items() if v == 0}
    readonly = {t: v for t, v in s.values("kvheat_tier_writable", "tier").items() if v == 0}
    work = max(s.finished() + s.delta("kvheat_load_decisions_total"), 1.0)
    score = max(1.0 if down else 0.0, 0.8 if readonly else 0.0,
                _clamp(_ratio(n_faults, work) / 0.1))
    ev: dict[str, float] = {}
    for t in down:
        ev[f"kvheat_tier_up{{tier={t}}}"] = 0.0
    for t in readonly:
        ev[f"kvheat_tier_writable{{tier={t}}}"] = 0.0
    for t, v in faults.items():
        if v > 0:
            ev[f"kvheat_tier_faults_total{{tier={t}}} Δ"] = v
    for k, v in load_faults.items():
        if v > 0:
            ev[f"kvheat_tier_load_faults_total{{kind={k}}} Δ"] = v
    where = ", ".join(sorted({*down, *readonly, *(t for t, v in faults.items() if v > 0)}))
    action = (f"Check the lower tier ({where or 'see evidence'}): its store is down, full or "
              "returning bad values (the kind label says which); free space or restore the "
              "store; blocks it cannot serve are recomputed meanwhile.")
    return Finding("tier_fault", score, ev, action)


def tier_slow(s: Snapshot) -> Finding:
    """Score loads from a lower tier that got slow.

    Its fitted read bandwidth fell severalfold over the window while blocks were read from
    it, or blocks found there are mostly recomputed (loading was judged slower than
    recomputing)."""
    dec = s.deltas("kvheat_load_decisions_total", "decision")
    n = sum(dec.values())
    rec = dec.get("recompute", 0.0)
    share = _ratio(rec, n)
    # A handful of decisions is noise; weight grows to full at one decision per request.
    weight = _clamp(_ratio(n, max(s.finished(), 1.0)))
    score = _clamp((share - 0.5) / 0.4) * weight
    ev = {"kvheat_load_decisions_total{decision=recompute} Δ": rec,
          "kvheat_load_decisions_total Δ": n}
    read = s.deltas("kvheat_tier_bytes_total", "tier", direction="read")
    before: dict[str, float] = {}
    for (name, lab), v in s.a.items():
        d = dict(lab)
        if name == "kvheat_tier_bandwidth_bytes_per_second" and d.get("direction") == "read":
            before[d.get("tier", "")] = before.get(d.get("tier", ""), 0.0) + v
    for t, v in s.values("kvheat_tier_bandwidth_bytes_per_second", "tier",
                         direction="read").items():
        ev[f"kvheat_tier_bandwidth_bytes_per_second{{tier={t},direction=read}}"] = v
        if t in before and v > 0 and read.get(t, 0.0) > 0:
            fell = before[t] / v
            ev[f"... before the window{{tier={t}}}"] = before[t]
            ev[f"kvheat_tier_bytes_total{{tier={t},direction=read}} Δ"] = read[t]
            score = max(score, _clamp((fell - 1.5) / 2.5))  # 4x slower: full weight
    action = ("Loads from the lower tier got slow (its read bandwidth fell, or its blocks "
              "are recomputed rather than loaded): check the tier's store and the network "
              "to it (latency, a saturated link, a busy Redis); meanwhile `--self-heal` "
              "bypasses it, or drop it and give the memory to the device pool.")
    return Finding("tier_slow", score, ev, action)


def _loopback(peer: str) -> bool:
    """Loopback has no link to lose packets on: its retransmits are timers firing early
    (tail-loss probes racing a delayed ACK on a busy host), never the network."""
    try:
        return ipaddress.ip_address(peer).is_loopback
    except ValueError:  # "other", the bucket of the peers past the top ones
        return False


def network(s: Snapshot) -> Finding:
    """Score network trouble: retransmits, or a peer RTT costly to the first token.

    Retransmits per peer relative to its traffic, or a peer RTT that is a real share of the
    time to first token (from kvheat_net_*, the server's netsignals)."""
    rtx_a = {k: v for k, v in s.a.items() if k[0] == "kvheat_net_peer_retransmitted_segments"}
    score, ev = 0.0, {}
    bytes_b = s.values("kvheat_net_peer_bytes", "peer")
    bytes_a: dict[str, float] = {}
    for (n, lab), v in s.a.items():
        if n == "kvheat_net_peer_bytes":
            p = dict(lab).get("peer", "")
            bytes_a[p] = bytes_a.get(p, 0.0) + v
    offered = s.finished() + s.rejected()
    roles = {dict(lab).get("peer", ""): dict(lab).get("role", "") for (n, lab) in s.b
             if n in ("kvheat_net_peer_retransmitted_segments", "kvheat_net_peer_rtt_seconds")}
    for peer, rb in s.values("kvheat_net_peer_retransmitted_segments", "peer").items():
        if _loopback(peer):
            continue
        ra = sum(v for (_, lab), v in rtx_a.items() if dict(lab).get("peer") == peer)
        d_rtx = max(rb - ra, 0.0)  # a gauge: it drops when sockets close
        d_bytes = max(bytes_b.get(peer, 0.0) - bytes_a.get(peer, 0.0), 0.0)
        # Segments sent, estimated from below: bytes at a 1448-byte MSS, and for the
        # server's clients at least four segments per request (request, answer, ACKs:
        # small HTTP messages travel one per segment whatever the MSS).
        segments = max(d_bytes / 1448.0, 4.0 * offered if roles.get(peer) == "client" else 0.0,
                       1.0)
        loss = _ratio(d_rtx, segments)
        if d_rtx >= 3:  # two or three retransmits are noise on any link
            sc = _clamp(loss / 0.05)  # 5% of segments retransmitted: full weight
            if sc > 0:
                ev[f"kvheat_net_peer_retransmitted_segments{{peer={peer}}} Δ"] = d_rtx
                ev[f"kvheat_net_peer_bytes{{peer={peer}}} Δ"] = d_bytes
            score = max(score, sc)
    ttft_n = s.delta("kvheat_time_to_first_token_seconds_count")
    ttft_mean = _ratio(s.delta("kvheat_time_to_first_token_seconds_sum"), ttft_n)
    if ttft_mean > 0:
        for peer, rtt in s.values("kvheat_net_peer_rtt_seconds", "peer").items():
            # Upstreams only (Redis, replicas, a router's servers: the roles the server
            # names). A client, or an unnamed "peer" connection, has nothing to send after
            # an answer, so it delays its ACK (up to 40 ms on Linux) and the RTT sample
            # grows by it on a perfect link; upstreams answer at once.
            if roles.get(peer, "peer") in ("client", "peer") or _loopback(peer):
                continue
            share = rtt / ttft_mean
            sc = _clamp((share - 0.1) / 0.4)  # RTT at half the mean TTFT: full weight
            if sc > 0:
                ev[f"kvheat_net_peer_rtt_seconds{{peer={peer}}}"] = rtt
                ev["mean TTFT in window (s)"] = round(ttft_mean, 4)
            score = max(score, sc)
    action = ("The network to a peer loses or delays packets: check the link, NIC and MTU "
              "to the peers in the evidence (Redis tier, replicas, clients).")
    return Finding("network", score, ev, action)


def overload(s: Snapshot) -> Finding:
    """Score more work than the server takes.

    503 refusals, and a waiting queue held above the running one through the window."""
    rej = s.deltas("kvheat_rejected_requests_total", "status")
    r503 = rej.get("503", 0.0)
    offered = s.finished() + sum(rej.values())
    share = _ratio(r503, offered)
    waiting = s.gauge_min("kvheat_queue_length", queue="waiting")
    running = s.gauge_min("kvheat_queue_length", queue="running")
    backlog = _ratio(waiting, max(running, 1.0))
    score = max(_clamp(share / 0.05), 0.8 * _clamp(backlog / 2.0))
    ev = {"kvheat_rejected_requests_total{status=503} Δ": r503,
          "requests offered Δ (finished + rejected)": offered,
          "kvheat_queue_length{queue=waiting} (held)": waiting,
          "kvheat_queue_length{queue=running} (held)": running}
    action = (f"The server refuses {share:.0%} of requests (503) and queues {backlog:.1f}x "
              "what it runs: add replicas, or raise max_num_seqs if the pool has room "
              "(kvheat_blocks free), and max_queued_requests only if latency allows.")
    return Finding("overload", score, ev, action)


def long_prompts(s: Snapshot) -> Finding:
    """Score prompts that grew, or requests refused as too long.

    The window's mean prompt against the mean before it; a refusal is an HTTP 400
    (context_length_exceeded is the usual one)."""
    fin_b = s.finished()
    fin_before = sum(v for (n, _), v in s.a.items() if n == "kvheat_requests_total")
    mean_now = _ratio(s.delta("kvheat_prompt_tokens_total"), fin_b)
    mean_before = _ratio(sum(v for (n, _), v in s.a.items()
                             if n == "kvheat_prompt_tokens_total"), fin_before)
    growth = _ratio(mean_now, mean_before) if mean_before > 0 and fin_b >= 2 else 0.0
    r400 = s.deltas("kvheat_rejected_requests_total", "status").get("400", 0.0)
    share400 = _ratio(r400, fin_b + s.rejected())
    computed = max(s.delta("kvheat_prompt_tokens_total") - s.delta("kvheat_cached_tokens_total"), 0.0)
    gen = s.delta("kvheat_generation_tokens_total")
    score = max(_clamp((growth - 1.0) / 1.0), 0.7 * _clamp(share400 / 0.1))
    ev = {"mean prompt tokens in window": round(mean_now, 1),
          "mean prompt tokens before": round(mean_before, 1),
          "kvheat_rejected_requests_total{status=400} Δ": r400,
          "prefill share of tokens computed": round(_ratio(computed, computed + gen), 3)}
    action = (f"Prompts are {growth:.1f}x longer than before (or refused as too long): "
              "prefill dominates the TTFT. Cap max_model_len / prompt size at the client, "
              "route long prompts to their own replicas, or raise max_num_batched_tokens.")
    return Finding("long_prompts", score, ev, action)


# A pause a request notices. Shorter ones are scheduling noise: with the GIL shared by a
# dozen busy threads (5 ms switch interval each) the loop wakes up to ~60 ms late.
LONG_PAUSE_S = 0.1


def _long_pauses(s: Snapshot, name: str, **want: str) -> tuple[float, float]:
    """(pauses of `LONG_PAUSE_S` or more, a lower bound of the seconds they took) in the
    window, from a histogram's bucket counters: each pause counted at its bucket's floor."""
    cum: dict[float, float] = {}
    for le, v in s.deltas(name + "_bucket", "le", **want).items():
        try:
            bound = float(le)  # "+Inf" included
        except ValueError:
            continue  # not a bucket bound: no pause to count
        if math.isnan(bound):
            continue
        cum[bound] = cum.get(bound, 0.0) + v
    n, lost, below, floor = 0.0, 0.0, 0.0, 0.0
    for bound in sorted(cum):
        inside = max(cum[bound] - below, 0.0)
        if floor >= LONG_PAUSE_S:
            n += inside
            lost += inside * floor
        below, floor = cum[bound], bound
    return n, lost


def stall(s: Snapshot) -> Finding:
    """Score event-loop stalls and long garbage collections.

    The event loop woke late, or garbage collections held the GIL, for long pauses that add
    up to a real share of the window (a single pause is not a cause: it must recur)."""
    dt = max(s.dt, 1e-3)
    n_lag, lost_lag = _long_pauses(s, "kvheat_event_loop_lag_seconds")
    n_gc, lost_gc = _long_pauses(s, "kvheat_gc_pause_seconds")
    n_gc2, _ = _long_pauses(s, "kvheat_gc_pause_seconds", generation="2")
    # Full weight at 5% of the window lost to long pauses, seen at least four times (two
    # are bad luck; a GC pause also shows as loop lag, so the larger of the two counts).
    share = max(lost_lag, lost_gc) / dt
    n = max(n_lag, n_gc)
    score = _clamp(share / 0.05) * _clamp((n - 1.0) / 3.0)
    ev = {f"kvheat_event_loop_lag_seconds >= {LONG_PAUSE_S} s, count Δ": n_lag,
          "kvheat_event_loop_lag_seconds_sum Δ": round(s.delta("kvheat_event_loop_lag_seconds_sum"), 4),
          f"kvheat_gc_pause_seconds >= {LONG_PAUSE_S} s, count Δ": n_gc,
          f"kvheat_gc_pause_seconds{{generation=2}} >= {LONG_PAUSE_S} s, count Δ": n_gc2,
          "kvheat_gc_pause_seconds_sum Δ": round(s.delta("kvheat_gc_pause_seconds_sum"), 4),
          "share of the window lost to long pauses (lower bound)": round(share, 3)}
    if lost_gc >= lost_lag / 2 and n_gc > 0:
        action = ("Garbage collection pauses the server (long generation-2 collections): "
                  "freeze the start-up heap (gc.freeze() after warm-up, as `kvheat serve` "
                  "does), raise the gen-2 threshold (gc.set_threshold), and find what keeps "
                  "allocating long-lived objects (a growing Python-side cache).")
    else:
        action = ("The event loop is blocked (it woke late while GC was quiet): move "
                  "blocking or CPU-heavy work off it (run_in_executor / the server's CPU "
                  "pool), look for sync I/O in request handlers or middleware, and check "
                  "for a thread holding the GIL (py-spy dump shows who).")
    return Finding("stall", score, ev, action)


# Also the order of equal scores: a cause that names a failing part (a tier, the network,
# one tenant) before one that describes the load (its size, its prompts, its mix), since
# fixing the part may remove the load's symptom (a slow tier's blocks also count as
# capacity misses). Overload before stall: more work than the server takes makes its
# event loop late too.
CAUSES: tuple[Cause, ...] = (tier_fault, tier_slow, network, tenant_quota, overload, stall,
                              long_prompts, capacity, entropy_drift)


def diagnose(s: Snapshot, floor: float = FLOOR) -> list[Finding]:
    """The causes scoring at `floor` or above, most likely first (ties in CAUSES order)."""
    found = [f for f in (c(s) for c in CAUSES) if f.score >= floor]
    return sorted(found, key=lambda f: -f.score)
