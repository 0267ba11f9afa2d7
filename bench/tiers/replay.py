"""Replay a Mooncake trace through a small device tier with host and disk tiers below it.

    python bench/tiers/replay.py [--trace ../shared/traces/mooncake_conversation_part1.jsonl]
        [--policy lru,kvheat] [--prefill-tps 20000,3e6] [--mac blake3,blake2b]
        [--repeats N] [--limit N] [--json docs/results/tiers/replay_ab.json]

The real `KVCacheManager` runs the device pool (requests built with `make_hashed_request`
from the trace's 512-token block ids) and a `TierManager` moves real KV bytes between the
`DeviceKVPool`, a `HostStore` and a `DiskStore` in a temporary directory. An engine
stand-in writes each computed block's KV (a fixed function of its key) and checks every
block served from cache, so a wrong byte anywhere fails the run. Reported: token hit rate by
tier (a prefix counts, as SPEC.md defines), the load-or-recompute decisions at each prefill
speed, and each tier's measured latency and bandwidth.

`--mac` runs every configuration once per MAC of the disk tier's values (BLAKE3, the
format since issue 42, and BLAKE2b, the one before), interleaved (policy, speed, MAC, then
the next), `--repeats` times over, so the two see the same machine load; the summary gives
each configuration's median and range over the repeats.

The KV payload is small (a one-layer model: `--kv-bytes-per-token`, default 16) so the
whole trace fits the machine; the break-even prefill speed for a production-size block is
computed from the measured fit, not replayed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

if not __package__:  # run as `python bench/tiers/replay.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench._lib import RESULTS, TRACES
from kvheat.cache import CacheConfig, KVCacheManager, make_policy
from kvheat.engine.kv_pool import DeviceKVPool
from kvheat.replay.traces import load_trace
from kvheat.tiers import DiskStore, HostStore, TierManager, TierSpec
from kvheat.tiers.device import allocate, attach, tiers_for
from kvheat.tiers.loads import LoadPlan

torch.set_num_threads(1)
BLOCK = 512


def kv_of(key: bytes, shape: tuple[int, ...], nbytes: int) -> torch.Tensor:
    """The KV a block holds: a fixed function of its key (cheap, checkable)."""
    reps = -(-nbytes // len(key))
    return torch.frombuffer(bytearray((key * reps)[:nbytes]), dtype=torch.float16).view(shape)


def unreachable(mgr: KVCacheManager, tc: TierManager,
                parent_of: dict[bytes, bytes | None]) -> list[int]:
    """Per lower tier, entries whose prefix has a block held by no tier nor the device:
    a match stops there, so they can never be served again."""
    held = set(mgr.cached)
    for idx in tc.indexes:
        held.update(idx.entries)
    ok: dict[bytes, bool] = {}

    def reach(key: bytes) -> bool:
        path = []
        k: bytes | None = key
        while k is not None and k not in ok:
            if k not in held:
                break
            path.append(k)
            k = parent_of.get(k)
        res = k is None or ok.get(k, False)
        for p in path:
            ok[p] = res
        if key not in ok:
            ok[key] = res
        return res

    return [sum(1 for k in list(idx.entries) if not reach(k)) for idx in tc.indexes]


def run(trace_path: Path, policy: str, prefill_tps: float | None, device_tokens: int,
        host_tokens: int, disk_tokens: int, kv_bytes_per_token: int, limit: int | None,
        async_io: bool, mac: str | None = None) -> dict:
    trace = load_trace(trace_path, BLOCK, limit)
    head_dim = kv_bytes_per_token // 4  # fp16, K and V, one layer, one head
    pool = DeviceKVPool("gqa", 1, device_tokens // BLOCK, BLOCK, (1, head_dim), torch.float16)
    bb = pool.bytes_per_block
    shape = tuple(pool.block_view(0).shape)
    now = [0.0]
    mgr = KVCacheManager(CacheConfig(device_tokens // BLOCK, BLOCK, policy=policy),
                         policy=make_policy(policy), clock=lambda: now[0])
    with tempfile.TemporaryDirectory(prefix="kvheat-replay-") as tmp:
        host = HostStore(host_tokens // BLOCK * bb, bb)
        disk = DiskStore(Path(tmp) / "disk", disk_tokens // BLOCK * (bb + 128), fsync=False)
        if mac is not None:
            disk.mac = mac
        tc = tiers_for(mgr, pool, TierSpec(policy=policy, async_io=async_io, calibrate=True),
                       prefill_tokens_per_s=prefill_tps, stores=[host, disk])
        detach = attach(tc, mgr, pool)
        wrong = 0
        parent_of: dict[bytes, bytes | None] = {}  # the trace's own prefix tree
        samples: list[int] = []
        computed_tokens = 0
        load_s = [0.0]
        tier_load = tc.load

        def timed_load(plan: LoadPlan, slots: Sequence[int], device: DeviceKVPool) -> int:
            t = time.perf_counter()  # the loads' wall time
            try:
                return tier_load(plan, slots, device)
            finally:
                load_s[0] += time.perf_counter() - t

        setattr(tc, "load", timed_load)  # noqa: B010 (timing the real loads in place)
        t0 = time.perf_counter()
        for i, r in enumerate(trace):
            now[0] = r.timestamp_ms / 1000.0
            req = mgr.make_hashed_request(str(i), r.hash_ids, r.input_length)
            if len(req.block_tokens) > mgr.config.num_blocks:
                continue
            for j, key in enumerate(req.keys):
                parent_of.setdefault(key, req.keys[j - 1] if j else None)
            if i % 500 == 499:
                tc.flush()
                samples.append(sum(unreachable(mgr, tc, parent_of)))
            allocate(tc, mgr, pool, req)
            cached = req.num_cached_tokens
            computed_tokens += sum(req.block_tokens) - cached
            done = 0
            for b, key, n in zip(req.blocks, req.keys, req.block_tokens, strict=True):
                want = kv_of(key, shape, bb)
                if done + n <= cached:
                    # bytes, not values: key bytes read as fp16 include NaNs
                    if not torch.equal(pool.block_view(b.block_id).view(torch.uint8),
                                       want.view(torch.uint8)):
                        wrong += 1
                else:
                    pool.write_block(b.block_id, want)  # the "prefill"
                done += n
            mgr.free(req)
        tc.flush()
        wall = time.perf_counter() - t0
        orphans_end = unreachable(mgr, tc, parent_of)
        st = tc.stats()
        tc.close()
        detach()
    c = tc.counters
    q = max(1, c.query_tokens)
    tiers = st["tiers"]
    fits = {name: {"read_latency_us": (d["read_latency_s"] or 0) * 1e6,  # type: ignore[index]
                   "read_bandwidth_MBps": (d["read_bandwidth_Bps"] or 0) / 1e6}  # type: ignore[index]
            for name, d in tiers.items()}  # type: ignore[union-attr]
    def block_read_us(d: dict) -> float | None:  # the fitted read of one block
        if not d["read_bandwidth_Bps"]:
            return None
        return ((d["read_latency_s"] or 0) + bb / d["read_bandwidth_Bps"]) * 1e6

    return {
        "policy": policy, "prefill_tps": prefill_tps, "mac": disk.mac, "requests": c.requests,
        "device_tokens": device_tokens, "host_tokens": host_tokens, "disk_tokens": disk_tokens,
        "block_bytes": bb, "query_tokens": c.query_tokens,
        "device_hit_rate": c.device_hit_tokens / q,
        "host_hit_rate": tiers["0:host"]["hit_tokens"] / q,  # type: ignore[index]
        "disk_hit_rate": tiers["1:disk"]["hit_tokens"] / q,  # type: ignore[index]
        "total_hit_rate": (c.device_hit_tokens + c.lower_hit_tokens) / q,
        "found_below_rate": c.found_tokens / q,
        "decisions_load": c.decisions_load, "decisions_partial": c.decisions_partial,
        "decisions_recompute": c.decisions_recompute,
        "recompute_chosen_tokens": c.recompute_chosen_tokens,
        "est_load_s": c.est_load_s, "est_recompute_saved_s": c.est_recompute_saved_s,
        "load_failed": c.load_failed, "wrong_kv_blocks": wrong,
        "demotions": c.demotions, "demote_dropped": c.demote_dropped,
        "dropped_bottom": c.dropped_bottom, "fits": fits, "wall_s": wall,
        # What the hits are for: time to the first token. The loads' measured wall time
        # plus the prompt tokens left to compute at --prefill-tps.
        "load_s": load_s[0], "computed_tokens": computed_tokens,
        "prefill_s": load_s[0] + computed_tokens / prefill_tps if prefill_tps else None,
        # What load-or-recompute compares, per block, at the end of the run.
        "block_read_us": {name: block_read_us(d) for name, d in tiers.items()},  # type: ignore[arg-type]
        "block_recompute_us": BLOCK / prefill_tps * 1e6 if prefill_tps else None,
        # Lower-tier entries no prefix match can reach (an ancestor held nowhere), by tier
        # at the end, and summed over tiers every 500 requests; `orphans_dropped` is the
        # hierarchy's own cascade counter (absent before it had one).
        "unreachable_end": orphans_end,
        "unreachable_mean": sum(samples) / len(samples) if samples else 0.0,
        "unreachable_max": max(samples, default=0),
        "orphans_dropped": getattr(c, "orphans_dropped", None),
    }


def summary(rows: list[dict]) -> list[dict]:
    """Median and range over the repeats of each (policy, speed, MAC)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["policy"], r["prefill_tps"], r["mac"]), []).append(r)
    out = []
    for (policy, tps, mac), rs in groups.items():
        d: dict[str, object] = {"policy": policy, "prefill_tps": tps, "mac": mac,
                                "repeats": len(rs)}
        for k in ("total_hit_rate", "device_hit_rate", "host_hit_rate", "disk_hit_rate",
                  "prefill_s"):
            xs = [r[k] for r in rs]
            d[k] = {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}
        for tier in rs[0]["block_read_us"]:
            xs = [r["block_read_us"][tier] for r in rs if r["block_read_us"][tier] is not None]
            d[f"{tier}_block_read_us"] = ({"median": statistics.median(xs), "min": min(xs),
                                          "max": max(xs)} if xs else None)
        d["wrong_kv_blocks"] = sum(r["wrong_kv_blocks"] for r in rs)
        out.append(d)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=str(TRACES /
                                           "mooncake_conversation_part1.jsonl"))
    ap.add_argument("--policy", default="lru,kvheat")
    ap.add_argument("--prefill-tps", default="20000,3e6",
                    help="engine prefill speeds (tokens/s) to decide load-or-recompute at")
    ap.add_argument("--mac", default=None,
                    help="MACs of the disk tier's values to compare, e.g. blake3,blake2b "
                         "(default: the store's own, codec.value_mac_version)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of every configuration, interleaved")
    ap.add_argument("--repeats-at", default=None,
                    help="only these prefill speeds get --repeats runs (others one)")
    ap.add_argument("--device-tokens", type=int, default=1_000_000)
    ap.add_argument("--host-tokens", type=int, default=2_000_000)
    ap.add_argument("--disk-tokens", type=int, default=8_000_000)
    ap.add_argument("--kv-bytes-per-token", type=int, default=16)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--async-io", action="store_true",
                    help="background demotion thread (hit rates then depend on timing)")
    ap.add_argument("--json", default=str(RESULTS / "tiers" / "replay.json"))
    args = ap.parse_args()
    trace = Path(args.trace)
    if not trace.exists():
        print(f"trace {trace} not found; nothing to replay")
        return
    macs: list[str | None] = args.mac.split(",") if args.mac else [None]
    speeds = [float(x) for x in args.prefill_tps.split(",")]
    repeated = ({float(x) for x in args.repeats_at.split(",")} if args.repeats_at
                else set(speeds))
    rows = []
    for rep in range(args.repeats):
        for tps in speeds:
            if rep and tps not in repeated:
                continue
            for policy in args.policy.split(","):
                for mac in macs:
                    load = os.getloadavg()[0]
                    r = run(trace, policy, tps, args.device_tokens, args.host_tokens,
                            args.disk_tokens, args.kv_bytes_per_token, args.limit,
                            args.async_io, mac)
                    r["repeat"], r["load_avg_1m"] = rep, load
                    rows.append(r)
                    reads = ", ".join(f"{k} {v:.1f}" for k, v in r["block_read_us"].items()
                                      if v is not None)
                    print(f"{policy:7s} prefill {tps:>9.0f} tok/s  {r['mac']:7s}  "
                          f"device {r['device_hit_rate']:6.2%}  "
                          f"host {r['host_hit_rate']:6.2%}  disk {r['disk_hit_rate']:6.2%}  "
                          f"total {r['total_hit_rate']:6.2%}  "
                          f"(found below {r['found_below_rate']:6.2%})  "
                          f"load/partial/recompute {r['decisions_load']}/"
                          f"{r['decisions_partial']}/{r['decisions_recompute']}  "
                          f"wrong KV {r['wrong_kv_blocks']}  block read us: {reads}  "
                          f"unreachable end {r['unreachable_end']}  load {load:.1f}  "
                          f"prefill {r['prefill_s']:.3f}s (loads {r['load_s']:.3f}s)  "
                          f"{r['wall_s']:.0f}s", flush=True)
                    write(args.json, trace, rows)  # after every run: a long run stopped keeps its rows
    summ = write(args.json, trace, rows)
    for d in summ:
        t = d["total_hit_rate"]
        p = d["prefill_s"]
        print(f"{d['policy']:7s} {d['prefill_tps']:>9.0f} tok/s  {d['mac']:7s}  total "
              f"{t['median']:6.2%} ({t['min']:.2%}-{t['max']:.2%})  prefill "  # type: ignore[index]
              f"{p['median']:.3f}s ({p['min']:.3f}-{p['max']:.3f}) over {d['repeats']}")  # type: ignore[index]
    print(f"wrote {args.json}")


def write(path: str, trace: Path, rows: list[dict]) -> list[dict]:
    summ = summary(rows)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"trace": str(trace), "summary": summ, "runs": rows},
                                     indent=2) + "\n")
    return summ


if __name__ == "__main__":
    main()
