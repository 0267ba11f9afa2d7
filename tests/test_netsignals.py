"""Kernel network signals (kvheat/server/netsignals.py).

The lossy-link test builds its own network namespace and veth pair (10.213.x.1 here,
10.213.x.2 in the namespace: traffic only crosses that pair), drops 20% of the packets on
it (tc netem, else an nftables rule inside the namespace where the kernel lacks netem),
and checks that the collector sees the retransmits of this process's socket to the peer:
from sock_diag while the socket is open, and from eBPF (bpftrace on the tcp_retransmit_skb
tracepoint) after it closed. Without the privileges to build it, or without bpftrace, the
test skips, and fails under CI (as conftest does for a missing redis-server)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import NoReturn

import pytest
from conftest import unavailable
from prometheus_client import CollectorRegistry, generate_latest

from bench._lib.netns import LinkUnavailable, LossyLink
from bench._lib.netns import lossy_link as make_lossy_link
from kvheat.server.ebpf_retransmits import EBPF_STATES
from kvheat.server.netsignals import (
    NetSignalsCollector,
    PeerSample,
    read_proc_counters,
)


def _unavailable(why: str) -> NoReturn:
    unavailable(f"cannot build a lossy link: {why}")


@pytest.fixture
def lossy_link() -> Iterator[LossyLink]:
    try:
        link = make_lossy_link(20, subnet=213)  # 20% of this side's packets dropped
    except LinkUnavailable as e:
        _unavailable(str(e))
    try:
        yield link
    finally:
        link.close()


# The server in the namespace: accept one connection, read until EOF, answer the byte
# count; it gives up after 60 s whatever happens.
_SERVER = """
import socket, sys
socket.setdefaulttimeout(60)
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); n = 0
while chunk := c.recv(1 << 16):
    n += len(chunk)
