"""The benches' processes: free ports, `kvheat serve` and vLLM's server, waiting until one
answers, stopping it, what it costs (CPU seconds, resident memory), and Redis (one server,
or a 3-node Redis Cluster)."""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench._lib import ROOT
from bench._lib.peers import vllm_env


def free_port(pair: bool = False) -> int:
    """A free loopback port; `pair`: one whose Redis Cluster bus port (+10000) is free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if not pair:
            return p
        if p + 10000 < 65536:
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p + 10000))
                return p
            except OSError:
                continue
    raise RuntimeError("no free port")


def wait_until(cond: Callable[[], bool], timeout_s: float, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.1)


# ---- servers ---------------------------------------------------------------------------------
def wait_router_healthy(base: str, replicas: int, timeout_s: float = 60) -> None:
    """Wait until `kvheat route` at `base` has every one of `replicas` in rotation (healthy,
    its events subscribed)."""
    def healthy() -> int:
        try:
            return int(httpx.get(base + "/health", timeout=2).json().get("healthy_replicas", 0))
        except (httpx.HTTPError, ValueError):
            return 0
    wait_until(lambda: healthy() == replicas, timeout_s, "every replica healthy")


def smg_command(smg: str, kind: str, port: int, urls: list[str]) -> list[str]:
    """sglang-router's `smg launch` in front of `urls`: round robin for kind "rr", else its
    cache-aware policy."""
    policy = "round_robin" if kind == "rr" else "cache_aware"
    return [smg, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
            "--policy", policy, "--health-check-interval-secs", "1",
            "--prometheus-port", str(free_port()), "--log-level", "warn"]


def wait_ready(url: str, proc: subprocess.Popen[bytes] | None = None, timeout_s: float = 120,
               log: Path | None = None) -> None:
    """Until `url`/health answers 200; fails at once when `proc` exits (with the end of
    its `log`, when given)."""
    def tail() -> str:
        return ": " + log.read_text(errors="replace")[-2000:] if log is not None else ""

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {proc.returncode}{tail()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not become ready{tail()}")


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM (a server drains), SIGKILL if it has not exited within 20 s."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def start_kvheat_server(model_dir: str | None, port: int, log: Path, threads: int,
                        max_seqs: int, batched_tokens: int, num_blocks: int,
                        extra: list[str] | None = None) -> subprocess.Popen[bytes]:
    """`kvheat serve` with its engine thread on the cores vLLM binds its compute to
    (`peers.vllm_env`), for side-by-side runs against `start_vllm_server`."""
    cores = "0" if threads == 1 else f"0-{threads - 1}"
    cmd = [os.environ.get("KVHEAT_PYTHON", str(ROOT / ".venv/bin/python")), "-m",
           "kvheat.server.cli", "serve", "--port", str(port), "--num-blocks", str(num_blocks),
           "--max-num-seqs", str(max_seqs), "--max-num-batched-tokens", str(batched_tokens),
           "--threads", str(threads), "--engine-cores", cores, "--log-level", "warning",
           *(extra or [])]
    if model_dir:
        cmd += ["--model", model_dir, "--served-model-name", "tiny"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false")
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)


def start_vllm_server(python: str, model_dir: str, port: int, log: Path, tmp: str,
                      threads: int, max_seqs: int, batched_tokens: int,
                      max_model_len: int = 2048) -> subprocess.Popen[bytes]:
    """vLLM's OpenAI server at float32 (it would turn a float32 checkpoint into bfloat16),
    prefix caching on, cached tokens reported in usage, the same batch limits and threads."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--enforce-eager", "--enable-prefix-caching",
           "--enable-prompt-tokens-details", "--max-model-len", str(max_model_len),
           "--max-num-seqs", str(max_seqs), "--max-num-batched-tokens", str(batched_tokens),
           "--seed", "0", "--disable-log-stats"]
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            env=vllm_env(threads, tmp))


