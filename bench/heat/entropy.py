"""The O(1) decayed-entropy tracker: accuracy, speed, memory per key, sampling error.

    .venv/bin/python bench/heat/entropy.py --json docs/results/heat/entropy.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import tracemalloc
from pathlib import Path

if not __package__:  # run as `python bench/heat/entropy.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from kvheat.heat import EntropyTracker


def accuracy(n: int = 1_000_000, half_life: float = 300.0) -> dict[str, float]:
    rng = random.Random(7)
    keys = [rng.randrange(5000) if rng.random() < 0.5 else int(rng.paretovariate(1.0)) for _ in range(n)]
    tr = EntropyTracker(half_life=half_life)
    t0 = time.perf_counter()
    for k in keys:
        tr.update(k)
    dt = time.perf_counter() - t0
    fast, ref = tr.entropy(), tr.entropy_from_scratch()
    return {"updates": n, "rebases": len(tr.shifts) - 1, "bits": fast / 0.6931471805599453,
            "relative_error": abs(fast - ref) / ref, "us_per_update": dt / n * 1e6}


def memory_per_key(n: int = 100_000) -> dict[str, float]:
    keys = [random.Random(i).randbytes(16) for i in range(n)]  # like 128-bit block keys
    tracemalloc.start()
    base = tracemalloc.take_snapshot()
    tr = EntropyTracker()
    for k in keys:
        tr.update(k)
    snap = tracemalloc.take_snapshot()
    tracemalloc.stop()
    used = sum(s.size_diff for s in snap.compare_to(base, "filename"))
    return {"keys": n, "bytes_per_key_structure": used / n,
            "bytes_per_key_arrays": tr.array_bytes() / n,
            "note": "key objects themselves (16-byte bytes, ~49 B each) are owned by the cache"}


def sampling_error(n: int = 300_000) -> list[dict[str, float]]:
    out = []
    for shape in (1.2, 1.5, 2.5):  # Pareto tails: all below the 4.2-bit sampling threshold
        rng = random.Random(int(shape * 10))
        keys = [int(rng.paretovariate(shape)) for _ in range(n)]
        full = EntropyTracker(half_life=50_000)
        sampled = EntropyTracker(half_life=50_000, sample_low=0.25)
        t0 = time.perf_counter()
        for k in keys:
            full.update(k)
        t_full = time.perf_counter() - t0
        t0 = time.perf_counter()
        for k in keys:
            sampled.update(k)
        t_s = time.perf_counter() - t0
        out.append({"pareto_shape": shape, "full_bits": full.bits(), "sampled_bits": sampled.bits(),
                    "abs_error_bits": abs(full.bits() - sampled.bits()),
                    "recorded_fraction": sampled.recorded / sampled.updates,
                    "speedup": t_full / t_s})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    acc = accuracy()
    print(f"accuracy: {acc['updates']:,} updates, {acc['rebases']} rebases, H = {acc['bits']:.4f} bits, "
          f"relative error vs from-scratch {acc['relative_error']:.2e}, {acc['us_per_update']:.2f} µs/update")
    mem = memory_per_key()
    print(f"memory: {mem['bytes_per_key_structure']:.1f} B/key (dict slot + arrays), "
          f"{mem['bytes_per_key_arrays']:.1f} B/key in the typed arrays")
    samp = sampling_error()
    print("entropy-adaptive sampling (25% below 4.2 bits):")
    for s in samp:
        print(f"  pareto {s['pareto_shape']}: full {s['full_bits']:.3f} bits, sampled {s['sampled_bits']:.3f}, "
              f"error {s['abs_error_bits']:.3f} bits, recorded {100 * s['recorded_fraction']:.0f}%, "
              f"speedup {s['speedup']:.2f}x")
    if a.json:
        Path(a.json).write_text(json.dumps({"accuracy": acc, "memory": mem, "sampling": samp}, indent=1))


if __name__ == "__main__":
    main()
