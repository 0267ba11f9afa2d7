"""Shared fixtures. `redis_server`: a real redis-server on a free loopback port, started
for one test and killed at teardown; `redis_cluster`: three such nodes joined into a Redis
Cluster. Both skip when the binary is missing, and fail under CI (which installs it)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest

# The shared Mooncake and agentic traces beside the checkout, when present (where the
# benches read them too: `bench._lib.TRACES`).
TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"

# Deployments that share a Redis or a disk folder configure one tier secret (it keys the
# MAC of every value read back); the tests run as one such deployment.
os.environ.setdefault("KVHEAT_TIER_SECRET", "kvheat-tests-tier-secret")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server subprocess; `stop()` kills it, `start()` brings it back on the
    same port (empty: no persistence)."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.extra: list[str] = []
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--daemonize", "no", "--dir", str(self.workdir),
             *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not answer PING")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


def unavailable(what: str) -> NoReturn:
    """Something a test needs is missing here: skip, except under CI, whose .ci/run must
    provide it (a skipped test there would hide a missing install step)."""
    if os.environ.get("CI"):
        pytest.fail(f"{what} (CI must provide it)")
    pytest.skip(what)


def require_binary(name: str, package: str | None = None) -> str:
    """The path of `name`, else `unavailable` (naming the package that provides it)."""
    binary = shutil.which(name)
    if binary is None:
        unavailable(f"{name} is not installed" + (f" (package {package})" if package else ""))
    return binary


def _redis_binary() -> str:
    return require_binary("redis-server")


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    srv = RedisServer(_redis_binary(), tmp_path)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def _cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too."""
    for _ in range(200):
        p = free_port()
        if p + 10000 > 65535:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 10000))
        except OSError:
            continue
        return p
    raise RuntimeError("no free port pair for a cluster node")


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[list[RedisServer]]:
    """Three redis-server nodes on loopback joined into a Redis Cluster (no replicas)."""
    binary = _redis_binary()
    cli = shutil.which("redis-cli")
    if cli is None:
        if os.environ.get("CI"):
            pytest.fail("redis-cli is not installed (CI must install it)")
        pytest.skip("redis-cli is not installed")
    nodes: list[RedisServer] = []
    try:
        for i in range(3):
            d = tmp_path / f"node{i}"
            d.mkdir()
            srv = RedisServer(binary, d)
            srv.port = _cluster_port()
            srv.extra = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
            srv.start()
            nodes.append(srv)
        subprocess.run([cli, "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in nodes],
                        "--cluster-replicas", "0", "--cluster-yes"], check=True,
                       capture_output=True, timeout=60)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            info = subprocess.run([cli, "-p", str(nodes[0].port), "cluster", "info"],
                                  capture_output=True, text=True, timeout=10).stdout
            if "cluster_state:ok" in info:
                break
            time.sleep(0.05)
        else:
            raise RuntimeError("the cluster did not reach cluster_state:ok")
        yield nodes
    finally:
        for n in nodes:
            n.stop()


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Engine tests run on one torch thread (steadier on a shared 2-core machine)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def llama() -> tuple:
    """The built-in tiny Llama (seeded weights), once per test module."""
    from kvheat.engine.loader import load_model

    return load_model(None, "llama")


def wait_for(cond, timeout_s: float = 5.0, poll_s: float = 0.01) -> bool:
    """Poll `cond` until it holds or `timeout_s` passes; its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(poll_s)
    return cond()


@contextlib.contextmanager
def vllm_events_index(kv) -> Iterator[tuple]:
    """vLLM's own `ZmqEventPublisher` (module `kv`: vllm.distributed.kv_events) feeding a
    router `PrefixIndex` through a subscriber of replica "v" (vLLM's foreign hashes), synced
    and joined: yields (publisher, index)."""
    from kvheat.kvevents import KVEventSubscriber
    from kvheat.router.index import PrefixIndex

    port, rport = free_port(), free_port()
    pub = kv.ZmqEventPublisher(0, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{rport}")
    ix = PrefixIndex()
    ix.add_replica("v", foreign_hashes=True)
    sub = KVEventSubscriber("v", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}",
                            ix.apply, ix.clear_replica)
    try:
        assert sub.wait_synced(10)
        time.sleep(0.5)  # the SUB socket joins before the first batch
        yield pub, ix
    finally:
        sub.close()
        pub.shutdown()


@pytest.fixture(params=["avx2", "portable", "torch"])
def copy_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each way the host tier copies and checks a block: the C kernel `_copyhash` with AVX2
    and without it, or torch and xxhash (a build without the extension)."""
    yield from _on_copy_path(str(request.param))


@pytest.fixture(params=["avx2", "portable"])
def copy_kernel(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each of `_copyhash`'s kernels."""
    yield from _on_copy_path(str(request.param))


def _on_copy_path(name: str) -> Iterator[str]:
    from kvheat.tiers import host

    if name != "torch" and host._BUILT is None:
        unavailable("kvheat.tiers._copyhash is not built (setup.py needs a C compiler)")
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(host.copy_path(name))
        except ValueError:  # no AVX2 here
            pytest.skip(f"no {name} kernel on this CPU")
        yield name


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A test that skips for want of vLLM must carry the `vllm` mark: `make test-vllm` (CI's
    second pass, with vLLM installed) runs only marked tests, so an unmarked one would run
    nowhere."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if (report.skipped and "vllm" in str(report.longrepr).lower()
            and item.get_closest_marker("vllm") is None):
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} skips for want of vLLM but has no "
                           "@pytest.mark.vllm: the vLLM pass would never run it")
