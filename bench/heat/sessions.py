"""Every policy on every shared trace, with session hints on and off: the tables of issue
"Heat that knows sessions" (kvheat against LRU-K, vLLM's `sae` and the rest).

Traces: `conv`, `synth` (the shared Mooncake traces), `conv_a`/`conv_b` (the conversation
trace's first and second half by request count), `gen` (the built-in generator),
`agentic_dev` (traces/agentic/agentic_dev.jsonl: 120 Claude Code sessions, 512-token blocks;
`agentic_dev_b` another draw made the same way, `agentic_dev_long` 120 long sessions)
and `agentic_raw` (the raw kv-cache-tester sessions of traces/agentic/raw through
`load_kv_cache_tester`, sub-agents included: each file played 15 times as sessions of
their own, started at seeded offsets within 2 hours, 4 hours each, as agentic_dev was
drawn). `--heldout` adds `agentic_raw_s1..s3`: the same draw at other seeds, the check
that nothing was tuned to one draw.

Modes: `plain` (requests one at a time, as `kvheat replay`; every policy here is
scale-free there, which `--scale-check` verifies at time scales 0.1 and 10) and `hold<k>`
(each request holds its blocks for its modelled duration, timestamps times k: k = 0.1 is
ten times the request rate, so more requests overlap).

Hints: `off` replays the prompts alone; `on` gives the cache each request's session (the
trace's session id, else the one derived from the earlier prompt it extends), its finish
reason and outcome. Policies that read no hint (every one but those of `--hint-policies`)
give the same figures either way: they run once and count for both.

Policies: any registered name, or a kvheat variant `kvheat[option=value,...]` (its
constructor's keyword arguments, values read as JSON, else as text: e.g.
`kvheat[session_own=true]`, `kvheat[session_hints=log,session_rate=false]`), run with
hints off and on like kvheat. `--ablation` runs the variants of `ABLATION` (what each of
kvheat's hint options is worth) beside lru, lruk and belady.

    .venv/bin/python bench/heat/sessions.py                    # everything (long: use --jobs)
    .venv/bin/python bench/heat/sessions.py --only 'conv/*' --only '*/kvheat/*' --jobs 2
    .venv/bin/python bench/heat/sessions.py --modes plain --heldout
    .venv/bin/python bench/heat/sessions.py --ablation --traces agentic_dev,agentic_raw_s1,agentic_raw_s2 \
        --capacities 1M,3M --modes plain --json docs/results/heat/hints_ablation.json

Job ids are `trace/capacity/mode/policy/hints` (e.g. `conv/1M/plain/kvheat/on`); `--only`
takes shell patterns over them. Results merge into the JSON file (default
docs/results/heat/sessions.json) by job id, so parallel runs of disjoint `--only` sets add
up. Prints, per trace and mode, every policy's hit rate, kvheat's margin over the best
other online policy and the share of the LRU -> Belady gap each policy closes, and flags
every cell where kvheat is more than 0.1 point below the best other online policy.
"""

from __future__ import annotations

import argparse
import fcntl
import fnmatch
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from functools import cache, partial
from pathlib import Path

if not __package__:  # run as `python bench/heat/sessions.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench._lib import ROOT, TRACES
from bench._lib.traces import get_trace
from kvheat.cache import make_policy
from kvheat.replay import PreparedTrace, replay
from kvheat.replay.replayer import PolicySpec
from kvheat.replay.traces import SessionDraw, load_kv_cache_tester

ONLINE = ["lru", "fifo", "lfu", "arc", "s3fifo", "twoq", "lruk", "lirs", "lecar", "sae", "kvheat"]
POLICIES = [*ONLINE, "belady"]
CAPACITIES = [1_000_000, 3_000_000, 10_000_000]
MODES = ["plain", "hold0.1", "hold1", "hold10"]
TRACE_NAMES = ["conv", "synth", "gen", "agentic_dev", "agentic_dev_b", "agentic_dev_long",
               "agentic_raw"]
