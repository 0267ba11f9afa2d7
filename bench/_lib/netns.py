"""A lossy link on this machine: a veth pair into a new network namespace that drops a
share of the TCP packets crossing it (tests/test_netsignals.py and the doctor bench's
`network` scenario). Needs root and iproute2; the loss is tc netem on the host side's
egress (with an optional delay), else, on kernels without sch_netem, an nftables rule on
the namespace's input (no delay then)."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from dataclasses import dataclass


class LinkUnavailable(RuntimeError):
    """Why a lossy link cannot be built here."""


def _sh(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=20)


@dataclass
class LossyLink:
    ns: str
    host_if: str
    local_ip: str  # this side of the pair
    peer_ip: str  # the namespace's side
    loss: str  # how the loss was applied: "netem" or "nftables"

    def close(self) -> None:
        _sh("ip", "link", "del", self.host_if)  # deletes its peer too
        _sh("ip", "netns", "del", self.ns)


def lossy_link(loss_pct: int, delay_ms: int = 0, subnet: int = 213) -> LossyLink:
    """A link through 10.`subnet`.x.1 (here) and .2 (the namespace) that loses `loss_pct`%
    of this side's packets; raises LinkUnavailable, with nothing left behind."""
    if shutil.which("ip") is None:
        raise LinkUnavailable("no `ip` command")
    tag = (os.getpid() + random.randrange(1000)) % 10000
    ns, host_if = f"kvheat-n{tag}", f"kvn{tag}a"
    net = f"10.{subnet}.{tag % 250}"
    link = LossyLink(ns, host_if, f"{net}.1", f"{net}.2", "")
    r = _sh("ip", "netns", "add", ns)
    if r.returncode != 0:
        raise LinkUnavailable(f"ip netns add: {r.stderr.strip()}")
    try:
        for cmd in (["ip", "link", "add", host_if, "type", "veth", "peer", "name",
                     f"kvn{tag}b", "netns", ns],
                    ["ip", "addr", "add", f"{link.local_ip}/30", "dev", host_if],
                    ["ip", "link", "set", host_if, "up"],
                    ["ip", "-n", ns, "addr", "add", f"{link.peer_ip}/30", "dev", f"kvn{tag}b"],
                    ["ip", "-n", ns, "link", "set", f"kvn{tag}b", "up"],
                    ["ip", "-n", ns, "link", "set", "lo", "up"]):
            r = _sh(*cmd)
            if r.returncode != 0:
                raise LinkUnavailable(f"{' '.join(cmd)}: {r.stderr.strip()}")
        netem = ["loss", f"{loss_pct}%"] + (["delay", f"{delay_ms}ms"] if delay_ms else [])
        nft = (["add", "table", "inet", "kvloss"],
               ["add", "chain", "inet", "kvloss", "in", "{ type filter hook input priority 0; }"],
               ["add", "rule", "inet", "kvloss", "in", "meta", "l4proto", "tcp", "numgen",
                "random", "mod", str(round(100 / loss_pct)), "==", "0", "drop"])
        if shutil.which("tc") and _sh("tc", "qdisc", "add", "dev", host_if, "root", "netem",
                                      *netem).returncode == 0:
            link.loss = "netem"
        elif shutil.which("nft") and all(
                _sh("ip", "netns", "exec", ns, "nft", *c).returncode == 0 for c in nft):
            link.loss = "nftables"
        else:
            raise LinkUnavailable("neither tc netem nor nftables can drop packets here")
    except BaseException:
        link.close()
        raise
    return link
