"""Per-peer TCP retransmits from eBPF, for kvheat/server/netsignals.py's "ebpf" source: the
tcp:tcp_retransmit_skb tracepoint counted by ONE long-lived `bpftrace` process per
process, read by a daemon thread, bounded, restarted with backoff, killed with us."""

from __future__ import annotations

import atexit
import ctypes
import ipaddress
import json
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
import weakref

log = logging.getLogger("kvheat.netsignals")


def ip_text(ip: str) -> str:
    """An address as every kvheat network series labels it.

    IPv4-mapped IPv6 as IPv4, no zone: the same peer from sock_diag and from eBPF."""
    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
        return str(addr.ipv4_mapped)
    return str(addr)

# ---- eBPF: tcp:tcp_retransmit_skb through one bpftrace process ---------------------------
# Per second, the segments retransmitted by (remote address, remote port, local port),
# then cleared: one JSON line {"type": "map", "data": {"@r": {"ADDR,DPORT,SPORT": N}}}.
# One event is one skb, which under TSO carries several segments: the count is the growth
# of the socket's tcp_sock.total_retrans (BTF-resolved; the kernel adds to it just before
# the tracepoint, and it is what sock_diag's tcpi_total_retrans reads), from @last, its
# value at the socket's previous event (forgotten when the socket closes). The
# tracepoint's ports are in host order. END clears the maps: no final dump on exit.
EBPF_PROGRAM = """
tracepoint:tcp:tcp_retransmit_skb {
  $total = (uint64)((struct tcp_sock *)args->skaddr)->total_retrans;
  $new = $total;
  if ($total >= @last[args->skaddr]) { $new = $total - @last[args->skaddr]; }
  @last[args->skaddr] = $total;
  if (args->family == 2) { @r[ntop(args->daddr), args->dport, args->sport] = sum($new); }
  else { @r[ntop(args->daddr_v6), args->dport, args->sport] = sum($new); }
}
tracepoint:sock:inet_sock_set_state /args->newstate == 7 && args->protocol == 6/ {
  delete(@last[args->skaddr]);
}
interval:s:1 { print(@r); clear(@r); }
END { clear(@r); clear(@last); }
"""
EBPF_MAX_KEYS = 4096  # per bpftrace map (BPFTRACE_MAP_KEYS_MAX): keys beyond are lost
EBPF_MAX_LINE = 1 << 20  # a longer line is skipped (4096 keys take ~200 KB)
EBPF_MAX_PENDING = 4096  # (addr, dport, sport) keys waiting for a scrape; more are dropped
EBPF_MAX_PEERS = 1024  # peers counted apart (then all add up under "other")
EBPF_BACKOFF_S = (1.0, 300.0)  # first and longest wait before a restart
TRACEFS = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")
_TRACEPOINT = "events/tcp/tcp_retransmit_skb"
_CAP_PERFMON, _CAP_BPF = 38, 39
_PR_SET_PDEATHSIG = 1
# Why eBPF is (not) counting: the `state` label of kvheat_net_ebpf_state.
EBPF_STATES = ("on", "starting", "disabled", "no_bpftrace", "no_privileges", "no_tracefs",
               "attach_failed", "exited")


def _has_bpf_privileges() -> bool:
    if os.geteuid() == 0:
        return True
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            caps = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError):
        return False
    return all(caps >> c & 1 for c in (_CAP_BPF, _CAP_PERFMON))


def _tracefs() -> str | None:
    """Where the tracepoint is, mounting tracefs first when it is not and we may."""
    for d in TRACEFS:
        if os.path.exists(os.path.join(d, _TRACEPOINT)):
            return d
    if os.geteuid() == 0 and shutil.which("mount") and os.path.isdir(TRACEFS[0]):
        subprocess.run(["mount", "-t", "tracefs", "nodev", TRACEFS[0]],
                       capture_output=True, timeout=10, check=False)
        if os.path.exists(os.path.join(TRACEFS[0], _TRACEPOINT)):
            return TRACEFS[0]
    return None


