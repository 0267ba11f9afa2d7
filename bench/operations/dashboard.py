"""The SLO dashboard (deploy/grafana/kvheat-slo-dashboard.json) as a picture, from real data.

There is no Grafana here, so this renders the dashboard itself: a real `prometheus` (the
Debian package) loads deploy/prometheus/kvheat-slo-rules.yml and kvheat-slo-alerts.yml and
scrapes a live `kvheat serve` (in this process: the tiny built-in model on the CPU, a Redis
host tier) every second, while closed-loop clients send traffic; an overload is injected
partway (the overload of bench/operations/selfheal.py: 12 batch clients against
max_num_seqs=2, max_queued_requests=8) and removed. Then every panel's PromQL, exactly as
the dashboard JSON has it, is evaluated over the run with Prometheus' query_range API and
drawn with matplotlib, laid out by the panels' gridPos (24 columns; rows, stat panels as big
numbers, gauges with their thresholds, time series with their legends and units).

The latency thresholds are lowered in the loaded copy of the rules (`--ttft-threshold`,
`--e2e-threshold`; they must be bucket bounds): a tiny CPU model answers in tens of
milliseconds, far under the shipped 2.5 s and 30 s, so only lowered thresholds show what a
breach looks like; and the 30-day budget group is evaluated every 30 s instead of every 5
minutes, so a short run sees it. Everything else is the shipped rules.

Writes docs/results/operations/dashboard.png and dashboard.json (what was queried, when,
and each series' last, lowest and highest value; the alerts that fired).

    python bench/operations/dashboard.py                          # ~4 minutes
    python bench/operations/dashboard.py --healthy 20 --fault 20 --after 20
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

if not __package__:  # run as `python bench/operations/dashboard.py`: import from the repo root
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench._lib import ROOT
from bench._lib.procs import Redis, free_port, wait_until
from bench.operations.selfheal import Clients, Live
from kvheat.server.config import ServerConfig, TenantConfig
from kvheat.tiers import TierSpec

DASHBOARD = ROOT / "deploy/grafana/kvheat-slo-dashboard.json"
RULES = ROOT / "deploy/prometheus/kvheat-slo-rules.yml"
ALERTS = ROOT / "deploy/prometheus/kvheat-slo-alerts.yml"
OUT = ROOT / "docs/results/operations"
# The latency histograms' bucket bounds (kvheat/server/metrics.py), as the rules' `le` label.
BUCKETS = ("0.001", "0.0025", "0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1",
           "2.5", "5", "10", "30", "60")


# ---- Prometheus -------------------------------------------------------------------------
def rules_with_thresholds(ttft: str, e2e: str) -> str:
    """The shipped rules with the TTFT and end-to-end thresholds replaced (value and `le`),
    and the budget group evaluated every 30 s instead of 5 minutes."""
    text = RULES.read_text()
    for name, value in (("ttft_seconds", ttft), ("e2e_seconds", e2e)):
        pat = re.compile(rf"(record: kvheat:slo_target:{name}\n\s+expr: vector\()[^)]+"
                         rf"(\)\n\s+labels:\n\s+le: \")[^\"]+")
        text, n = pat.subn(rf"\g<1>{value}\g<2>{value}", text)
        if n != 1:
            raise SystemExit(f"{RULES}: kvheat:slo_target:{name} is not where it was")
    # The 30-day budget group evaluates every 5 minutes, at an offset Prometheus derives
    # from the file's path: a 4-minute run might see no evaluation at all. Every 30 s here.
    text, n = re.subn(r"(- name: kvheat-slo-budget\n\s+interval: )5m", r"\g<1>30s", text)
    if n != 1:
        raise SystemExit(f"{RULES}: the kvheat-slo-budget group's interval is not where it was")
    return text


class Prometheus:
    """A `prometheus` on loopback with a tempdir config, scraping `target` every second."""

    def __init__(self, workdir: Path, target: str, rules: str) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise SystemExit("prometheus is needed (apt-get install prometheus)")
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "slo-rules.yml").write_text(rules)
        shutil.copy(ALERTS, workdir / "slo-alerts.yml")
        (workdir / "prometheus.yml").write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "rule_files: [slo-rules.yml, slo-alerts.yml]\n"
            "scrape_configs:\n"
            "  - job_name: kvheat\n"
            f"    static_configs: [{{targets: ['{target}']}}]\n")
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "prometheus.log"
        self.proc = subprocess.Popen(
            [binary, f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=self.log.open("wb"))
        wait_until(self._ready, 60, "prometheus to get ready")
        self.version = httpx.get(self.base + "/api/v1/status/buildinfo").json()["data"]["version"]

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError("prometheus exited: " + self.log.read_text()[-2000:])
        try:
            return httpx.get(self.base + "/-/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def api(self, path: str, **params: Any) -> Any:
        out = httpx.get(self.base + "/api/v1/" + path, params=params, timeout=60).json()
        if out.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {out.get('errorType')}: {out.get('error')}")
        return out["data"]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


# ---- the run ------------------------------------------------------------------------------
def run(args: argparse.Namespace, prom_dir: Path) -> tuple[Prometheus, dict[str, float], Clients]:
    redis = Redis(prom_dir / "redis").start()
    tenants = [TenantConfig("live", ["sk-live-key"], priority=1),
               TenantConfig("batch", ["sk-batch-key"], priority=0)]
    live = Live(ServerConfig(num_blocks=96, threads=1, max_num_seqs=2, max_queued_requests=8,
                             max_tokens_limit=64, tenants=tenants,
                             tiers=TierSpec(redis_url=redis.url, redis_bytes=256 << 20,
                                            redis_shared=False)))
    prom = Prometheus(prom_dir, live.base.removeprefix("http://"),
                      rules_with_thresholds(args.ttft_threshold, args.e2e_threshold))
    try:
        wait_until(lambda: bool(prom.api("query", query="up{job='kvheat'} == 1")["result"]),
                   30, "the first scrape")
        rng = random.Random(args.seed)
        system = [rng.randrange(20, 600) for _ in range(48)]
        t: dict[str, float] = {"start": time.time()}
        clients = Clients(live, time.monotonic())
        clients.add(2, "live", lambda r: system + [r.randrange(20, 600) for _ in range(12)], 4,
                    "sk-live-key")
        time.sleep(args.healthy)
        t["fault"] = time.time()
        burst = clients.add(12, "batch", lambda r: [r.randrange(20, 600) for _ in range(32)], 16,
                            "sk-batch-key")
        time.sleep(args.fault)
        t["fault_removed"] = time.time()
        for s in burst:
            s.set()
        time.sleep(args.after)
        clients.stop()
        time.sleep(3)  # a last scrape and rule evaluation
        t["end"] = time.time()
        return prom, t, clients
    except BaseException:
        prom.close()
        raise
    finally:
        live.close()
        redis.kill()


def legend(fmt: str, labels: dict[str, str], expr: str) -> str:
    name = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip()
    return name or expr


def query_panels(prom: Prometheus, panels: list[dict[str, Any]], start: float, end: float,
                 step: float) -> list[dict[str, Any]]:
    """Each panel with its targets' series over [start, end]: [(legend, [t], [v])]."""
    out = []
    for p in panels:
        q: dict[str, Any] = {"panel": p, "targets": []}
        for tg in p.get("targets", []):
            data = prom.api("query_range", query=tg["expr"], start=f"{start:.3f}",
                            end=f"{end:.3f}", step=f"{step:g}s")
            series = [(legend(tg.get("legendFormat", ""), r["metric"], tg["expr"]),
                       [float(x) for x, _ in r["values"]], [float(v) for _, v in r["values"]])
                      for r in data["result"]]
            q["targets"].append({"expr": tg["expr"], "series": series})
        out.append(q)
    return out


