"""NUMA placement of host-tier buffers (docs/tiers.md, "Stores": the host tier).

Linux places a page on the node of the CPU that first writes it. So a buffer is put on a
node by allocating it and writing every page once from a thread bound to that node's CPUs
(`sched_setaffinity` on the calling thread only, restored afterwards). The write is done
by numpy in the calling thread: torch's own fill may run on its worker threads, which are
bound elsewhere. On a machine with one node (or no sysfs) nothing is bound.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

SYSFS_NODES = Path("/sys/devices/system/node")


@dataclass(slots=True, frozen=True)
class NumaNode:
    """A NUMA node: its id and the CPUs on it."""

    id: int
    cpus: frozenset[int]


def parse_cpulist(text: str) -> set[int]:
    """`0-3,8,10-11` -> {0, 1, 2, 3, 8, 10, 11} (the kernel's cpulist format)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def numa_nodes(root: Path = SYSFS_NODES) -> list[NumaNode]:
    """The machine's NUMA nodes that have CPUs, by id; [] where sysfs does not tell."""
    nodes = []
    for d in sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            cpus = parse_cpulist((d / "cpulist").read_text())
        except OSError:
            continue
        if cpus:
            nodes.append(NumaNode(int(d.name[4:]), frozenset(cpus)))
    return nodes


def cuda_device_node(device: int | None = None) -> int | None:
    """NUMA node of a CUDA device's PCI slot (its DMA engine's local memory), or None."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device() if device is None
                                             else device)
    # (PCI fields exist on CUDA builds only; torch's stubs do not name them all)
    bus = getattr(props, "pci_bus_id", None)
    domain, dev = getattr(props, "pci_domain_id", None), getattr(props, "pci_device_id", None)
    if bus is None or domain is None or dev is None:
        return None
    bus_id = f"{domain:04x}:{bus:02x}:{dev:02x}.0"
    try:
        node = int(Path(f"/sys/bus/pci/devices/{bus_id}/numa_node").read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


@contextmanager
def bound_to(node: NumaNode) -> Iterator[bool]:
    """Run the body on `node`'s CPUs (those this process may use).

    Yields False and binds nothing when there are none."""
    before = os.sched_getaffinity(0)
    cpus = before & node.cpus
    if not cpus:
        yield False
        return
    os.sched_setaffinity(0, cpus)
    try:
        yield True
    finally:
        os.sched_setaffinity(0, before)


def alloc_on_node(rows: int, row_bytes: int, node: NumaNode | None, pin: bool) -> torch.Tensor:
    """A `(rows, row_bytes)` uint8 buffer whose pages lie on `node` (first touch).

    Pinned when asked; `node` None: allocated unbound."""
    if node is None:
        return torch.empty((rows, row_bytes), dtype=torch.uint8, pin_memory=pin)
    with bound_to(node):
        buf = torch.empty((rows, row_bytes), dtype=torch.uint8, pin_memory=pin)
        buf.numpy().fill(0)  # first touch from this (bound) thread
    return buf


def placement(mode: str | int | None, nodes: Sequence[NumaNode]) -> list[NumaNode | None]:
    """The nodes a host pool is split over, for `mode`.

    - "auto": one node when there is one that matters (the CUDA device's node), every node
      this process may run on otherwise (interleaved), nothing bound on one-node machines;
    - "interleave": every node this process may run on, slots spread evenly;
    - an int: that node only; None or "off": unbound.
    """
    if mode is None or mode == "off":
        return [None]
    allowed = os.sched_getaffinity(0)
    usable = [n for n in nodes if n.cpus & allowed]
    if isinstance(mode, int):
        for n in nodes:
            if n.id == mode:
                return [n]
        raise ValueError(f"no NUMA node {mode} with CPUs (nodes: {[n.id for n in nodes]})")
    if mode not in ("auto", "interleave"):
        raise ValueError(f"numa must be 'auto', 'interleave', 'off' or a node id, not {mode!r}")
    if len(usable) <= 1:
        return [None] if mode == "auto" or not usable else [usable[0]]
    if mode == "auto":
        dev = cuda_device_node()
        for n in usable:
            if n.id == dev:
                return [n]
    return list(usable)