_libc: ctypes.CDLL | None = None  # loaded in the parent: no dlopen between fork and exec


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the thread that started it ends (the
    reader thread; the process exiting ends it too), so no bpftrace outlives us."""
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class RetransmitFeed:
    """One collector's view of the process's RetransmitTracer.

    What it counted since this feed's last `drain()` (bounded: EBPF_MAX_PENDING keys, the
    rest dropped)."""

    def __init__(self, tracer: RetransmitTracer) -> None:
        self.tracer = tracer
        self.pending: dict[tuple[str, int, int], int] = {}
        self.dropped = 0

    def drain(self) -> dict[tuple[str, int, int], int]:
        """The retransmits counted since the last drain, by (address, remote port, local port)."""
        with self.tracer.lock:
            out, self.pending = self.pending, {}
        return out

    def close(self) -> None:
        """Stop receiving (the tracer stops with its last feed)."""
        self.tracer.unsubscribe(self)


class RetransmitTracer:
    """TCP retransmits per (remote address, remote port, local port), host-wide, from bpftrace.

    One long-lived bpftrace process read by a daemon thread, one per process
    (`subscribe_shared()`), whatever the number of collectors: each reads it through its own
    RetransmitFeed, whose `drain()` never waits for bpftrace. The last feed closed stops it."""

    _shared: dict[str, RetransmitTracer] = {}
    _shared_lock = threading.Lock()

    @classmethod
    def subscribe_shared(cls, bpftrace: str = "bpftrace") -> RetransmitFeed:
        """A feed of the process's one tracer of `bpftrace` (started, or again after a fork)."""
        with cls._shared_lock:
            t = cls._shared.get(bpftrace)
            if t is None or t.pid != os.getpid() or t.closed:  # none yet, or forked
                t = cls._shared[bpftrace] = RetransmitTracer(bpftrace)
            return t.subscribe()

    def __init__(self, bpftrace: str = "bpftrace") -> None:
        self.name = bpftrace
        self.bpftrace = shutil.which(bpftrace)
        self.pid = os.getpid()
        self.state = "starting"
        self.detail = ""  # what bpftrace or the check said, for the log
        self.restarts = 0  # exits and failed attaches
        self.dropped = 0  # lines left out by the bounds
        self.closed = False
        self.lock = threading.Lock()
        # Weak: a collector dropped without close() lets go of its feed.
        self._feeds: weakref.WeakSet[RetransmitFeed] = weakref.WeakSet()
        self._stop = threading.Event()
        self._proc: subprocess.Popen[bytes] | None = None
        self._thread = threading.Thread(target=self._run, name="kvheat-bpftrace", daemon=True)
        atexit.register(self.close)
        self._thread.start()

    def subscribe(self) -> RetransmitFeed:
        """A new feed of this tracer."""
        feed = RetransmitFeed(self)
        with self.lock:
            self._feeds.add(feed)
        return feed

    def unsubscribe(self, feed: RetransmitFeed) -> None:
        """Drop `feed`; the last one closed stops the tracer."""
        with self.lock:
            self._feeds.discard(feed)
            last = not self._feeds
        if last:
            self.close()

    def close(self) -> None:
        """Stop reading and kill bpftrace (at exit too)."""
        self.closed = True
        self.state = "exited"
        self._stop.set()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
        if self._thread is not threading.current_thread():
            self._thread.join(5)
        atexit.unregister(self.close)

    # ---- the reader thread ------------------------------------------------------------
    def _unavailable(self) -> str | None:
        if self.bpftrace is None:
            return "no_bpftrace"
        if not _has_bpf_privileges():
            return "no_privileges"
        if _tracefs() is None:
            return "no_tracefs"
        return None

    def _run(self) -> None:
        try:
            why = self._unavailable()
        except (OSError, subprocess.SubprocessError) as e:
            why, self.detail = "no_tracefs", str(e)
        if why is not None:
            self.state = why
            return
        backoff = EBPF_BACKOFF_S[0]
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                attached = self._run_once()
            except Exception as e:  # could not start it, or it said something odd
                attached, self.detail = self.state == "on", f"{type(e).__name__}: {e}"
            if self._stop.is_set():
                break
            self.restarts += 1
            self.state = "exited" if attached else "attach_failed"
            log.warning("network signals: bpftrace %s (%s); restarting in %.0f s",
                        "exited" if attached else "did not attach", self.detail or "no output",
                        backoff)
            if attached and time.monotonic() - started > 60:
                backoff = EBPF_BACKOFF_S[0]  # it ran a while: a fresh failure, not a loop
            self._stop.wait(backoff)
            backoff = min(backoff * 2, EBPF_BACKOFF_S[1])

    def _run_once(self) -> bool:
        """Run bpftrace until it exits (or close()); True when its probes had attached."""
        global _libc
        assert self.bpftrace is not None
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        env = dict(os.environ, BPFTRACE_MAP_KEYS_MAX=str(EBPF_MAX_KEYS))
        proc = self._proc = subprocess.Popen(
            [self.bpftrace, "-f", "json", "-e", EBPF_PROGRAM], stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
            preexec_fn=_die_with_parent)
        assert proc.stdout is not None
        attached = False
        try:
            if self._stop.is_set():  # close() ran while it started
                return False
            while True:
                line = proc.stdout.readline(EBPF_MAX_LINE + 1)
                if not line:
                    return attached
                if len(line) > EBPF_MAX_LINE:  # skip the rest of an oversized line
                    self.dropped += 1
                    while line and not line.endswith(b"\n"):
                        line = proc.stdout.readline(EBPF_MAX_LINE)
                    continue
                try:
                    msg = json.loads(line)
                except ValueError:  # a warning on stderr: keep the last for the log
                    if line.strip():
                        self.detail = line.decode(errors="replace").strip()[:200]
                    continue
                data = msg.get("data") if isinstance(msg, dict) else None
                if not isinstance(data, dict):
                    continue
                if msg.get("type") == "attached_probes":
                    attached = True
                    self.state = "on"
                elif msg.get("type") == "map" and isinstance(data.get("@r"), dict):
                    self._add(data["@r"])
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stdout.close()

    def _add(self, counts: dict[str, int]) -> None:
        parsed: list[tuple[tuple[str, int, int], int]] = []
        for key, n in counts.items():
            try:
                addr, dport, sport = key.rsplit(",", 2)
                parsed.append(((ip_text(addr), int(dport), int(sport)), int(n)))
            except (ValueError, TypeError, AttributeError):
                self.dropped += 1
        with self.lock:
            for feed in self._feeds:
                for k, n in parsed:
                    if k in feed.pending or len(feed.pending) < EBPF_MAX_PENDING:
                        feed.pending[k] = feed.pending.get(k, 0) + n
                    else:
                        feed.dropped += 1