# ---- drawing ------------------------------------------------------------------------------
BG, PANEL, TEXT, GRID, DIM = "#111217", "#181b1f", "#ccccdc", "#2c3235", "#8e8e9e"
PALETTE = ["#73bf69", "#f2cc0c", "#8ab8ff", "#ff780a", "#f2495c", "#5794f2", "#b877d9",
           "#705da0", "#37872d", "#fade2a"]
COLORS = {"green": "#73bf69", "orange": "#ff9830", "red": "#f2495c", "yellow": "#fade2a"}
ROW_IN, COL_UNITS = 0.36, 24  # one gridPos row (Grafana: 30 px), the grid's columns
Series = tuple[str, list[float], list[float]]  # legend, times, values


def fmt(v: float, unit: str | None, digits: int = 3) -> str:
    """A value in the panel's unit, as Grafana writes it (about `digits` significant)."""
    if not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("+Inf" if v > 0 else "-Inf")
    if unit == "percentunit":
        return f"{100 * v:.{digits}g}%"
    if unit == "s":
        return f"{1000 * v:.{digits}g} ms" if abs(v) < 1 else f"{v:.{digits}g} s"
    if unit == "reqps":
        return f"{v:.{digits}g} req/s"
    return f"{v:.{digits}g}"


def last_not_null(vs: list[float]) -> float | None:
    good = [v for v in vs if math.isfinite(v)]
    return good[-1] if good else (vs[-1] if vs else None)