HALVES = ["conv_a", "conv_b"]  # the conversation trace's halves (not in the default set)
HELDOUT = ["agentic_raw_s1", "agentic_raw_s2", "agentic_raw_s3"]
HINT_POLICIES = ["kvheat", "sae"]
# kvheat's hint options, one variant each (hints off and on): the end class's charge
# ("horizon", the default: the share of a class's sessions back within the eviction age;
# "log"/"linear": its median return gap, with `session_rate` the share that returns at all)
# and the session's own pace (`session_own`).
ABLATION = [
    "kvheat",
    "kvheat[session_hints=log,session_rate=false]",
    "kvheat[session_hints=log]",
    "kvheat[session_hints=log,session_own=true]",
    "kvheat[session_hints=linear,session_rate=false]",
    "kvheat[session_own=true]",
]
ABLATION_REFERENCE = ["lru", "lruk", "belady"]
BLOCK = 512
FLAG_POINTS = 0.1  # a cell is flagged where kvheat is this far below the best other
DEFAULT_JSON = ROOT / "docs" / "results" / "heat" / "sessions.json"
# The raw agentic draw: as agentic_dev.jsonl was drawn (offsets within 2 h, 4 h per session).
RAW_DRAW = SessionDraw(group=BLOCK // 64, offset_s=7200.0, span_s=4 * 3600.0, seed=11, copies=15)


@cache
def trace(name: str) -> PreparedTrace:
    if name.startswith("agentic_dev"):  # agentic_dev, agentic_dev_b, agentic_dev_long
        from kvheat.replay import load_trace

        return PreparedTrace(load_trace(TRACES / "agentic" / f"{name}.jsonl", BLOCK), BLOCK)
    if name.startswith("agentic_raw"):
        seed = int(name.rsplit("_s", 1)[1]) if "_s" in name else RAW_DRAW.seed
        draw = SessionDraw(group=RAW_DRAW.group, offset_s=RAW_DRAW.offset_s,
                           span_s=RAW_DRAW.span_s, seed=seed, copies=RAW_DRAW.copies)
        return PreparedTrace(load_kv_cache_tester(TRACES / "agentic", draw), BLOCK)
    if name in HALVES:
        whole = get_trace("conv", BLOCK)
        half = len(whole) // 2
        return PreparedTrace(whole[:half] if name == "conv_a" else whole[half:], BLOCK)
    return PreparedTrace(get_trace(name, BLOCK), BLOCK)


def split_policies(text: str) -> list[str]:
    """A comma-separated list of policies, commas inside a variant's brackets kept:
    `lru,kvheat[a=1,b=2]` -> [`lru`, `kvheat[a=1,b=2]`]."""
    out: list[str] = []
    depth, cur = 0, ""
    for ch in text:
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
            continue
        depth += (ch == "[") - (ch == "]")
        cur += ch
    out.append(cur)
    return [p for p in out if p]


def base_policy(name: str) -> str:
    """`kvheat[session_own=true]` -> `kvheat`."""
    return name.split("[", 1)[0]


def policy_spec(name: str) -> PolicySpec:
    """A registered policy name, or `name[option=value,...]`: the policy made with those
    keyword arguments (values read as JSON, `None` as null, else as text): kvheat's previous
    default is `kvheat[admit_now=false,regime_warmup=false,admit_penalty=1.6,admit_floor=None]`."""
    if "[" not in name:
        return name
    if not name.endswith("]"):
        raise ValueError(f"bad policy variant {name!r} (use e.g. kvheat[session_own=true])")
    kwargs: dict[str, object] = {}
    for item in name[name.index("[") + 1:-1].split(","):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"bad option {item!r} in {name!r} (use option=value)")
        if value.strip() == "None":
            kwargs[key.strip()] = None
            continue
        try:
            kwargs[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            kwargs[key.strip()] = value.strip()
    return partial(make_policy, base_policy(name), **kwargs)


def _cap(tokens: int) -> str:
    return f"{tokens / 1e6:g}M"


def job_id(tr: str, cap: int, mode: str, policy: str, hints: bool) -> str:
    return f"{tr}/{_cap(cap)}/{mode}/{policy}/{'on' if hints else 'off'}"


def jobs(traces: list[str], caps: list[int], modes: list[str], policies: list[str],
         hint_policies: list[str], only: list[str]) -> list[tuple[str, int, str, str, bool]]:
    out = []
    for tr in traces:
        for cap in caps:
            for mode in modes:
                for p in policies:
                    hinted = p in hint_policies or base_policy(p) in hint_policies
                    for hints in ([False, True] if hinted else [False]):
                        j = (tr, cap, mode, p, hints)
                        if not only or any(fnmatch.fnmatch(job_id(*j), pat) for pat in only):
                            out.append(j)
    # Slowest first (agentic traces, hold modes), so a pool's workers end together.
    return sorted(out, key=lambda j: (not j[0].startswith("agentic"), j[2] == "plain"))


def run(j: tuple[str, int, str, str, bool]) -> dict:
    tr, cap, mode, policy, hints = j
    pt = trace(tr)
    hold = mode != "plain"
    scale = float(mode[4:]) if hold else 1.0
    t0 = time.perf_counter()
    r = replay(pt, policy_spec(policy), cap, BLOCK, hold=hold, time_scale=scale, hints=hints)
    return {"id": job_id(*j), "trace": tr, "mode": mode, "hints": hints,
            "wall_s": round(time.perf_counter() - t0, 2), **r.as_dict(), "policy": policy}


def run_all(js: list[tuple[str, int, str, str, bool]], workers: int, path: Path,
            extra: dict) -> list[dict]:
    """Run the jobs, merging each result into `path` as it comes (a run cut short keeps
    what it finished)."""
    done = []

    def got(r: dict) -> None:
        done.append(r)
        merge(path, [r], extra)
        print(f"  {r['id']}: {100 * r['hit_rate']:.2f}%", flush=True)

    if workers <= 1:
        for j in js:
            got(run(j))
        return done
    with ProcessPoolExecutor(workers) as ex:
        for r in ex.map(run, js, chunksize=1):
            got(r)
    return done


def merge(path: Path, rows: list[dict], extra: dict) -> dict:
    """Merge `rows` into the JSON at `path` by job id (under a lock: parallel runs of
    disjoint --only sets write the same file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        old = json.loads(path.read_text()) if path.exists() else {}
        by = {r["id"]: r for r in old.get("replays", [])}
        by.update({r["id"]: r for r in rows})
        doc = {**old, **extra, "replays": sorted(by.values(), key=lambda r: r["id"])}
        doc["cells"] = cells(doc["replays"])
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, path)
    return doc


def cells(rows: list[dict]) -> list[dict]:
    """One record per (trace, capacity, mode, hints): every policy's hit rate (a policy
    run without hints counts for both), the best other online policy, kvheat's margin over
    it, the share of the LRU -> Belady gap each policy closes, and the flag."""
    rate: dict[tuple, dict[str, float]] = {}
    for r in rows:
        key = (r["trace"], r["capacity_tokens"], r["mode"])
        for h in ([True, False] if not r["hints"] else [True]):
            rate.setdefault((*key, h), {})
            cur = rate[(*key, h)]
            if r["hints"] or r["policy"] not in cur:
                cur[r["policy"]] = r["hit_rate"]
    out = []
    for (tr, cap, mode, hints), rates in sorted(rate.items()):
        rec: dict = {"trace": tr, "capacity_tokens": cap, "mode": mode, "hints": hints,
                     "rates": rates}
        others = {p: v for p, v in rates.items() if p in ONLINE and p != "kvheat"}
        if others:
            best = max(others, key=others.__getitem__)
            rec["best_other"], rec["best_other_rate"] = best, others[best]
            if "kvheat" in rates:
                rec["margin"] = rates["kvheat"] - others[best]
                rec["flag"] = rec["margin"] < -FLAG_POINTS / 100
        lru, bel = rates.get("lru"), rates.get("belady")
        if lru is not None and bel is not None and bel > lru:
            rec["gap_closed"] = {p: (v - lru) / (bel - lru) for p, v in rates.items()
                                 if base_policy(p) in ONLINE}
        out.append(rec)
    return out


def print_tables(cs: list[dict]) -> None:
    groups: dict[tuple[str, str], list[dict]] = {}
    for c in cs:
        groups.setdefault((c["trace"], c["mode"]), []).append(c)
    for (tr, mode), g in groups.items():
        caps = sorted({c["capacity_tokens"] for c in g})
        seen = sorted({p for c in g for p in c["rates"]})
        pols = [p for p in POLICIES if p in seen] + [p for p in seen if p not in POLICIES]
        w = max(8, *map(len, pols))
        by = {(c["capacity_tokens"], c["hints"]): c for c in g}
        cols = [(cap, h) for cap in caps for h in (False, True) if (cap, h) in by]
        print(f"\n{tr}, {mode}: hit rate % (gap closed), hints off | on")
        print(f"{'policy':>{w}} " + " ".join(f"{_cap(c) + (' on' if h else ' off'):>16}"
                                           for c, h in cols))
        for p in pols:
            line = []
            for col in cols:
                c = by[col]
                v = c["rates"].get(p)
                gc = c.get("gap_closed", {}).get(p)
                line.append("" if v is None else f"{100 * v:6.2f}" + (
                    f" ({100 * gc:+4.0f}%)" if gc is not None else "        "))
            print(f"{p:>{w}} " + " ".join(f"{x:>16}" for x in line))
        line = [f"{100 * by[col]['margin']:+.2f} vs {by[col]['best_other']}"
                if "margin" in by[col] else "" for col in cols]
        print(f"{'margin':>{w}} " + " ".join(f"{x:>16}" for x in line))
    flagged = [c for c in cs if c.get("flag")]
    print(f"\ncells where kvheat is more than {FLAG_POINTS} point below the best other online "
          f"policy: {len(flagged)} of {sum(1 for c in cs if 'margin' in c)}")
    for c in flagged:
        print(f"  FLAG {c['trace']} {_cap(c['capacity_tokens'])} {c['mode']} hints "
              f"{'on' if c['hints'] else 'off'}: {c['best_other']} by {-100 * c['margin']:.2f} points")


def scale_check(traces: list[str], workers: int) -> dict:
    """The plain replay at time scales 0.1 and 10 against 1, for the policies that read a
    clock at all (kvheat, lruk, sae): equal hit tokens where the policy is scale-free."""
    moved = []
    for tr in traces:
        pt = trace(tr)
        for p in ("kvheat", "lruk", "sae"):
            base = replay(pt, p, CAPACITIES[0], BLOCK).hit_tokens
            for s in (0.1, 10.0):
                if replay(pt, p, CAPACITIES[0], BLOCK, time_scale=s).hit_tokens != base:
                    moved.append(f"{tr}/{p}/x{s:g}")
    return {"scale_check": {"traces": traces, "capacity": CAPACITIES[0], "moved": moved}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", default=",".join(TRACE_NAMES))
    ap.add_argument("--heldout", action="store_true", help="add agentic_raw at seeds 1-3")
    ap.add_argument("--ablation", action="store_true",
                    help="kvheat's hint-option variants (ABLATION) beside lru, lruk, belady")
    ap.add_argument("--capacities", default="1M,3M,10M")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--hint-policies", default=",".join(HINT_POLICIES),
                    help="policies run with hints on as well as off")
    ap.add_argument("--only", action="append", default=[],
                    help="shell pattern over job ids trace/cap/mode/policy/hints (repeatable)")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes")
    ap.add_argument("--scale-check", action="store_true",
                    help="check plain replays are scale-free (time scales 0.1 and 10)")
    ap.add_argument("--json", default=str(DEFAULT_JSON))
    ap.add_argument("--print-only", action="store_true", help="print the tables of --json")
    a = ap.parse_args()
    path = Path(a.json)
    if a.print_only:
        print_tables(json.loads(path.read_text())["cells"])
        return
    from kvheat.replay import parse_tokens

    traces = [t for t in a.traces.split(",") if t] + (HELDOUT if a.heldout else [])
    caps = [parse_tokens(c) for c in a.capacities.split(",")]
    modes = a.modes.split(",")
    bad = [m for m in modes if m != "plain" and not (m.startswith("hold") and _num(m[4:]))]
    if bad:
        ap.error(f"unknown mode {', '.join(bad)} (plain, hold<time scale>)")
    policies = ABLATION_REFERENCE + ABLATION if a.ablation else split_policies(a.policies)
    for p in policies:  # a malformed variant or unknown option fails here, not in a worker
        try:
            spec = policy_spec(p)
            if callable(spec):
                spec()
        except (TypeError, ValueError) as e:
            ap.error(f"policy {p}: {e}")
    js = jobs(traces, caps, modes, policies, split_policies(a.hint_policies), a.only)
    print(f"{len(js)} replays, {a.jobs} worker(s)", flush=True)
    t0 = time.time()
    extra = {"block_tokens": BLOCK, "flag_points": FLAG_POINTS,
             "raw_draw": {"offset_s": RAW_DRAW.offset_s, "span_s": RAW_DRAW.span_s,
                          "seed": RAW_DRAW.seed, "copies": RAW_DRAW.copies,
                          "heldout_seeds": [1, 2, 3]}}
    rows = run_all(js, a.jobs, path, extra)
    if a.scale_check:
        extra |= scale_check([t for t in traces if t in TRACE_NAMES], a.jobs)
        print(f"scale check: moved {extra['scale_check']['moved'] or 'nothing'}")
    doc = merge(path, rows, extra)
    print(f"{len(rows)} replays in {time.time() - t0:.0f} s")
    print_tables(doc["cells"])
    print(f"wrote {path}")


def _num(s: str) -> bool:
    try:
        return float(s) > 0
    except ValueError:
        return False


if __name__ == "__main__":
    main()
