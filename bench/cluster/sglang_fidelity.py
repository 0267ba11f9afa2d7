"""Does `sglang-like` (kvheat/router/routing.py) route as sglang-router's cache_aware does?

One seeded request stream goes through the real router (`smg`, sglang-router 0.3.2 in its
own venv) in front of stub workers that hold every request until the driver finishes it,
so each worker's requests in flight are known exactly at every decision; and the same
stream, with those same counts, through `SglangLike`. Requests are documents (repeated,
some hot) with a question after them, some questions longer than their document, so the
cache threshold, the fallback to the least-loaded worker and the balance rule (in flight
up to 300) are all exercised. It prints how often the two pick the same worker, by
the model's mode, and writes results/cluster/sglang_fidelity.json (`--json`; the doc's copy
is under docs/results/cluster/).

    python bench/cluster/sglang_fidelity.py --smg /tmp/sglr/bin/smg
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import random
import shutil
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from aiohttp import web

if not __package__:  # run as `python bench/cluster/sglang_fidelity.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench._lib import RESULTS
from bench._lib.procs import free_port
from kvheat.router.routing import ReplicaState, RouteRequest, SglangLike

COMPLETION = {"id": "x", "object": "text_completion", "model": "m",
              "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


class Stubs:
    """Workers that answer only when the driver sets their request's future."""

    def __init__(self, n: int) -> None:
        self.ports = [free_port() for _ in range(n)]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.arrived: asyncio.Queue[tuple[str, asyncio.Future[None]]] = asyncio.Queue()
        self.runners: list[web.AppRunner] = []

    async def start(self) -> None:
        for url, port in zip(self.urls, self.ports):
            app = web.Application()
            app.router.add_get("/health", self._ok)
            app.router.add_get("/health_generate", self._ok)
            app.router.add_get("/v1/models", self._models)
            app.router.add_get("/get_model_info", self._info)
            app.router.add_get("/get_server_info", self._info)
            app.router.add_post("/v1/completions", self._handler(url))
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            self.runners.append(runner)

    def _handler(self, url: str):
        async def complete(request: web.Request) -> web.Response:
            await request.read()
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            await self.arrived.put((url, done))
            await done
            return web.json_response(COMPLETION)
        return complete

    @staticmethod
    async def _ok(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    @staticmethod
    async def _models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    @staticmethod
    async def _info(_: web.Request) -> web.Response:
        return web.json_response({"model_path": "m"})

    async def stop(self) -> None:
        for r in self.runners:
            await r.cleanup()


def char_keys(text: str) -> list[int]:
    """One chained key per character: the model's blocks are the text tree's characters."""
    return list(itertools.accumulate(text, lambda h, c: hash((h, c)), initial=0))[1:]


class Prompts:
    """Documents, a third of them new, the rest repeated by a Zipf-like weight (or, at
    times, mostly one hot document), each with a question after it of 30 to 2,000
    characters (so some match less than the threshold)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.docs: list[str] = []
        self.hot = 0.0  # share of requests that re-ask the hot document
        self.hot_doc = ""

    def heat_up(self, share: float) -> None:
        """A new document of 1,500 characters takes `share` of the requests (0: none):
        long enough that even its longest question matches above the threshold."""
        self.hot = share
        self.hot_doc = "".join(self.rng.choices(string.ascii_lowercase + " ", k=1500))

    def next(self) -> str:
        rng, letters = self.rng, string.ascii_lowercase + " "
        if not self.docs or rng.random() < 0.35:
            self.docs.append("".join(rng.choices(letters, k=rng.randint(200, 1500))))
            doc = self.docs[-1]
        elif self.hot and rng.random() < self.hot:
            doc = self.hot_doc
        else:
            doc = rng.choices(self.docs, [1.0 / (r + 1) for r in range(len(self.docs))])[0]
        return doc + "\n" + "".join(rng.choices(letters, k=rng.choice((30, 120, 600, 2000))))


async def run(args: argparse.Namespace) -> dict:
    stubs = Stubs(args.workers)
    await stubs.start()
    port = free_port()
    log = Path(tempfile.mkdtemp()) / "smg.log"
    cmd = [args.smg, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
           *stubs.urls, "--policy", "cache_aware", "--prometheus-port", str(free_port()),
           "--log-level", "warn"]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    conn = aiohttp.TCPConnector(limit=0)
    try:
        async with aiohttp.ClientSession(connector=conn) as http:
            await _wait_ready(http, base, proc)
            return await _drive(args, http, base, stubs)
    finally:
        proc.terminate()
        proc.wait(10)
        await stubs.stop()


async def _wait_ready(http: aiohttp.ClientSession, base: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("smg exited")
        try:
            async with http.get(base + "/v1/models") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.3)
    raise RuntimeError("smg did not become ready")


async def _drive(args: argparse.Namespace, http: aiohttp.ClientSession, base: str,
                 stubs: Stubs) -> dict:
    model = SglangLike()
    held: list[tuple[str, asyncio.Future[None], asyncio.Task]] = []
    in_flight = {u: 0 for u in stubs.urls}

    async def send(prompt: str) -> str:
        task = asyncio.create_task(_post(http, base, prompt))
        url, done = await asyncio.wait_for(stubs.arrived.get(), 10)
        held.append((url, done, task))
        in_flight[url] += 1
        return url

    async def finish(i: int) -> None:
        url, done, task = held.pop(i)
        done.set_result(None)
        await task
        in_flight[url] -= 1
        await asyncio.sleep(args.settle)  # the router's own bookkeeping of the finish

    # The router's order of workers (its ties go to the first of the least loaded): one
    # distinct prompt per worker, each sent while the ones before are held, goes to its
    # first, second, third worker...
    order: list[str] = []
    for _ in stubs.urls:
        p = "".join(random.Random(len(order)).choices("0123456789", k=64))
        order.append(await send(p))
        model.routed(RouteRequest(char_keys(p), [1] * len(p), len(p)), order[-1])
    while held:
        await finish(0)

    rng = random.Random(args.seed)
    prompts = Prompts(rng)
    rows: list[dict] = []

    async def arrive() -> None:
        prompt = prompts.next()
        states = [ReplicaState(u, in_flight=in_flight[u]) for u in order]
        req = RouteRequest(char_keys(prompt), [1] * len(prompt), len(prompt))
        d = model.choose(req, states)
        got = await send(prompt)
        model.routed(req, got)  # the model's trees follow the real router's choices
        rows.append({"mode": d.mode, "agree": got == order[d.replica],
                     "loads": [s.in_flight for s in states], "model": d.replica,
                     "smg": order.index(got), "match_chars": d.expected_hit_tokens,
                     "chars": len(prompt)})

    for wave in range(args.waves):  # in flight up to the peak, then down to none
        # every other wave one document is hot enough to unbalance the loads
        prompts.heat_up(0.8 if wave % 2 else 0.0)
        while sum(in_flight.values()) < args.peak:
            if rng.random() < 0.85 or not held:
                await arrive()
            else:
                await finish(rng.randrange(len(held)))
        while held:
            if rng.random() < 0.15:
                await arrive()
            else:
                await finish(rng.randrange(len(held)))
    return _summary(rows, order)


def _summary(rows: list[dict], order: list[str]) -> dict:
    modes: dict[str, dict[str, int]] = {}
    for r in rows:
        m = modes.setdefault(r["mode"], {"decisions": 0, "agree": 0})
        m["decisions"] += 1
        m["agree"] += r["agree"]
    agree = sum(r["agree"] for r in rows)
    return {"decisions": len(rows), "agree": agree,
            "agreement": agree / len(rows) if rows else 0.0, "by_mode": modes,
            "worker_order": order,
            "max_in_flight_spread": max((max(r["loads"]) - min(r["loads"]) for r in rows), default=0),
            "disagreements": [r for r in rows if not r["agree"]][:20]}


async def _post(http: aiohttp.ClientSession, base: str, prompt: str) -> None:
    body = {"model": "m", "prompt": prompt, "max_tokens": 1}
    async with http.post(base + "/v1/completions", json=body) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"smg answered {r.status}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smg", default=shutil.which("smg"), help="sglang-router's smg binary")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--waves", type=int, default=4)
    ap.add_argument("--peak", type=int, default=300, help="requests in flight at the top")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--settle", type=float, default=0.003,
                    help="seconds after a finish before the next step")
    ap.add_argument("--json", type=Path, default=RESULTS / "cluster" / "sglang_fidelity.json")
    args = ap.parse_args()
    if not args.smg:
        sys.exit("sglang-router's smg not found (--smg PATH)")
    # smg probes each worker for gRPC (an HTTP/2 preface) before it settles on HTTP
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    res = asyncio.run(run(args))
    print(f"{'model mode':<10} {'decisions':>9} {'same worker':>11}")
    for mode, m in sorted(res["by_mode"].items()):
        print(f"{mode:<10} {m['decisions']:>9} {m['agree']:>11}")
    print(f"{'all':<10} {res['decisions']:>9} {res['agree']:>11}  ({100 * res['agreement']:.1f}%)")
    res["config"] = {k: v for k, v in vars(args).items() if k not in ("json", "smg")}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