def vllm_pool_command(python: str, model_dir: str | Path, model: str, port: int, block: int,
                      pool_blocks: int, max_seqs: int = 8, batched_tokens: int = 2048,
                      kv_transfer: dict[str, Any] | None = None, prompt_details: bool = True,
                      log_stats: bool = True) -> list[str]:
    """vLLM's OpenAI server at float32, prefix caching on, its pool shrunk to `pool_blocks`
    blocks of `block` tokens (the longest prompt one block short of it), with `kv_transfer`
    as its connector; cached tokens in usage unless `prompt_details` is off, its stats
    unless `log_stats` is off (a connector's metrics need them)."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", model, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--enforce-eager", "--enable-prefix-caching"]
    if prompt_details:
        cmd.append("--enable-prompt-tokens-details")
    cmd += ["--block-size", str(block), "--num-gpu-blocks-override", str(pool_blocks),
            "--max-model-len", str((pool_blocks - 1) * block),
            "--max-num-seqs", str(max_seqs), "--max-num-batched-tokens", str(batched_tokens),
            "--seed", "0"]
    if not log_stats:
        cmd.append("--disable-log-stats")
    if kv_transfer is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_transfer)]
    return cmd


# ---- what a process costs ----------------------------------------------------------------------
def _tree(pid: int, depth: int | None) -> list[int]:
    """`pid` and its descendants, `depth` levels down (None: all)."""
    pids, level, i = [pid], {pid: 0}, 0
    while i < len(pids):
        p = pids[i]
        if depth is None or level[p] < depth:
            with contextlib.suppress(OSError, ValueError):
                for task in Path(f"/proc/{p}/task").iterdir():
                    for k in (task / "children").read_text().split():
                        level[int(k)] = level[p] + 1
                        pids.append(int(k))
        i += 1
    return list(dict.fromkeys(pids))


def cpu_seconds(pid: int | None, tree: bool = False) -> float:
    """User + system CPU seconds a process has used so far, all its threads (Linux /proc;
    0 where it cannot be read); `tree`: its descendants' too (vLLM's engine core is a
    grandchild: what an idle peer spends while the other side runs)."""
    if pid is None:
        return 0.0
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in _tree(pid, None if tree else 0):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def rss_mib(pid: int, children: bool = False) -> float | None:
    """Resident memory of a process (`children`: plus its direct children: vLLM runs its
    engine in one); None when it cannot be read."""
    total = 0.0
    pids = [pid]
    if children:
        with contextlib.suppress(OSError):
            pids += [int(k) for k in
                     Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
        except OSError:
            continue
    return total or None


# ---- Redis -----------------------------------------------------------------------------------
def redis_binary(name: str = "redis-server") -> str:
    path = shutil.which(name)
    if path is None:
        raise SystemExit(f"{name} is needed (apt-get install redis-server)")
    return path


class Redis:
    """One redis-server on loopback, no persistence; `kill` and `start` again give an
    empty one on the same port."""

    def __init__(self, workdir: Path, port: int | None = None, *extra: str) -> None:
        self.workdir, self.port, self.extra = workdir, port or free_port(), extra
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> Redis:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), \
                    socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return self
            time.sleep(0.02)
        self.kill()
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


class RedisCluster:
    """Three `Redis` nodes joined into a Redis Cluster (no replicas)."""

    def __init__(self, workdir: Path) -> None:
        self.nodes = [Redis(workdir / f"redis{i}", free_port(pair=True), "--cluster-enabled",
                            "yes", "--cluster-config-file", "nodes.conf") for i in range(3)]
        self.ports = [n.port for n in self.nodes]

    def start(self) -> RedisCluster:
        cli = redis_binary("redis-cli")
        for n in self.nodes:
            n.start()
        subprocess.run([cli, "--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
                        "--cluster-replicas", "0", "--cluster-yes"], check=True,
                       capture_output=True, timeout=60)
        wait_until(lambda: "cluster_state:ok" in subprocess.run(
            [cli, "-p", str(self.ports[0]), "cluster", "info"], capture_output=True,
            text=True).stdout, 30, "cluster_state:ok")
        return self

    def flush(self) -> None:
        cli = redis_binary("redis-cli")
        for p in self.ports:
            subprocess.run([cli, "-p", str(p), "flushall"], capture_output=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def stop(self) -> None:
        for n in self.nodes:
            n.kill()


# ---- a faulty link: a TCP proxy (in front of a real Redis, in the operations benches) --
class FaultProxy:
    """Forwards loopback TCP to `target`; `mode`: "pass", "slow" (each answer chunk held
    `delay_s`) or "blackhole" (everything read and dropped, nothing answered)."""

    def __init__(self, target_port: int, delay_s: float) -> None:
        self.target = ("127.0.0.1", target_port)
        self.delay_s = delay_s
        self.mode = "pass"
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._pipe, args=(client,), daemon=True).start()

    def _pipe(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target)
        except OSError:
            client.close()
            return
        ends = {client: upstream, upstream: client}
        try:
            while not self._stop:
                ready, _, _ = select.select(list(ends), [], [], 0.2)
                for s in ready:
                    data = s.recv(1 << 16)
                    if not data:
                        return
                    if self.mode == "blackhole":
                        continue  # lost
                    if self.mode == "slow" and s is upstream:
                        time.sleep(self.delay_s)
                    ends[s].sendall(data)
        except OSError:
            pass
        finally:
            client.close()
            upstream.close()

    def close(self) -> None:
        self._stop = True
        self.sock.close()
