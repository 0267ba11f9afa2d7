"""Kernel network signals per peer, for /metrics of `kvheat serve` and `kvheat route`.

What a slow or lossy link looks like from this process: per remote address, the
retransmitted segments and smoothed RTT of its open TCP sockets (tcp_info), its
established / TIME_WAIT / CLOSE_WAIT sockets; per listening socket, the accept queue; and
host-wide (this network namespace) the TCP retransmits and listen-queue overflows.

Sources, each named in a `source` label:
- "sock_diag": the kernel's inet_diag netlink dump (the one `ss -ti` reads), spoken here
  with the stdlib socket module: the ABI is stable and small, and the binding in pyroute2
  is marked work in progress. Every socket's tcp_info comes with it.
- "proc": /proc/net/snmp and /proc/net/netstat counters (no per-peer detail).
- "ebpf": the tcp:tcp_retransmit_skb tracepoint, counted per (remote address, remote
  port, local port) by ONE long-lived `bpftrace` process per process (not BCC: it
  compiles against kernel headers, which servers often lack; bpftrace's tracepoints need
  only BTF and tracefs). kvheat_net_peer_retransmits_total counts the same segments as
  sock_diag's gauge (the kernel's tcp_sock.total_retrans), also those of sockets that
  closed between two scrapes, which sock_diag (open sockets only) misses. On by default where it can run: `bpftrace` on
  PATH, root (or CAP_BPF and CAP_PERFMON), tracefs mounted (mounted here when it is not
  and we may) and the tracepoint attaching; `ebpf=False` turns it off. Why it is off (or
  restarting) is the `state` label of kvheat_net_ebpf_state, and logged once.

Only this process's sockets count: those whose inode is one of /proc/self/fd. TIME_WAIT
sockets belong to no process (no inode), so they count when their local port is one of
our listening ports or their remote end is a known upstream (Redis, a replica). A kernel
retransmit event has no owner either: it counts when its remote end is a known upstream,
its local port one of our listening ports, or it matches a socket of ours that sock_diag
saw open at the last scrape (a short-lived connection of ours to any other peer, opened
and closed between scrapes, is not attributed).

Everything but eBPF is read at scrape time, in `collect()` (never on the engine thread);
bpftrace's per-second counts are read by a daemon thread, and a scrape only takes what it
added up since the last one. All of it is bounded: the top `max_peers` peers (known
upstreams first, then by retransmits, then by bytes) get their own `peer` label, the rest
add up under peer="other"; bpftrace's map holds at most `EBPF_MAX_KEYS` keys, its lines
at most `EBPF_MAX_LINE` bytes, and it is restarted with backoff when it exits. A source
that cannot be read (no netlink, no /proc) is counted in kvheat_net_signal_errors_total and
logged once; the other series are still reported, and /metrics never fails because of it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .ebpf_retransmits import EBPF_MAX_PEERS, RetransmitTracer, ip_text

log = logging.getLogger("kvheat.netsignals")

DEFAULT_MAX_PEERS = 16
OTHER = "other"
# A peer seen in several roles (a replica that is also a client) is labelled by the highest.
_RANK = {"peer": 0, "client": 1}  # any upstream role: above both

# Linux TCP states (include/net/tcp_states.h).
TCP_ESTABLISHED, TCP_TIME_WAIT, TCP_CLOSE_WAIT, TCP_LISTEN = 1, 6, 8, 10
STATE_LABELS = {TCP_ESTABLISHED: "established", TCP_TIME_WAIT: "time_wait",
                TCP_CLOSE_WAIT: "close_wait"}  # any other state is "other"

# Netlink / inet_diag constants (linux/netlink.h, linux/sock_diag.h, linux/inet_diag.h).
NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
INET_DIAG_INFO = 2
_NLMSG_HDR = struct.Struct("=IHHII")
_DIAG_MSG = struct.Struct("=BBBB2H16s16sI8sIIIII")  # inet_diag_msg, 72 bytes
_RTATTR = struct.Struct("=HH")
# struct tcp_info offsets (linux/tcp.h; the struct only ever grows at its end).
_TI_RTT, _TI_TOTAL_RETRANS, _TI_BYTES_ACKED, _TI_BYTES_RECEIVED = 68, 100, 120, 128


@dataclass(slots=True)
class SockSample:
    """One TCP socket as sock_diag reports it."""

    state: int
    local_port: int
    peer_ip: str
    peer_port: int
    inode: int
    rqueue: int  # LISTEN: connections waiting in the accept queue; else unread bytes
    wqueue: int  # LISTEN: the accept queue's limit (backlog); else unsent bytes
    retrans: int = 0  # tcpi_total_retrans
    rtt_us: int = 0  # tcpi_rtt: smoothed RTT
    bytes: int = 0  # tcpi_bytes_acked + tcpi_bytes_received


@dataclass(slots=True)
class PeerSample:
    """What this process's sockets to one remote address add up to."""

    ip: str
    role: str
    sockets: dict[str, int]  # state label -> count
    retrans: int = 0
    rtt_sum_us: int = 0  # over `rtt_n` established sockets: the mean is their quotient
    rtt_n: int = 0
    bytes: int = 0

    def add(self, s: SockSample) -> None:
        """Add one socket's state, retransmits, bytes and RTT."""
        label = STATE_LABELS.get(s.state, OTHER)
        self.sockets[label] = self.sockets.get(label, 0) + 1
        self.retrans += s.retrans
        self.bytes += s.bytes
        if s.state == TCP_ESTABLISHED and s.rtt_us:
            self.rtt_sum_us += s.rtt_us
            self.rtt_n += 1

    def merge(self, other: PeerSample) -> None:
        """Add another sample of the same peer."""
        for k, v in other.sockets.items():
            self.sockets[k] = self.sockets.get(k, 0) + v
        self.retrans += other.retrans
        self.bytes += other.bytes
        self.rtt_sum_us += other.rtt_sum_us
        self.rtt_n += other.rtt_n