def threshold_color(v: float, steps: list[dict[str, Any]]) -> str:
    color = steps[0]["color"]
    for s in steps[1:]:
        if s["value"] is not None and v >= s["value"]:
            color = s["color"]
    return COLORS.get(color, color)


def _gauge(ax: Any, v: float | None, unit: str | None, lo: float, hi: float,
           steps: list[dict[str, Any]]) -> None:
    """Grafana's gauge: a threshold band outside, the value's arc in its threshold color."""
    from matplotlib.patches import Wedge

    def angle(x: float) -> float:
        return 180.0 - 180.0 * (min(max(x, lo), hi) - lo) / (hi - lo)

    ax.set_xlim(-1.25, 1.25)
    ax.set_ylim(-0.25, 1.12)
    ax.set_aspect("equal", adjustable="box")
    ax.axis("off")
    bounds = [lo] + [s["value"] for s in steps[1:]] + [hi]
    for s, a, b in zip(steps, bounds, bounds[1:]):
        ax.add_patch(Wedge((0, 0), 1.05, angle(b), angle(a), width=0.07,
                           color=COLORS.get(s["color"], s["color"])))
    ax.add_patch(Wedge((0, 0), 0.95, 0, 180, width=0.28, color=GRID))
    color = DIM
    if v is not None and math.isfinite(v):
        color = threshold_color(v, steps)
        ax.add_patch(Wedge((0, 0), 0.95, angle(v), 180, width=0.28, color=color))
    ax.text(0, 0.1, "No data" if v is None else fmt(v, unit, 4), color=color, fontsize=20,
            weight="bold", ha="center", va="center")


def _timeseries(ax: Any, p: dict[str, Any], series: list[Series], unit: str | None,
                t: dict[str, float]) -> None:
    import matplotlib.dates as mdates
    from matplotlib.ticker import FuncFormatter, PercentFormatter

    def when(x: float) -> datetime:
        return datetime.fromtimestamp(x, timezone.utc)

    for i, (name, ts, vs) in enumerate(series):
        dashed = name in ("threshold", "target")  # Grafana: plain lines (no overrides)
        ax.plot([when(x) for x in ts], vs, lw=1.3, ls="--" if dashed else "-", label=name,
                color=COLORS["red"] if dashed else PALETTE[i % len(PALETTE)])
    for k, label in (("fault", "overload on"), ("fault_removed", "overload off")):
        ax.axvline(when(t[k]), color=DIM, lw=0.8, ls=":")
        ax.text(when(t[k]), 0.98, " " + label, color=DIM, fontsize=7.5, va="top",
                transform=ax.get_xaxis_transform())
    ax.set_xlim(when(t["start"]), when(t["end"]))
    ax.set_facecolor(PANEL)
    for s in ax.spines.values():
        s.set_visible(False)
    ax.grid(color=GRID, lw=0.6)
    ax.tick_params(colors=DIM, labelsize=8, length=0)
    ax.xaxis.set_major_locator(mdates.AutoDateLocator())
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S", tz=timezone.utc))
    if unit == "percentunit":
        ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
    elif unit in ("s", "reqps"):
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: fmt(v, unit)))
    table = p.get("options", {}).get("legend", {}).get("displayMode") == "table"
    ax.legend(loc="upper left", bbox_to_anchor=(0.0, -0.13), fontsize=8, frameon=False,
              ncol=8 if table else 4, labelcolor=TEXT, handlelength=1.6, columnspacing=1.2,
              borderaxespad=0.0)