c.sendall(str(n).encode()); c.close()
"""


def _peer(collector: NetSignalsCollector, ip: str) -> PeerSample | None:
    peers, _ = collector.sample()
    return next((p for p in peers if p.ip == ip), None)


def test_retransmits_on_a_lossy_link(lossy_link: LossyLink) -> None:
    srv = subprocess.Popen(["ip", "netns", "exec", lossy_link.ns, sys.executable, "-c",
                            _SERVER, lossy_link.peer_ip], stdout=subprocess.PIPE, text=True)
    try:
        assert srv.stdout is not None
        port = int(srv.stdout.readline())
        collector = NetSignalsCollector(lambda: [(lossy_link.peer_ip, port, "replica")],
                                        ebpf=False)
        payload = b"x" * (2 << 20)  # 2 MiB: hundreds of segments, tens of them dropped
        with socket.create_connection((lossy_link.peer_ip, port), timeout=60) as c:
            c.sendall(payload)
            # Read tcp_info while the socket is open (closed, it is a TIME_WAIT socket
            # without one), once the peer acked everything (all retransmits are done).
            deadline = time.monotonic() + 60
            while True:
                peer = _peer(collector, lossy_link.peer_ip)
                if peer is None or peer.bytes >= len(payload) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            c.shutdown(socket.SHUT_WR)
            assert int(c.recv(64)) == len(payload)
        assert peer is not None and peer.role == "replica"
        print(f"{lossy_link.loss} 20% loss: {peer.retrans} retransmitted segments, "
              f"rtt {peer.rtt_sum_us / max(peer.rtt_n, 1) / 1e3:.2f} ms")
        assert peer.retrans > 0
        reg = CollectorRegistry()
        reg.register(collector)
        assert reg.get_sample_value("kvheat_net_signal_errors_total",
                                    {"source": "sock_diag"}) == 0
        # The socket closed by us lingers in TIME_WAIT: counted, it is a known upstream.
        text = generate_latest(reg).decode()
        assert f'peer="{lossy_link.peer_ip}",role="replica",source="sock_diag"' in text
    finally:
        srv.kill()
        srv.wait(timeout=10)


def _ebpf_state(collector: NetSignalsCollector) -> str:
    """The eBPF source's state once it settled (bpftrace takes a second or two to attach),
    as /metrics reports it."""
    deadline = time.monotonic() + 30
    while collector.ebpf_state == "starting" and time.monotonic() < deadline:
        time.sleep(0.1)
    reg = CollectorRegistry()
    reg.register(collector)
    states = [s for m in reg.collect() if m.name == "kvheat_net_ebpf_state"
              for s in m.samples if s.value == 1]
    assert len(states) == 1 and states[0].labels["state"] == collector.ebpf_state
    assert collector.ebpf_state in EBPF_STATES
    return collector.ebpf_state


def test_ebpf_retransmits_of_a_closed_socket_on_a_lossy_link(lossy_link: LossyLink) -> None:
    srv = subprocess.Popen(["ip", "netns", "exec", lossy_link.ns, sys.executable, "-c",
                            _SERVER, lossy_link.peer_ip], stdout=subprocess.PIPE, text=True)
    collector: NetSignalsCollector | None = None
    try:
        assert srv.stdout is not None
        port = int(srv.stdout.readline())
        collector = NetSignalsCollector(lambda: [(lossy_link.peer_ip, port, "replica")])
        state = _ebpf_state(collector)
        if state != "on":  # the reason is reported (checked above); say it
            detail = collector.feed.tracer.detail if collector.feed else ""
            unavailable(f"eBPF retransmit counts are off here: {state} {detail}".strip())
        payload = b"x" * (2 << 20)
        with socket.create_connection((lossy_link.peer_ip, port), timeout=60) as c:
            c.sendall(payload)
            deadline = time.monotonic() + 60
            while (open_peer := _peer(collector, lossy_link.peer_ip)) is not None and \
                    open_peer.bytes < len(payload) and time.monotonic() < deadline:
                time.sleep(0.05)  # until all is acked: sock_diag's count for comparison
            c.shutdown(socket.SHUT_WR)
            assert int(c.recv(64)) == len(payload)
        assert open_peer is not None and open_peer.retrans > 0
        # Closed, the socket's tcp_info is gone from sock_diag; the kernel's events stay.
        reg = CollectorRegistry()
        reg.register(collector)
        labels = {"peer": lossy_link.peer_ip, "role": "replica", "source": "ebpf"}
        deadline = time.monotonic() + 15  # bpftrace prints its counts every second
        got, last = None, -1.0
        while time.monotonic() < deadline and not (got and got == last):  # until it settles
            time.sleep(1.5)
            got, last = reg.get_sample_value("kvheat_net_peer_retransmits_total", labels), got or 0
        print(f"{lossy_link.loss} 20% loss, socket closed: eBPF counted {got} retransmitted "
              f"segments; sock_diag {open_peer.retrans} while it was open")
        # The same kernel counter (FIN retransmits after the last read may add a few).
        assert got is not None and got >= open_peer.retrans
        assert reg.get_sample_value("kvheat_net_signal_errors_total", {"source": "ebpf"}) == 0
        assert collector.feed is not None
        tracer = collector.feed.tracer
        proc = tracer._proc
        assert proc is not None and proc.poll() is None
        collector.close()
        tracer.close()  # the last collector's close() does it; others may be alive here
        assert proc.poll() is not None  # no bpftrace left behind
    finally:
        if collector is not None:
            collector.close()
        srv.kill()
        srv.wait(timeout=10)


def test_ebpf_says_why_it_is_off() -> None:
    assert _ebpf_state(NetSignalsCollector(ebpf=False)) == "disabled"
    missing = NetSignalsCollector(bpftrace="kvheat-no-such-bpftrace")
    try:
        assert _ebpf_state(missing) == "no_bpftrace"
    finally:
        missing.close()


def test_loopback_has_no_retransmits_and_other_processes_are_left_out() -> None:
    # Another process's connection on 127.0.0.3 must not show up among our peers.
    other = subprocess.Popen([sys.executable, "-c", (
        "import socket, time\n"
        "s = socket.socket(); s.bind(('127.0.0.3', 0)); s.listen()\n"
        "c = socket.create_connection(s.getsockname()); a, _ = s.accept()\n"
        "print('up', flush=True); time.sleep(30)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "up"
        with socket.socket() as lst:
            lst.bind(("127.0.0.1", 0))
            lst.listen()
            got = bytearray()

            def serve() -> None:
                a, _ = lst.accept()
                with a:
                    while chunk := a.recv(1 << 16):
                        got.extend(chunk)

            t = threading.Thread(target=serve, daemon=True)
            t.start()
            with socket.create_connection(lst.getsockname(), timeout=10) as c:
                c.sendall(b"y" * (2 << 20))
                collector = NetSignalsCollector(ebpf=False)
                peers, listening = collector.sample()
                c.shutdown(socket.SHUT_WR)
            t.join(10)
            port = lst.getsockname()[1]
        assert len(got) == 2 << 20
        by_ip = {p.ip: p for p in peers}
        assert "127.0.0.3" not in by_ip
        lo = by_ip["127.0.0.1"]
        assert lo.role == "client"  # one end is on our listening port
        assert lo.sockets.get("established") == 2 and lo.retrans <= 1  # ~0 without loss
        assert port in {s.local_port for s in listening}
    finally:
        other.kill()
        other.wait(timeout=10)


def test_top_peers_and_other_bucket() -> None:
    c = NetSignalsCollector(max_peers=2, ebpf=False)
    peers = [PeerSample(f"10.0.0.{i}", "client", {"established": 1}, retrans=i, bytes=10)
             for i in range(5)] + [PeerSample("10.1.0.1", "redis", {"established": 1})]
    top = c._top(peers)
    assert [p.ip for p in top] == ["10.1.0.1", "10.0.0.4", "other"]  # upstreams first
    assert top[-1].retrans == 0 + 1 + 2 + 3 and top[-1].sockets == {"established": 4}


def test_unreadable_sources_never_break_the_scrape(tmp_path, caplog) -> None:
    reg = CollectorRegistry()
    c = NetSignalsCollector(proc_dir=str(tmp_path), ebpf=False)  # no fd dir, no net/snmp
    reg.register(c)
    generate_latest(reg)
    generate_latest(reg)
    assert c.errors == {"sock_diag": 2, "proc": 2}  # counted per scrape (this one: 3)
    assert 'kvheat_net_signal_errors_total{source="proc"} 3.0' in generate_latest(reg).decode()
    assert sum("cannot read" in r.message for r in caplog.records) == 2  # once per source


def test_proc_counters(tmp_path) -> None:
    (tmp_path / "netstat").write_text("TcpExt: SyncookiesSent ListenOverflows ListenDrops\n"
                                      "TcpExt: 0 7 9\nIpExt: InNoRoutes\nIpExt: 0\n")
    assert read_proc_counters(str(tmp_path / "netstat"), "TcpExt") == {
        "SyncookiesSent": 0, "ListenOverflows": 7, "ListenDrops": 9}
    assert read_proc_counters("/proc/net/snmp", "Tcp")["RetransSegs"] >= 0


def test_one_bpftrace_per_process_and_its_events_attributed_to_our_peers() -> None:
    name = "kvheat-no-such-bpftrace"  # the tracer then never starts a process
    a = NetSignalsCollector(lambda: [("10.9.0.1", 6379, "redis")], ebpf=True, bpftrace=name)
    b = NetSignalsCollector(bpftrace=name)
    assert a.feed is not None and b.feed is not None and a.feed.tracer is b.feed.tracer
    a._listen_ports, a._conns = {8000}, {("10.9.0.3", 443, 40000)}
    a.feed.pending = {("10.9.0.1", 6379, 41000): 3,  # to the Redis upstream
                      ("10.9.0.2", 50000, 8000): 2,  # a client of our listening port
                      ("10.9.0.3", 443, 40000): 1,  # a socket of ours sock_diag saw
                      ("10.9.0.4", 443, 40001): 7}  # someone else's
    a._attribute_ebpf()
    a.feed.pending = {("10.9.0.1", 6379, 41001): 1}  # a later connection: counts add up
    a._attribute_ebpf()
    assert a.ebpf_retrans == {"10.9.0.1": 4, "10.9.0.2": 2, "10.9.0.3": 1}
    assert a._ebpf_roles == {"10.9.0.1": "redis", "10.9.0.2": "client", "10.9.0.3": "peer"}
    assert b.feed.drain() == {}  # each collector has its own feed
    tracer = a.feed.tracer
    a.close()
    assert not tracer.closed  # b still reads it
    b.close()
    assert tracer.closed


def test_bpftrace_output_parsed_bounded_and_restarted(tmp_path) -> None:
    if os.geteuid() != 0 or not os.path.exists("/sys/kernel/tracing/events/tcp"):
        pytest.skip("the tracer checks root and tracefs before it starts bpftrace")
    fake = tmp_path / "fake-bpftrace"  # says what bpftrace -f json says, then exits
    fake.write_text("#!/bin/sh\n"
                    "echo 'WARNING: a warning on stderr'\n"
                    "echo '{\"type\": \"attached_probes\", \"data\": {\"probes\": 4}}'\n"
                    "echo '{\"type\": \"map\", \"data\": {\"@r\": {\"::ffff:10.9.0.1,6379,4100\": 2,"
                    " \"bad\": 1}}}'\n"
                    "echo '{\"type\": \"map\", \"data\": 5}'\n"
                    "echo '[1, 2]'\n"
                    "exit 1\n")
    fake.chmod(0o755)
    c = NetSignalsCollector(lambda: [("10.9.0.1", 6379, "redis")], bpftrace=str(fake))
    try:
        assert c.feed is not None
        tracer = c.feed.tracer
        deadline = time.monotonic() + 10
        while tracer.restarts < 2 and time.monotonic() < deadline:  # backoff: 1 s, 2 s
            time.sleep(0.1)
        assert tracer.restarts >= 2 and tracer.state == "exited"
        assert tracer.detail == "WARNING: a warning on stderr"
        reg = CollectorRegistry()
        reg.register(c)
        got = reg.get_sample_value("kvheat_net_peer_retransmits_total",
                                   {"peer": "10.9.0.1", "role": "redis", "source": "ebpf"})
        assert got is not None and got >= 4 and got % 2 == 0  # 2 per run, v4-mapped read
        assert reg.get_sample_value("kvheat_net_ebpf_state", {"state": "exited"}) == 1
        errors = reg.get_sample_value("kvheat_net_signal_errors_total", {"source": "ebpf"})
        assert errors is not None and errors >= 4  # restarts, plus the "bad" key per run
    finally:
        c.close()