def _ip(raw: bytes, family: int) -> str:
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, raw[:4])
    addr = ipaddress.IPv6Address(raw)
    # A v4 client of a dual-stack listener is the same peer as over v4.
    return str(addr.ipv4_mapped) if addr.ipv4_mapped else str(addr)


def sock_diag_dump(family: int) -> list[SockSample]:
    """Every TCP socket of `family` in this network namespace, with its tcp_info."""
    req = struct.pack("=BBBxI", family, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1),
                      0xFFFFFFFF) + bytes(48)  # all states; an empty inet_diag_sockid
    out: list[SockSample] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                       NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(2.0)  # a scrape waits this long at most
        nl.send(_NLMSG_HDR.pack(_NLMSG_HDR.size + len(req), SOCK_DIAG_BY_FAMILY,
                                NLM_F_REQUEST | NLM_F_DUMP, 1, 0) + req)
        while True:
            buf = nl.recv(1 << 17)
            off = 0
            while off + _NLMSG_HDR.size <= len(buf):
                length, mtype, _, _, _ = _NLMSG_HDR.unpack_from(buf, off)
                if length < _NLMSG_HDR.size:
                    raise OSError("sock_diag: malformed netlink message")
                body = buf[off + _NLMSG_HDR.size: off + length]
                off += (length + 3) & ~3
                if mtype == NLMSG_DONE:
                    return out
                if mtype == NLMSG_ERROR:
                    err = -struct.unpack_from("=i", body)[0]
                    raise OSError(err, f"sock_diag: {os.strerror(err)}")
                if mtype == SOCK_DIAG_BY_FAMILY:
                    out.append(_parse_diag(body))


def _parse_diag(body: bytes) -> SockSample:
    (fam, state, _, _, sport, dport, _src, dst, _, _, _, rq, wq, _, inode) = \
        _DIAG_MSG.unpack_from(body)
    s = SockSample(state, socket.ntohs(sport), _ip(dst, fam), socket.ntohs(dport), inode, rq,
                   wq)
    off = _DIAG_MSG.size
    while off + _RTATTR.size <= len(body):
        alen, atype = _RTATTR.unpack_from(body, off)
        if alen < _RTATTR.size:
            break
        if atype == INET_DIAG_INFO:
            ti = body[off + _RTATTR.size: off + alen]
            if len(ti) >= _TI_TOTAL_RETRANS + 4:
                s.rtt_us = struct.unpack_from("=I", ti, _TI_RTT)[0]
                s.retrans = struct.unpack_from("=I", ti, _TI_TOTAL_RETRANS)[0]
            if len(ti) >= _TI_BYTES_RECEIVED + 8:
                s.bytes = sum(struct.unpack_from("=QQ", ti, _TI_BYTES_ACKED))
        off += (alen + 3) & ~3
    return s