def draw(queried: list[dict[str, Any]], title: str, t: dict[str, float], path: Path,
         note: str) -> None:
    """The panels at their gridPos (24 columns, rows of ROW_IN inches), Grafana-dark."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = max(q["panel"]["gridPos"]["y"] + q["panel"]["gridPos"]["h"] for q in queried)
    width_in, head_in = 22.0, 1.0
    height_in = rows * ROW_IN + head_in
    fig = plt.figure(figsize=(width_in, height_in), facecolor=BG)

    def frac(x_in: float, top_in: float, w_in: float,
             h_in: float) -> tuple[float, float, float, float]:
        return (x_in / width_in, 1 - (top_in + h_in) / height_in, w_in / width_in,
                h_in / height_in)

    fig.text(0.006, 1 - 0.3 / height_in, title, color=TEXT, fontsize=17, va="center")
    fig.text(0.006, 1 - 0.72 / height_in, note, color=DIM, fontsize=9.5, va="center",
             wrap=True)
    col_in, pad = width_in / COL_UNITS, 0.05
    for q in queried:
        p, gp = q["panel"], q["panel"]["gridPos"]
        defaults = p.get("fieldConfig", {}).get("defaults", {})
        unit = defaults.get("unit")
        x, top = gp["x"] * col_in + pad, head_in + gp["y"] * ROW_IN + pad
        w, h = gp["w"] * col_in - 2 * pad, gp["h"] * ROW_IN - 2 * pad
        if p["type"] == "row":
            fig.text(x / width_in, 1 - (top + h / 2) / height_in, p["title"], color=TEXT,
                     fontsize=12.5, weight="bold", va="center")
            continue
        frame = fig.add_axes(frac(x, top, w, h))
        frame.set_facecolor(PANEL)
        frame.set_xticks([])
        frame.set_yticks([])
        for s in frame.spines.values():
            s.set_color(GRID)
        frame.text(0.08 / w, 1 - 0.17 / h, p["title"], color=TEXT, fontsize=10, va="center",
                   transform=frame.transAxes)
        series = [s for tg in q["targets"] for s in tg["series"]]
        if not series:
            frame.text(0.5, 0.45, "No data", color=DIM, fontsize=14, ha="center", va="center",
                       transform=frame.transAxes)
            continue
        if p["type"] == "stat":  # textMode value_and_name: a name and a big number each
            for i, (name, _ts, vs) in enumerate(series):
                v = last_not_null(vs)
                cx = (i + 0.5) / len(series)
                frame.text(cx, 0.66, name, color=TEXT, fontsize=10, ha="center", va="center",
                           transform=frame.transAxes)
                frame.text(cx, 0.32, "No data" if v is None else fmt(v, unit, 4),
                           color=COLORS["green"], fontsize=24, weight="bold", ha="center",
                           va="center", transform=frame.transAxes)
        elif p["type"] == "gauge":
            opts = p.get("options", {})
            steps = defaults.get("thresholds", {}).get("steps", [{"color": "green",
                                                                  "value": None}])
            _gauge(fig.add_axes(frac(x + 0.1, top + 0.35, w - 0.2, h - 0.45)),
                   last_not_null(series[0][2]), unit, opts.get("min", 0.0),
                   opts.get("max", 1.0), steps)
        else:
            _timeseries(fig.add_axes(frac(x + 0.75, top + 0.35, w - 0.9, h - 0.35 - 0.6)),
                        p, series, unit, t)
    fig.savefig(path, dpi=80, facecolor=BG)
    plt.close(fig)


# ---- the record ------------------------------------------------------------------------------
def summary(queried: list[dict[str, Any]]) -> list[dict[str, Any]]:
    def finite(vs: list[float]) -> list[float]:
        return [v for v in vs if math.isfinite(v)]

    def val(x: float | None) -> float | str | None:
        return x if x is None or math.isfinite(x) else str(x)

    out = []
    for q in queried:
        p = q["panel"]
        if p["type"] == "row":
            continue
        out.append({"title": p["title"], "type": p["type"], "gridPos": p["gridPos"],
                    "targets": [{"expr": tg["expr"],
                                 "series": [{"legend": name, "points": len(vs),
                                             "last": val(last_not_null(vs)),
                                             "min": val(min(finite(vs), default=None)),
                                             "max": val(max(finite(vs), default=None))}
                                            for name, ts, vs in tg["series"]]}
                                for tg in q["targets"]]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--healthy", type=float, default=70.0, help="seconds before the overload")
    ap.add_argument("--fault", type=float, default=70.0, help="seconds of overload")
    ap.add_argument("--after", type=float, default=90.0, help="seconds after it")
    ap.add_argument("--step", type=float, default=2.0, help="query_range step, seconds")
    ap.add_argument("--ttft-threshold", choices=BUCKETS, default="0.25")
    ap.add_argument("--e2e-threshold", choices=BUCKETS, default="1")
    ap.add_argument("--seed", type=int, default=41)
    ap.add_argument("--out", type=Path, default=OUT / "dashboard.png")
    args = ap.parse_args()

    dashboard = json.loads(DASHBOARD.read_text())
    workdir = Path(tempfile.mkdtemp(prefix="kvheat-dashboard-"))
    try:
        prom, t, clients = run(args, workdir)
        try:
            queried = query_panels(prom, dashboard["panels"], t["start"], t["end"], args.step)
            fired = prom.api("query_range", query='ALERTS{alertstate="firing"}',
                             start=f"{t['start']:.3f}", end=f"{t['end']:.3f}", step="1s")
            version = prom.version
        finally:
            prom.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    def iso(x: float) -> str:
        return datetime.fromtimestamp(x, timezone.utc).isoformat(timespec="seconds")

    rel = {k: round(v - t["start"], 1) for k, v in t.items()}
    note = (f"Prometheus {version}, real scrapes of a live kvheat serve every 1 s, rules of "
            f"deploy/prometheus/kvheat-slo-rules.yml (TTFT threshold {args.ttft_threshold} s, "
            f"E2E {args.e2e_threshold} s, lowered for a tiny CPU model; 30-day budgets "
            "evaluated every 30 s, not 5 min). Overload "
            f"(12 batch clients) from +{rel['fault']:g} s to +{rel['fault_removed']:g} s of a "
            f"{rel['end']:g} s run; times UTC. Drawn by bench/operations/dashboard.py "
            "(matplotlib), not Grafana.")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    draw(queried, dashboard["title"], t, args.out, note)
    served = [r for r in clients.records if r[2] == 200]
    record = {
        "dashboard": str(DASHBOARD.relative_to(ROOT)),
        "rules": [str(RULES.relative_to(ROOT)), str(ALERTS.relative_to(ROOT))],
        "prometheus_version": version, "scrape_interval_s": 1, "evaluation_interval_s": 1,
        "thresholds_s": {"ttft": float(args.ttft_threshold), "e2e": float(args.e2e_threshold)},
        "range": {"start": iso(t["start"]), "end": iso(t["end"]), "step_s": args.step},
        "phases_s": rel,
        "fault": "overload: 12 batch clients (16 tokens) on top of 2 live clients (4 tokens), "
                 "max_num_seqs=2, max_queued_requests=8",
        "client_requests": {"served": len(served),
                            "refused": len(clients.records) - len(served)},
        "alerts_fired": sorted({r["metric"].get("alertname", "") + " " +
                                r["metric"].get("severity", "") for r in fired["result"]}),
        "panels": summary(queried),
    }
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out} and {args.out.with_suffix('.json')}")
    print(json.dumps({k: record[k] for k in ("range", "phases_s", "client_requests",
                                             "alerts_fired")}, indent=1))


if __name__ == "__main__":
    main()
