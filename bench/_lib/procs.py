"""bench/cluster.py's processes: the model, a 3-node Redis Cluster, kvheat replicas and the
routers (kvheat route, or sglang-router's smg), started and stopped."""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
MODEL = "cluster-llama"
SECRET = "kvheat-bench-cluster-tier-secret"
TENANTS = {"acme": "sk-acme", "globex": "sk-globex", "initech": "sk-initech"}


def free_port(pair: bool = False) -> int:
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


# ---- the model -------------------------------------------------------------------------------
def make_model(path: Path, hidden: int, layers: int) -> None:
    """A Llama wider than the built-in tiny one (so a prefill costs what a cache saves),
    seeded random weights, the tiny tokenizer; saved as a Hugging Face directory."""
    from kvheat.engine import ModelConfig
    from kvheat.engine.loader import Tokenizer, build_model, init_random_weights, save_model

    cfg = ModelConfig(model_type="llama", vocab_size=1024, hidden_size=hidden,
                      intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
                      head_dim=64, max_position_embeddings=4096, rope_theta=10000.0,
                      bos_token_id=0, eos_token_id=1)
    model = build_model(cfg)
    init_random_weights(model, 0)
    save_model(model, Tokenizer.tiny(1024), path)


# ---- processes -------------------------------------------------------------------------------
class RedisCluster:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.ports = [free_port(pair=True) for _ in range(3)]
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        binary, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if binary is None or cli is None:
            raise SystemExit("redis-server and redis-cli are needed (apt-get install redis-server)")
        for i, p in enumerate(self.ports):
            d = self.workdir / f"redis{i}"
            d.mkdir(parents=True, exist_ok=True)
            self.procs.append(subprocess.Popen(
                [binary, "--port", str(p), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                 "no", "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                 "--dir", str(d)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for p in self.ports:
            _wait(lambda p=p: subprocess.run([cli, "-p", str(p), "ping"], capture_output=True,
                                             text=True).stdout.strip() == "PONG", 10)
        subprocess.run([cli, "--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
                        "--cluster-replicas", "0", "--cluster-yes"], check=True,
                       capture_output=True, timeout=60)
        _wait(lambda: "cluster_state:ok" in subprocess.run(
            [cli, "-p", str(self.ports[0]), "cluster", "info"], capture_output=True,
            text=True).stdout, 30)

    def flush(self) -> None:
        cli = shutil.which("redis-cli")
        for p in self.ports:
            subprocess.run([cli, "-p", str(p), "flushall"], capture_output=True)  # type: ignore[list-item]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait(timeout=10)


def _wait(cond: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError("timed out waiting")
        time.sleep(0.1)


REPLICA_ADMIN = "cluster-bench-admin"  # the replicas' admin API (loopback only)


@dataclass
class Replica:
    port: int
    events: int
    replay: int
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def start_replica(r: Replica, args: argparse.Namespace, model_dir: Path, config: Path,
                  redis_url: str, log: Path) -> None:
    cmd = [sys.executable, "-m", "kvheat.server.cli", "serve", "--port", str(r.port),
           "--model", str(model_dir), "--served-model-name", MODEL, "--config", str(config),
           "--num-blocks", str(args.num_blocks), "--threads", "1", "--max-num-seqs", "8",
           "--redis-tier-url", redis_url, "--redis-cluster", "--redis-tier-size", "512MiB",
           "--kv-events-endpoint", f"tcp://127.0.0.1:{r.events}",
           "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{r.replay}",
           "--log-level", "warning"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), KVHEAT_TIER_SECRET=SECRET,
               KVHEAT_EVENTS_SECRET=SECRET, KVHEAT_ADMIN_TOKEN=REPLICA_ADMIN, TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1")
    r.proc = subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env)


def wait_http(url: str, proc: subprocess.Popen[bytes] | None, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not become ready")


def cpu_seconds(proc: subprocess.Popen[bytes] | None) -> float:
    """User + system CPU seconds a live process has used so far, all its threads (Linux
    /proc; 0 where it cannot be read)."""
    if proc is None:
        return 0.0
    try:
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def start_router(kind: str, port: int, replicas: list[Replica], args: argparse.Namespace,
                 model_dir: Path, config: Path, log: Path) -> subprocess.Popen[bytes]:
    urls = [r.url for r in replicas]
    if kind.startswith("kvheat"):
        cmd = [sys.executable, "-m", "kvheat.cli", "route", "--port", str(port), "--model",
               str(model_dir), "--config", str(config), "--health-interval", "0.5",
               "--log-level", "warning"]
        for u in urls:
            cmd += ["--replica", u]
        cmd += args.route_arg
        if kind == "kvheat-1":  # new prefixes by the hash alone (one choice)
            cmd += ["--shard-choices", "1"]
        # the replicas' admin token: kvheat route reports the cluster's entropy to them
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
                   KVHEAT_REPLICA_ADMIN_TOKEN=REPLICA_ADMIN, KVHEAT_EVENTS_SECRET=SECRET)
    else:
        policy = "round_robin" if kind == "rr" else "cache_aware"
        cmd = [args.smg, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
               *urls, "--policy", policy, "--health-check-interval-secs", "1",
               "--prometheus-port", str(free_port()), "--log-level", "warn"]
        env = dict(os.environ)
    return subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env)
