"""How often `kvheat doctor` names the cause that was injected into a live server.

Each run starts a real `kvheat serve` in this process (uvicorn on loopback, the built-in
tiny model on the CPU), warms it up with ordinary traffic, scrapes /metrics, drives the
scenario's traffic (a fixed number of requests: the "window"), scrapes again and runs the
doctor's `diagnose` on the two scrapes (with /admin/stats at both ends). Scenarios:

- healthy       ample pool, a few concurrent clients sharing a system prompt
- overload      max_num_seqs=1, max_queued_requests=2, 16 concurrent clients (503s)
- capacity      a 24-block pool and 8 distinct 64-token prefixes asked for in a cycle
                (LRU evicts each before its reuse: capacity misses)
- long_prompts  short prompts before the window, prompts 6x longer in it
- tenant_quota  a 40-block pool; tenant "acme" (24-block quota) runs 12 long generations
                on 8 clients and is preempted, tenant "globex" sends a few short ones
- tier_fault    a Redis tier at a closed port (down), a 48-block pool and distinct
                prompts (each eviction tries the dead tier)

Top-1 accuracy counts a run right when the first finding is the injected cause, and a
healthy run right when there is no finding. Prints a confusion-matrix table and writes
JSON (`--json`, default results/operations/doctor.json).

    python bench/operations/doctor.py      # 3 runs per scenario
    python bench/operations/doctor.py --runs 5 --json docs/results/operations/doctor.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch
from rich.table import Table

if not __package__:  # run as `python bench/operations/doctor.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench._lib import RESULTS
from bench._lib.procs import free_port
from kvheat.doctor import Snapshot, admin_stats, diagnose, scrape
from kvheat.replay.report import print_uncut
from kvheat.server.app import KVHeatServer
from kvheat.server.config import ServerConfig, TenantConfig
from kvheat.tiers import TierSpec

MODEL = "kvheat-tiny-llama"
ADMIN = "adm"
torch.set_num_threads(1)


class Live:
    def __init__(self, cfg: ServerConfig) -> None:
        self.server = KVHeatServer(cfg)
        port = free_port()
        self.uv = self.server.uvicorn("127.0.0.1", port, "error")
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.uv.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        self.base = f"http://127.0.0.1:{port}"
        self.http = httpx.Client(timeout=120)

    def complete(self, prompt: list[int], max_tokens: int, key: str = "none") -> int:
        r = self.http.post(self.base + "/v1/completions",
                           headers={"Authorization": f"Bearer {key}"},
                           json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                 "temperature": 0})
        return r.status_code

    def idle(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while self.server.worker.num_active and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.6)  # the engine thread refreshes the gauges a few times a second

    def close(self) -> None:
        self.http.close()
        self.uv.should_exit = True
        self.thread.join(timeout=30)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(20, 600) for _ in range(n)]


def _job(live: Live, prompt: list[int], max_tokens: int, key: str = "none") -> Callable[[], int]:
    return lambda: live.complete(prompt, max_tokens, key)


def _parallel(n_workers: int, jobs: list[Callable[[], int]]) -> list[int]:
    with ThreadPoolExecutor(n_workers) as pool:
        return list(pool.map(lambda f: f(), jobs))


# ---- scenarios: (config, warm-up, window traffic) --------------------------------------
Scenario = tuple[ServerConfig, Callable[[Live, random.Random], object],
                 Callable[[Live, random.Random], object]]


def _base(**kw: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"num_blocks": 256, "threads": 1, "max_num_seqs": 8,
                           "max_tokens_limit": 64, "admin_token": ADMIN}
    out.update(kw)
    return out


def _chat_like(live: Live, rng: random.Random, n: int, system: list[int], clients: int = 3,
               tokens: int = 8, key: str = "none") -> None:
    jobs = [_job(live, system + _ids(rng, rng.randrange(8, 24)), tokens, key) for _ in range(n)]
    _parallel(clients, jobs)


def healthy(rng: random.Random) -> Scenario:
    system = _ids(rng, 48)
    return (ServerConfig(**_base()),
            lambda live, r: _chat_like(live, r, 8, system),
            lambda live, r: _chat_like(live, r, 24, system))


def overload(rng: random.Random) -> Scenario:
    system = _ids(rng, 48)

    def window(live: Live, r: random.Random) -> None:
        jobs = [_job(live, system + _ids(r, 16), 24) for _ in range(64)]
        _parallel(16, jobs)

    return (ServerConfig(**_base(max_num_seqs=1, max_queued_requests=2)),
            lambda live, r: _chat_like(live, r, 4, system, clients=1), window)


def capacity(rng: random.Random) -> Scenario:
    prefixes = [_ids(rng, 64) for _ in range(8)]  # 8 x 4 blocks: more than the pool holds

    def cycle(live: Live, r: random.Random, rounds: int) -> None:
        for _ in range(rounds):
            for p in prefixes:
                live.complete(p + _ids(r, 4), 2)

    return (ServerConfig(**_base(num_blocks=24)),
            lambda live, r: cycle(live, r, 1), lambda live, r: cycle(live, r, 3))


def long_prompts(rng: random.Random) -> Scenario:
    system = _ids(rng, 32)
    return (ServerConfig(**_base(max_num_batched_tokens=512)),
            lambda live, r: _chat_like(live, r, 12, system),
            lambda live, r: _parallel(3, [_job(live, _ids(r, 240), 8) for _ in range(16)]))


def tenant_quota(rng: random.Random) -> Scenario:
    system = _ids(rng, 32)
    cfg = ServerConfig(**_base(num_blocks=40,
                               tenants=[TenantConfig("acme", ["sk-acme"], quota_blocks=24),
                                        TenantConfig("globex", ["sk-globex"])]))

    def window(live: Live, r: random.Random) -> None:
        jobs = [_job(live, _ids(r, 24), 64, "sk-acme") for _ in range(12)]
        jobs += [_job(live, system + _ids(r, 8), 8, "sk-globex") for _ in range(6)]
        _parallel(8, jobs)

    return (cfg, lambda live, r: _chat_like(live, r, 4, system, key="sk-globex"), window)


def tier_fault(rng: random.Random) -> Scenario:
    system = _ids(rng, 48)
    cfg = ServerConfig(**_base(num_blocks=48,
                               tiers=TierSpec(redis_url=f"redis://127.0.0.1:{free_port()}",
                                              redis_bytes=64 << 20)))
    # Distinct prompts: the 48-block pool evicts, and every eviction tries the dead tier.
    return (cfg, lambda live, r: _chat_like(live, r, 4, system),
            lambda live, r: _parallel(3, [_job(live, _ids(r, 48), 4) for _ in range(24)]))


SCENARIOS: dict[str, Callable[[random.Random], Scenario]] = {
    "healthy": healthy, "overload": overload, "capacity": capacity,
    "long_prompts": long_prompts, "tenant_quota": tenant_quota, "tier_fault": tier_fault}


def run_one(name: str, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    cfg, warm, window = SCENARIOS[name](rng)
    t0 = time.monotonic()
    live = Live(cfg)
    try:
        warm(live, rng)
        live.idle()
        url, admin = live.base + "/metrics", live.base + "/admin/stats"
        adm_a, a = admin_stats(admin, ADMIN), scrape(url)
        t1 = time.monotonic()
        window(live, rng)
        live.idle()
        b, adm_b = scrape(url), admin_stats(admin, ADMIN)
        found = diagnose(Snapshot(a, b, time.monotonic() - t1, adm_a, adm_b))
    finally:
        live.close()
    top = found[0].cause if found else "healthy"
    return {"scenario": name, "seed": seed, "top": top, "right": top == name,
            "findings": [f.as_json() for f in found],
            "seconds": round(time.monotonic() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="runs per scenario")
    ap.add_argument("--scenario", action="append", choices=sorted(SCENARIOS),
                    help="only these (repeatable)")
    ap.add_argument("--json", default=str(RESULTS / "operations" / "doctor.json"))
    args = ap.parse_args()
    names = args.scenario or list(SCENARIOS)
    runs = []
    for name in names:
        for i in range(args.runs):
            r = run_one(name, 1000 + i)
            runs.append(r)
            print(f"{name:13s} seed {r['seed']}: top={r['top']:13s} "
                  f"{'ok' if r['right'] else 'WRONG'} ({r['seconds']} s) "
                  + ", ".join(f"{f['cause']}={f['score']}" for f in r["findings"]), flush=True)
    predicted = sorted({r["top"] for r in runs} | set(names))
    t = Table(title="kvheat doctor: injected (rows) vs top-1 finding (columns)")
    t.add_column("injected")
    for p in predicted:
        t.add_column(p, justify="right")
    t.add_column("top-1", justify="right")
    matrix: dict[str, dict[str, int]] = {}
    for name in names:
        mine = [r for r in runs if r["scenario"] == name]
        matrix[name] = {p: sum(r["top"] == p for r in mine) for p in predicted}
        t.add_row(name, *(str(matrix[name][p]) for p in predicted),
                  f"{sum(r['right'] for r in mine)}/{len(mine)}")
    acc = sum(r["right"] for r in runs) / len(runs)
    injected = [r for r in runs if r["scenario"] != "healthy"]
    healthy_runs = [r for r in runs if r["scenario"] == "healthy"]
    print_uncut(t)
    summary = {
        "runs_per_scenario": args.runs, "scenarios": names,
        "top1_accuracy": round(acc, 3),
        "top1_accuracy_injected": round(sum(r["right"] for r in injected) / len(injected), 3)
        if injected else None,
        "healthy_runs_with_findings": sum(bool(r["findings"]) for r in healthy_runs),
        "healthy_runs": len(healthy_runs), "confusion": matrix, "runs": runs,
        "machine": "CPU, in-process kvheat serve, built-in tiny model, torch 1 thread"}
    print(f"top-1 accuracy {acc:.0%} over {len(runs)} runs; healthy runs with findings: "
          f"{summary['healthy_runs_with_findings']}/{len(healthy_runs)}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
