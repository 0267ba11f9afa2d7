"""Load and faults against `kvheat serve` on loopback, bounded in count and time.

Starts a redis-server and `kvheat serve` (three tenants, admin API, a 48-block device
pool per arm, a disk tier and a Redis tier under it) and runs a fixed number of requests
from several tenants, greedy with token-id prompts that share prefixes, some streamed and
some of the streams cancelled, while a fault task:

- kills Redis (SIGKILL) and restarts it empty, twice;
- fills the disk tier's file system (a small tmpfs when it can mount one, else a filler
  file next to a capped store) and frees it again;
- corrupts disk-tier files: flips a byte, truncates one, overwrites a magic;
- sends oversized bodies (20 MB with a key, 30 MB without) and a prompt too long in bytes;
- sends requests that can never be scheduled: larger than the pool, and larger than
  what pinned prefixes leave (it pins one through the admin API, then unpins it).

A poller times `/health` every 100 ms. At the end it checks the pool through the admin
API, and replays every answered prompt on a reference engine with no tiers (the same
weights, greedy) to count wrong outputs. It prints one table:

    python bench/server/chaos.py               # 240 requests, at most 240 s
    python bench/server/chaos.py --requests 80

Hung requests (no answer within the client timeout), wrong outputs and leaked blocks must
all be 0. Writes a JSON report (`--json`, default results/server/chaos.json).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

if not __package__:  # run as `python bench/server/chaos.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench._lib import RESULTS, ROOT
from bench._lib.load import stream_turn
from bench._lib.procs import Redis, free_port, rss_mib, wait_ready

MODEL = "kvheat-tiny-llama"
ADMIN = "chaos-admin"
TENANTS = {"sk-red": "red", "sk-green": "green", "sk-blue": "blue"}
NUM_BLOCKS = 48
MAX_TOKENS = 8


class DiskSpace:
    """The disk tier's folder: on a small tmpfs when one can be mounted (filling it gives
    the store real ENOSPC errors), else a plain folder (the filler then only takes the
    machine's space, and the store's cap does the refusing)."""

    def __init__(self, root: Path, size_mib: int) -> None:
        self.dir = root / "disk"
        self.dir.mkdir()
        self.mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(self.dir)],
            capture_output=True).returncode == 0
        self.filler = self.dir / "filler.bin"

    def fill(self) -> int:
        if not self.mounted:
            return 0
        n = 0
        with contextlib.suppress(OSError), open(self.filler, "wb") as f:
            chunk = b"\0" * (1 << 20)
            while True:
                f.write(chunk)
                f.flush()
                n += len(chunk)
        return n

    def free(self) -> None:
        with contextlib.suppress(OSError):
            self.filler.unlink()

    def close(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.dir)], capture_output=True)


@dataclass
class Stats:
    sent: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    hung: int = 0
    cancelled_streams: int = 0
    health_max_s: float = 0.0
    health: list[float] = field(default_factory=list)
    refusing: bool = False  # oversized bodies are being sent: /health times kept apart
    health_refusing: list[float] = field(default_factory=list)
    health_failures: int = 0
    faults: list[str] = field(default_factory=list)
    answers: list[tuple[list[int], str, str]] = field(default_factory=list)  # prompt, text, key
    slow_refusals: dict[str, float] = field(default_factory=dict)


def make_prompts(seed: int, n: int) -> list[tuple[str, list[int]]]:
    """(tenant key, token ids): per tenant a few shared prefixes (cached, then pushed to
    the tiers by the others), each with many suffixes."""
    rng = random.Random(seed)
    keys = list(TENANTS)
    prefixes = {k: [[rng.randrange(3, 1000) for _ in range(rng.choice((64, 96, 128)))]
                    for _ in range(3)] for k in keys}
    out = []
    for _ in range(n):
        k = rng.choice(keys)
        p = rng.choice(prefixes[k]) + [rng.randrange(3, 1000) for _ in range(rng.randint(8, 90))]
        out.append((k, p))
    return out


async def one_request(http: httpx.AsyncClient, st: Stats, key: str, prompt: list[int],
                      stream: bool, cancel: bool, timeout_s: float) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    headers = {"Authorization": f"Bearer {key}"}
    st.sent += 1
    if stream:
        r = await stream_turn(http, "/v1/completions", body, headers, timeout_s,
                              cancel_after=2 if cancel else None)
        if r.status_code is not None:
            st.statuses[str(r.status_code)] += 1
        if r.cancelled:
            st.cancelled_streams += 1
        elif r.hung:
            st.hung += 1
        elif r.transport_error:
            st.statuses[f"transport:{r.transport_error}"] += 1
        elif r.stream_error:
            st.statuses["stream_error"] += 1
        elif r.done:
            st.answers.append((prompt, r.text, key))
        return
    try:
        async with asyncio.timeout(timeout_s):
            r = await http.post("/v1/completions", json=body, headers=headers)
            st.statuses[str(r.status_code)] += 1
            if r.status_code == 200:
                st.answers.append((prompt, r.json()["choices"][0]["text"], key))
    except TimeoutError:
        st.hung += 1
    except httpx.HTTPError as e:
        st.statuses[f"transport:{type(e).__name__}"] += 1


def health_poller(base: str, st: Stats, stop: threading.Event) -> None:
    """Its own thread and client: the timings are the server's, not this script's loop."""
    with httpx.Client(base_url=base, timeout=30) as http:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                r = http.get("/health")
                if r.status_code != 200:
                    st.health_failures += 1
            except httpx.HTTPError:
                st.health_failures += 1
            dt = time.perf_counter() - t0
            st.health.append(dt)
            if st.refusing:
                st.health_refusing.append(dt)
            st.health_max_s = max(st.health_max_s, dt)
            stop.wait(0.1 if not st.refusing else 0.02)


async def refusal(http: httpx.AsyncClient, st: Stats, name: str, expect: int,
                  **kw: Any) -> None:
    st.sent += 1
    t0 = time.perf_counter()
    try:
        r = await http.post("/v1/completions", **kw)
        st.statuses[str(r.status_code)] += 1
        if r.status_code != expect:
            st.faults.append(f"{name}: expected {expect}, got {r.status_code}")
    except httpx.HTTPError as e:
        st.statuses[f"transport:{type(e).__name__}"] += 1
    st.slow_refusals[name] = time.perf_counter() - t0


async def faults(base: str, st: Stats, redis: Redis, disk: DiskSpace, arms: list[str],
                 done: asyncio.Event, total: int) -> None:
    """The faults, each when a given share of the requests has been sent (so they fall
    inside the traffic however fast the machine is)."""
    rng = random.Random(7)
    key = {"Authorization": "Bearer sk-red"}
    adm = {"Authorization": f"Bearer {ADMIN}"}
    marks = iter([0.08, 0.18, 0.28, 0.55, 0.65, 0.75])
    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        async def pause() -> bool:
            at = next(marks) * total
            while st.sent < at and not done.is_set():
                await asyncio.sleep(0.05)
            return False  # once traffic is over the rest of the faults still run

        for rnd in range(2):
            if await pause():
                return
            redis.kill()
            st.faults.append(f"redis killed ({rnd})")
            if await pause():
                redis.start()
                return
            await asyncio.to_thread(redis.start)
            st.faults.append(f"redis restarted empty ({rnd})")
            n = await asyncio.to_thread(disk.fill)
            st.faults.append(f"disk filled (+{n >> 20} MiB)")
            if await pause():
                disk.free()
                return
            disk.free()
            st.faults.append("disk freed")
            files = [p for a in arms for p in (disk.dir / a).glob("*.kv")]
            for p, how in zip(rng.sample(files, min(3, len(files))),
                              ("flip", "truncate", "magic"), strict=False):
                with contextlib.suppress(OSError), open(p, "r+b") as f:
                    size = f.seek(0, 2)
                    if how == "flip":
                        f.seek(size // 2)
                        b = f.read(1)
                        f.seek(size // 2)
                        f.write(bytes([b[0] ^ 0xFF]) if b else b"\0")
                    elif how == "truncate":
                        f.truncate(size // 2)
                    else:
                        f.seek(0)
                        f.write(b"XXXX")
                st.faults.append(f"disk file corrupted ({how})")
            big = b'{"model": "' + MODEL.encode() + b'", "prompt": "' + b"a" * 20_000_000 + b'"}'
            st.refusing = True
            await asyncio.sleep(0.05)
            await refusal(http, st, "20 MB body", 413, content=big,
                          headers={**key, "Content-Type": "application/json"})
            await refusal(http, st, "30 MB body, no key", 401, content=big + b" " * 10_000_000,
                          headers={"Content-Type": "application/json"})
            await refusal(http, st, "prompt too long in bytes", 400, headers=key,
                          json={"model": MODEL, "prompt": "word " * 40_000, "max_tokens": 1})
            await asyncio.sleep(0.05)
            st.refusing = False
            await refusal(http, st, "larger than the pool", 400, headers=key,
                          json={"model": MODEL, "prompt": [7] * (NUM_BLOCKS * 16 - 8),
                                "max_tokens": 64})
            # Pin a long prefix, then ask for more than the rest of the pool (what was
            # pinned: only what stayed cached between its prefill and the pin).
            pin = [rng.randrange(3, 1000) for _ in range(30 * 16)]
            st.sent += 1
            r = await http.post("/admin/pin", headers=adm,
                                json={"tenant": "red", "token_ids": pin})
            st.statuses[str(r.status_code)] += 1
            pinned = min(r.json()["pinned_tokens"].values()) // 16 if r.status_code == 200 else 0
            if pinned >= 4:
                n = (NUM_BLOCKS - pinned + 1) * 16 - 64
                await refusal(http, st, "larger than pins leave", 400, headers=key,
                              json={"model": MODEL, "prompt": [11] * n, "max_tokens": 64})
            st.sent += 1
            r = await http.post("/admin/unpin", headers=adm,
                                json={"tenant": "red", "token_ids": pin})
            st.statuses[str(r.status_code)] += 1
            st.faults.append("oversized and never-schedulable requests sent")


async def traffic(base: str, st: Stats, prompts: list[tuple[str, list[int]]], clients: int,
                  deadline: float, timeout_s: float) -> None:
    queue: asyncio.Queue[tuple[int, str, list[int]]] = asyncio.Queue()
    for i, (k, p) in enumerate(prompts):
        queue.put_nowait((i, k, p))
    rng = random.Random(3)
    limits = httpx.Limits(max_keepalive_connections=clients, keepalive_expiry=2.0)

    async def client() -> None:
        async with httpx.AsyncClient(base_url=base, timeout=timeout_s + 5,
                                     limits=limits) as http:
            while time.monotonic() < deadline:
                try:
                    i, k, p = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                mode = rng.random()
                await one_request(http, st, k, p, stream=mode < 0.5, cancel=mode < 0.15,
                                  timeout_s=timeout_s)

    await asyncio.gather(*(client() for _ in range(clients)))


def _p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else 0.0


def reference_texts(answers: list[tuple[list[int], str, str]]) -> list[str]:
    """Greedy outputs of the same weights on an engine with no tiers and a large pool,
    turned into text as the server does."""
    import torch

    from kvheat.engine import EngineConfig, LLMEngine, SamplingParams
    from kvheat.server.detokenizer import TextAssembler

    torch.set_num_threads(1)
    eng = LLMEngine.from_pretrained(None, "llama", seed=0,
                                    config=EngineConfig(num_blocks=4096))
    sp = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    out = []
    for prompt, _, key in answers:
        (o,) = eng.generate([prompt], sp, tenant=TENANTS[key])
        ta = TextAssembler(eng.tokenizer, [])
        out.append("".join(ta.add(t) for t in o.output_token_ids) + ta.flush())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=240)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-seconds", type=float, default=240.0)
    ap.add_argument("--timeout", type=float, default=60.0, help="client timeout: hung past it")
    ap.add_argument("--json", default=str(RESULTS / "server" / "chaos.json"))
    args = ap.parse_args()
    if shutil.which("redis-server") is None:
        sys.exit("redis-server is not installed")
    work = Path(tempfile.mkdtemp(prefix="kvheat-chaos-"))
    redis = Redis(work)
    redis.start()
    disk = DiskSpace(work, 48)  # two arms' 16 MiB stores, then the filler takes the rest
    cfg = work / "chaos.toml"
    tenants = "".join(f'[[tenants]]\nname = "{n}"\napi_keys = ["{k}"]\n\n'
                      for k, n in TENANTS.items())
    cfg.write_text(f'admin_token = "{ADMIN}"\nnum_blocks = {NUM_BLOCKS}\n'
                   f'disk_tier_dir = "{disk.dir}"\ndisk_tier_bytes = "16MiB"\n'
                   f'redis_tier_url = "{redis.url}"\nredis_tier_bytes = "64MiB"\n'
                   f'max_num_seqs = 8\ndrain_timeout_s = 5.0\n\n{tenants}'
                   '[[arms]]\nname = "lru"\nshare = 50\npolicy = "lru"\n\n'
                   '[[arms]]\nname = "kvheat"\nshare = 50\npolicy = "kvheat"\n')
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "TOKENIZERS_PARALLELISM": "false"}
    log = (work / "server.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "kvheat.server.cli", "serve", "--config",
                             str(cfg), "--port", str(port), "--threads", "1",
                             "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT,
                            env=env)
    st = Stats()
    try:
        try:
            wait_ready(base, proc, 90)
        except RuntimeError as e:
            sys.exit(f"kvheat serve did not come up ({e}); see {work / 'server.log'}")
        rss0 = rss_mib(proc.pid)
        t0 = time.monotonic()

        async def run() -> None:
            stop = asyncio.Event()
            stop_poll = threading.Event()
            poll = threading.Thread(target=health_poller, args=(base, st, stop_poll))
            poll.start()
            fault = asyncio.create_task(faults(base, st, redis, disk, ["lru", "kvheat"], stop,
                                               args.requests))
            await traffic(base, st, make_prompts(1, args.requests), args.clients,
                          t0 + args.max_seconds, args.timeout)
            stop.set()
            await fault
            stop_poll.set()
            poll.join()

        asyncio.run(run())
        elapsed = time.monotonic() - t0
        time.sleep(1.0)  # aborts of cancelled streams land
        stats = httpx.get(base + "/admin/stats", headers={"Authorization": f"Bearer {ADMIN}"},
                          timeout=30).json()
        leaked = sum(a["blocks"]["referenced"] for a in stats["arms"].values())
        active = stats["active_requests"]
        rss1 = rss_mib(proc.pid)
        metrics = httpx.get(base + "/metrics", timeout=30).text
        # SIGTERM with nothing in flight: the drain ends at once.
        t_term = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        shutdown_s = time.monotonic() - t_term
    finally:
        if proc.poll() is None:
            proc.kill()
        redis.kill()
        disk.close()
        log.close()
    refs = reference_texts(st.answers)
    wrong = [(p[:8], got, want) for (p, got, _), want in zip(st.answers, refs, strict=True)
             if got != want]
    fault_lines = [ln for ln in metrics.splitlines() if ln.startswith(
        ("kvheat_tier_faults_total", "kvheat_tier_load_faults_total",
         "kvheat_internal_errors_total", "kvheat_engine_failures_total"))
        and not ln.endswith(" 0.0")]
    statuses = ", ".join(f"{k}: {v}" for k, v in sorted(st.statuses.items()))
    rows = [
        ("requests sent", str(st.sent)),
        ("answered, by status", statuses),
        ("streams cancelled by the client", str(st.cancelled_streams)),
        (f"hung (no answer in {args.timeout:.0f} s)", str(st.hung)),
        (f"wrong outputs (vs a no-tier reference, of {len(st.answers)} checked)",
         str(len(wrong))),
        ("leaked blocks (referenced at the end)", str(leaked)),
        ("requests still active at the end", str(active)),
        ("longest /health answer (P99)", f"{st.health_max_s * 1000:.0f} ms "
         f"({_p99(st.health) * 1000:.0f} ms, {len(st.health)} probes)"),
        ("longest /health answer while 20-30 MB bodies were refused",
         f"{max(st.health_refusing, default=0) * 1000:.0f} ms "
         f"({len(st.health_refusing)} probes)"),
        ("/health failures", str(st.health_failures)),
        ("slowest refusal", "{}: {:.0f} ms".format(*max(
            ((k, v * 1000) for k, v in st.slow_refusals.items()), key=lambda kv: kv[1],
            default=("-", 0.0)))),
        ("RSS at start / end", f"{rss0:.0f} / {rss1:.0f} MiB" if rss0 and rss1 else "-"),
        ("SIGTERM to exit", f"{shutdown_s:.1f} s"),
        ("run time", f"{elapsed:.0f} s"),
        ("faults injected", str(len(st.faults))),
    ]
    w = max(len(r[0]) for r in rows)
    print(f"| {'check':<{w}} | result |\n|{'-' * (w + 2)}|---|")
    for k, v in rows:
        print(f"| {k:<{w}} | {v} |")
    print("\nfaults:", "; ".join(st.faults))
    print("fault counters in /metrics:\n  " + "\n  ".join(fault_lines))
    if wrong:
        print("wrong outputs (first 5):", wrong[:5])
    report = {"rows": dict(rows), "faults": st.faults, "fault_metrics": fault_lines,
              "wrong": wrong[:20], "statuses": dict(st.statuses)}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))
    shutil.rmtree(work, ignore_errors=True)
    bad = st.hung or wrong or leaked or active or any(k.startswith("5") for k in st.statuses)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