def own_socket_inodes(fd_dir: str = "/proc/self/fd") -> set[int]:
    """Inodes of this process's sockets (links "socket:[INODE]" in /proc/self/fd)."""
    inodes: set[int] = set()
    for fd in os.listdir(fd_dir):
        with contextlib.suppress(OSError):  # closed since listdir
            target = os.readlink(os.path.join(fd_dir, fd))
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    return inodes


def read_proc_counters(path: str, prefix: str) -> dict[str, int]:
    """The `prefix` table of /proc/net/snmp or /proc/net/netstat.

    A header line of names, then a line of values, both starting with "Prefix:"."""
    with open(path, encoding="ascii") as f:
        rows = [line.split()[1:] for line in f if line.startswith(prefix + ":")]
    if len(rows) < 2:
        raise OSError(f"{path}: no {prefix} table")
    return {k: int(v) for k, v in zip(rows[0], rows[1])}


def _resolve(host: str) -> set[str]:
    try:
        return {str(ipaddress.ip_address(host))}
    except ValueError:
        pass
    try:
        return {ip_text(str(a[4][0])) for a in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except OSError:
        return set()


def url_endpoint(url: str, default_port: int) -> tuple[str, int] | None:
    """(host, port) of redis://..., http://... URLs; None when it has no host."""
    parts = urlsplit(url)
    if not parts.hostname:
        return None
    return parts.hostname, parts.port or default_port


class NetSignalsCollector(Collector):
    """A prometheus_client collector of the kernel's network signals, read at each scrape.

    `upstreams()` gives (host, port, role) of the peers this process connects to (the Redis
    tier, the router's replicas); peers that connect to one of our listening ports are role
    "client"; anything else "peer". Host names are resolved once, when first seen (an
    upstream's address changing under its name is not followed).

    `ebpf` (default on) reads the process's RetransmitTracer, started with the first
    collector where bpftrace can run (`bpftrace`: its name or path); `close()` leaves it."""

    def __init__(self, upstreams: Callable[[], Iterable[tuple[str, int, str]]] = tuple,
                 max_peers: int = DEFAULT_MAX_PEERS, prefix: str = "kvheat_net",
                 proc_dir: str = "/proc", ebpf: bool = True,
                 bpftrace: str = "bpftrace") -> None:
        self.upstreams = upstreams
        self.max_peers = max_peers
        self.prefix = prefix
        self.proc_dir = proc_dir
        self.errors: dict[str, int] = {"sock_diag": 0, "proc": 0}
        self._logged: set[str] = set()
        self._resolved: dict[str, set[str]] = {}
        # For attributing kernel retransmit events (see the module docstring), as of the
        # last sock_diag read: our listening ports, our sockets' (peer, peer port, port).
        self._listen_ports: set[int] = set()
        self._conns: set[tuple[str, int, int]] = set()
        self.feed = RetransmitTracer.subscribe_shared(bpftrace) if ebpf else None
        self.ebpf_retrans: dict[str, int] = {}  # peer -> retransmits since we started
        self._ebpf_roles: dict[str, str] = {}
        self._ebpf_lock = threading.Lock()  # two scrapes at once must not both attribute
        self._ebpf_logged = ""

    def close(self) -> None:
        """Leave the eBPF source (bpftrace stops with its last collector)."""
        if self.feed is not None:
            self.feed.close()

    @property
    def ebpf_state(self) -> str:
        """Why eBPF is (not) counting: the tracer's state, or "disabled"."""
        return self.feed.tracer.state if self.feed is not None else "disabled"

    # ---- reading ----------------------------------------------------------------------
    def _failed(self, source: str, e: BaseException) -> None:
        self.errors[source] = self.errors.get(source, 0) + 1
        if source not in self._logged:  # once: a scrape every 15 s must not flood the log
            self._logged.add(source)
            log.warning("network signals: cannot read %s (%s); its series are left out, "
                        "errors counted in %s_signal_errors_total", source, e, self.prefix)

    def _roles(self) -> dict[tuple[str, int], str]:
        roles: dict[tuple[str, int], str] = {}
        for host, port, role in self.upstreams():
            if host not in self._resolved:
                self._resolved[host] = _resolve(host)
            for ip in self._resolved[host]:
                roles[(ip, port)] = role
        return roles

    def sample(self) -> tuple[list[PeerSample], list[SockSample]]:
        """This process's peers (top `max_peers`, then "other") and listening sockets.

        Raises OSError when sock_diag or /proc/self/fd cannot be read."""
        socks: list[SockSample] = []
        for family in (socket.AF_INET, socket.AF_INET6):
            socks += sock_diag_dump(family)
        mine = own_socket_inodes(os.path.join(self.proc_dir, "self", "fd"))
        listening = [s for s in socks if s.state == TCP_LISTEN and s.inode in mine]
        listen_ports = {s.local_port for s in listening}
        roles = self._roles()
        peers: dict[str, PeerSample] = {}
        self._listen_ports = listen_ports
        self._conns = {(s.peer_ip, s.peer_port, s.local_port) for s in socks
                       if s.inode and s.inode in mine}
        for s in socks:
            if s.state == TCP_LISTEN:
                continue
            role = roles.get((s.peer_ip, s.peer_port))
            if role is None and s.local_port in listen_ports:
                role = "client"
            # TIME_WAIT has no owner (inode 0): ours if it is on a port or upstream of ours.
            if not (s.inode in mine if s.inode else role is not None):
                continue
            p = peers.get(s.peer_ip)
            if p is None:
                p = peers[s.peer_ip] = PeerSample(s.peer_ip, role or "peer", {})
            elif _RANK.get(role or "peer", 2) > _RANK.get(p.role, 2):
                p.role = role or p.role  # an upstream also seen as a client: say upstream
            p.add(s)
        return self._top(list(peers.values())), listening

    def _top(self, peers: list[PeerSample]) -> list[PeerSample]:
        peers.sort(key=lambda p: (p.role in ("client", "peer"), -p.retrans, -p.bytes, p.ip))
        if len(peers) <= self.max_peers:
            return peers
        rest = PeerSample(OTHER, OTHER, {})
        for p in peers[self.max_peers:]:
            rest.merge(p)
        return peers[:self.max_peers] + [rest]

    # ---- the Collector interface ------------------------------------------------------
    def describe(self) -> Iterable[Metric]:
        """Nothing: registering must not read the kernel."""
        return ()  # no describe-time scrape: registering must not read the kernel

    def collect(self) -> Iterator[Metric]:
        """The signals read now; a source that fails is counted and logged, never raised."""
        n = self.prefix
        try:
            yield from self._collect_sock_diag(n)
        except Exception as e:  # never break /metrics: count, log once, go on
            self._failed("sock_diag", e)
        try:
            yield from self._collect_proc(n)
        except Exception as e:
            self._failed("proc", e)
        try:
            yield from self._collect_ebpf(n)
        except Exception as e:
            self._failed("ebpf", e)
        errors = CounterMetricFamily(f"{n}_signal_errors", "Scrapes where a network signal "
                                     "source could not be read (its series are left out).",
                                     labels=["source"])
        counts = dict(self.errors)
        if self.feed is not None:  # for eBPF also bpftrace's restarts and what was dropped
            t = self.feed.tracer
            counts["ebpf"] = counts.get("ebpf", 0) + t.restarts + t.dropped + self.feed.dropped
        for source, count in sorted(counts.items()):
            errors.add_metric([source], count)
        yield errors

    def _collect_sock_diag(self, n: str) -> Iterator[Metric]:
        peers, listening = self.sample()  # read everything first: all or nothing
        src = "sock_diag"
        labels = ["peer", "role", "source"]
        sockets = GaugeMetricFamily(f"{n}_peer_sockets", "This process's TCP sockets to the "
                                    "peer, by state (established, time_wait, close_wait, "
                                    "other).", labels=["peer", "role", "state", "source"])
        retrans = GaugeMetricFamily(f"{n}_peer_retransmitted_segments", "Segments "
                                    "retransmitted over this process's open sockets to the "
                                    "peer (tcpi_total_retrans; drops when a socket closes).",
                                    labels=labels)
        rtt = GaugeMetricFamily(f"{n}_peer_rtt_seconds", "Mean smoothed RTT (tcpi_rtt) of "
                                "the established sockets to the peer.", labels=labels)
        traffic = GaugeMetricFamily(f"{n}_peer_bytes", "Bytes acked plus received over "
                                    "this process's open sockets to the peer.", labels=labels)
        for p in peers:
            for state, count in sorted(p.sockets.items()):
                sockets.add_metric([p.ip, p.role, state, src], count)
            retrans.add_metric([p.ip, p.role, src], p.retrans)
            traffic.add_metric([p.ip, p.role, src], p.bytes)
            if p.rtt_n:
                rtt.add_metric([p.ip, p.role, src], p.rtt_sum_us / p.rtt_n / 1e6)
        queue = GaugeMetricFamily(f"{n}_listen_queue", "This process's listening sockets: "
                                  "connections waiting to be accepted (kind=queued) and the "
                                  "backlog limit (kind=backlog).",
                                  labels=["port", "kind", "source"])
        for port in sorted({s.local_port for s in listening}):
            on = [s for s in listening if s.local_port == port]  # v4 and v6 on one port
            queue.add_metric([str(port), "queued", src], sum(s.rqueue for s in on))
            queue.add_metric([str(port), "backlog", src], max(s.wqueue for s in on))
        yield from (sockets, retrans, rtt, traffic, queue)

    def _collect_proc(self, n: str) -> Iterator[Metric]:
        net = os.path.join(self.proc_dir, "net")
        tcp = read_proc_counters(os.path.join(net, "snmp"), "Tcp")
        ext = read_proc_counters(os.path.join(net, "netstat"), "TcpExt")
        for name, value, doc in (
                ("tcp_retransmitted_segments", tcp.get("RetransSegs", 0),
                 "TCP segments retransmitted, host-wide (this network namespace)."),
                ("listen_overflows", ext.get("ListenOverflows", 0),
                 "Connections dropped because an accept queue was full, host-wide."),
                ("listen_drops", ext.get("ListenDrops", 0),
                 "Connections dropped at a listening socket for any reason, host-wide.")):
            c = CounterMetricFamily(f"{n}_{name}", doc, labels=["source"])
            c.add_metric(["proc"], value)
            yield c

    def _attribute_ebpf(self) -> None:
        """Add the tracer's new events to the per-peer totals, ours only."""
        if self.feed is None:
            return
        events = self.feed.drain()
        if not events:
            return
        roles = self._roles()
        for (ip, dport, sport), count in events.items():
            role = roles.get((ip, dport))
            if role is None and sport in self._listen_ports:
                role = "client"
            if role is None and (ip, dport, sport) in self._conns:
                role = "peer"
            if role is None:
                continue  # another process's socket (or one of ours sock_diag never saw)
            if ip not in self.ebpf_retrans and len(self.ebpf_retrans) >= EBPF_MAX_PEERS:
                ip = role = OTHER
            self.ebpf_retrans[ip] = self.ebpf_retrans.get(ip, 0) + count
            old = self._ebpf_roles.get(ip)
            if old is None or _RANK.get(role, 2) > _RANK.get(old, 2):
                self._ebpf_roles[ip] = role

    def _collect_ebpf(self, n: str) -> Iterator[Metric]:
        state = self.ebpf_state
        if state not in ("on", "starting", self._ebpf_logged):
            self._ebpf_logged = state  # once per state: why the eBPF series are missing
            detail = self.feed.tracer.detail if self.feed is not None else ""
            log.info("network signals: eBPF retransmit counts off (%s%s)", state,
                     f": {detail}" if detail else "")
        up = GaugeMetricFamily(f"{n}_ebpf_state", "1 for the eBPF source's state: on, "
                               "starting, or why it is off (disabled, no_bpftrace, "
                               "no_privileges, no_tracefs, attach_failed, exited).",
                               labels=["state"])
        up.add_metric([state], 1)
        yield up
        if self.feed is None:
            return
        with self._ebpf_lock:
            self._attribute_ebpf()
            totals, roles = dict(self.ebpf_retrans), dict(self._ebpf_roles)
        retrans = CounterMetricFamily(f"{n}_peer_retransmits", "TCP segments retransmitted "
                                      "to the peer (the kernel's count that the sock_diag "
                                      "gauge reads), from the tcp:tcp_retransmit_skb "
                                      "tracepoint since the tracer started: also those of "
                                      "sockets closed since, which the gauge misses.",
                                      labels=["peer", "role", "source"])
        ranked = sorted(totals.items(), key=lambda kv: (
            kv[0] == OTHER, roles[kv[0]] in ("client", "peer"), -kv[1], kv[0]))
        rest = sum(c for _, c in ranked[self.max_peers:])
        for ip, count in ranked[:self.max_peers]:
            if ip != OTHER:
                retrans.add_metric([ip, roles[ip], "ebpf"], count)
            else:
                rest += count
        if rest:
            retrans.add_metric([OTHER, OTHER, "ebpf"], rest)
        yield retrans
