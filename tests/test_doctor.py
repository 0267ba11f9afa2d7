"""`kvheat doctor`: each cause ranks first on a synthetic /metrics pair that shows it, a
healthy pair yields nothing, bad answers give one clear error, and against a real
`kvheat serve` a healthy run finds nothing while an overloaded one finds overload first."""

from __future__ import annotations

import asyncio
import gc
import http.server
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry
from test_server import MODEL, SYSTEM, start, stop

from kvheat.cli import main
from kvheat.doctor import CAUSES, DoctorError, Snapshot, diagnose, parse_metrics, scrape
from kvheat.doctor.cli import run_doctor
from kvheat.server.config import ServerConfig
from kvheat.server.metrics import STALL_BUCKETS, StallWatch

ARM = 'arm="a"'


def _healthy() -> tuple[dict[str, float], dict[str, float]]:
    """Two scrapes of a server serving 100 requests in the window, mostly hits."""
    a = {
        f'kvheat_requests_total{{{ARM},tenant="none",endpoint="chat",finish_reason="stop"}}': 100,
        f'kvheat_prompt_tokens_total{{{ARM},tenant="none"}}': 10000,
        f'kvheat_cached_tokens_total{{{ARM},tenant="none"}}': 6000,
        f'kvheat_generation_tokens_total{{{ARM},tenant="none"}}': 3000,
        f'kvheat_prefix_miss_tokens_total{{{ARM},tenant="none",kind="compulsory"}}': 3500,
        f'kvheat_prefix_miss_tokens_total{{{ARM},tenant="none",kind="capacity"}}': 300,
        f'kvheat_prefix_miss_tokens_total{{{ARM},tenant="none",kind="sub_block"}}': 200,
        f'kvheat_evictions_total{{{ARM},tier="device"}}': 50,
        f'kvheat_blocks{{{ARM},tier="device",state="used"}}': 10,
        f'kvheat_blocks{{{ARM},tier="device",state="free"}}': 100,
        f'kvheat_blocks{{{ARM},tier="device",state="cached"}}': 402,
        f'kvheat_queue_length{{{ARM},queue="waiting"}}': 0,
        f'kvheat_queue_length{{{ARM},queue="running"}}': 2,
        f'kvheat_time_to_first_token_seconds_sum{{{ARM},tenant="none"}}': 5.0,
        f'kvheat_time_to_first_token_seconds_count{{{ARM},tenant="none"}}': 100,
        f'kvheat_preemptions_total{{{ARM},tenant="none"}}': 0,
        'kvheat_rejected_requests_total{status="401"}': 1,
        f'kvheat_tier_up{{{ARM},tier="host"}}': 1,
        f'kvheat_tier_writable{{{ARM},tier="host"}}': 1,
        f'kvheat_load_decisions_total{{{ARM},decision="load"}}': 50,
        f'kvheat_load_decisions_total{{{ARM},decision="recompute"}}': 5,
        'kvheat_net_peer_retransmitted_segments{peer="10.0.0.2",role="client",source="sock_diag"}': 0,
        'kvheat_net_peer_bytes{peer="10.0.0.2",role="client",source="sock_diag"}': 1e6,
        'kvheat_net_peer_rtt_seconds{peer="10.0.0.2",role="client",source="sock_diag"}': 0.0002,
    }
    b = dict(a)
    for k in list(b):
        grows = any(x in k for x in ("_total", "_sum", "_count", "net_peer_bytes"))
        if grows and "rejected" not in k and "preemptions" not in k:
            b[k] = 2 * a[k]
    b[f'kvheat_queue_length{{{ARM},queue="running"}}'] = 3
    return a, b


def _text(d: dict[str, float]) -> bytes:
    return "".join(f"{k} {v}\n" for k, v in d.items()).encode()


def _snap(a: dict[str, float], b: dict[str, float], **kw: object) -> Snapshot:
    return Snapshot(parse_metrics(_text(a)), parse_metrics(_text(b)), 10.0, **kw)  # type: ignore[arg-type]


def _top(a: dict[str, float], b: dict[str, float], **kw: object) -> str:
    found = diagnose(_snap(a, b, **kw))
    assert found, "no finding"
    return found[0].cause


def test_healthy_text_has_no_findings() -> None:
    a, b = _healthy()
    assert diagnose(_snap(a, b)) == []
    assert diagnose(_snap(a, a)) == []  # idle: nothing moved
    assert diagnose(_snap(b, b)) == []


def test_capacity() -> None:
    a, b = _healthy()
    b[f'kvheat_prefix_miss_tokens_total{{{ARM},tenant="none",kind="capacity"}}'] = 300 + 5000
    b[f'kvheat_prefix_miss_tokens_total{{{ARM},tenant="none",kind="compulsory"}}'] = 3500 + 500
    b[f'kvheat_evictions_total{{{ARM},tier="device"}}'] = 400
    b[f'kvheat_blocks{{{ARM},tier="device",state="free"}}'] = 0
    found = diagnose(_snap(a, b, admin_b={"arms": {"a": {"block_size": 16}}}))
    assert found[0].cause == "capacity"
    assert "about 313 more blocks of 16 tokens" in found[0].action  # ceil(5000 / 16)
    assert found[0].evidence["kvheat_prefix_miss_tokens_total{kind=capacity} Δ"] == 5000
    assert "5000 more tokens" in diagnose(_snap(a, b))[0].action  # no admin: tokens


def test_tenant_quota() -> None:
    a, b = _healthy()
    a[f'kvheat_preemptions_total{{{ARM},tenant="acme"}}'] = 0
    b[f'kvheat_preemptions_total{{{ARM},tenant="acme"}}'] = 30
    b[f'kvheat_preemptions_total{{{ARM},tenant="globex"}}'] = 2
    assert _top(a, b) == "tenant_quota"
    # Preemptions without tenants are the pool's, not a quota's.
    b2 = dict(b)
    del b2[f'kvheat_preemptions_total{{{ARM},tenant="acme"}}']
    del b2[f'kvheat_preemptions_total{{{ARM},tenant="globex"}}']
    b2[f'kvheat_preemptions_total{{{ARM},tenant="none"}}'] = 30
    assert all(f.cause != "tenant_quota" for f in diagnose(_snap(a, b2)))


def test_entropy_drift_from_admin_stats() -> None:
    a, b = _healthy()
    adm_a = {"arms": {"heat": {"regime": {"mode": "lru", "entropy_bits": 2.0}}}}
    adm_b = {"arms": {"heat": {"regime": {"mode": "lfu", "entropy_bits": 5.0}}}}
    # A regime flip with the hit rate steady (a young server settling) is no cause.
    assert diagnose(_snap(a, b, admin_a=adm_a, admin_b=adm_b)) == []
    b[f'kvheat_cached_tokens_total{{{ARM},tenant="none"}}'] = 6000 + 2000  # 60% -> 20%
    b[f'kvheat_prefix_miss_tokens_total{{{ARM},tenant="none",kind="compulsory"}}'] = 3500 + 7500
    assert _top(a, b, admin_a=adm_a, admin_b=adm_b) == "entropy_drift"
    assert diagnose(_snap(a, b, admin_a=adm_a, admin_b=adm_a)) == []  # steady regime


def test_tier_fault() -> None:
    a, b = _healthy()
    b[f'kvheat_tier_up{{{ARM},tier="host"}}'] = 0
    b[f'kvheat_tier_faults_total{{{ARM},tier="host",kind="went_down"}}'] = 1
    assert _top(a, b) == "tier_fault"
    a2, b2 = _healthy()
    a2[f'kvheat_tier_load_faults_total{{{ARM},kind="load_failed"}}'] = 0
    b2[f'kvheat_tier_load_faults_total{{{ARM},kind="load_failed"}}'] = 40
    assert _top(a2, b2) == "tier_fault"


def test_tier_slow() -> None:
    a, b = _healthy()
    b[f'kvheat_load_decisions_total{{{ARM},decision="load"}}'] = 55
    b[f'kvheat_load_decisions_total{{{ARM},decision="recompute"}}'] = 5 + 150
    assert _top(a, b) == "tier_slow"


def test_network() -> None:
    a, b = _healthy()
    b['kvheat_net_peer_retransmitted_segments{peer="10.0.0.2",role="client",source="sock_diag"}'] = 200
    assert _top(a, b) == "network"
    a3, b3 = _healthy()  # loopback loses nothing: its retransmits are early timers
    for s in (a3, b3):
        for k in [k for k in s if "10.0.0.2" in k]:
            s[k.replace("10.0.0.2", "127.0.0.1")] = s.pop(k)
    b3['kvheat_net_peer_retransmitted_segments{peer="127.0.0.1",role="client",source="sock_diag"}'] = 200
    assert diagnose(_snap(a3, b3)) == []
    a2, b2 = _healthy()
    b2['kvheat_net_peer_rtt_seconds{peer="10.0.0.2",role="client",source="sock_diag"}'] = 0.05
    assert diagnose(_snap(a2, b2)) == []  # a client's RTT holds its delayed ACKs: no cause
    b2['kvheat_net_peer_rtt_seconds{peer="10.0.0.9",role="redis",source="sock_diag"}'] = 0.05
    assert _top(a2, b2) == "network"  # an upstream's RTT as long as the mean TTFT


def test_overload() -> None:
    a, b = _healthy()
    a['kvheat_rejected_requests_total{status="503"}'] = 0
    b['kvheat_rejected_requests_total{status="503"}'] = 100
    for s in (a, b):
        s[f'kvheat_queue_length{{{ARM},queue="waiting"}}'] = 40
        s[f'kvheat_queue_length{{{ARM},queue="running"}}'] = 8
    assert _top(a, b) == "overload"
    a2, b2 = _healthy()  # a queue seen at one scrape only is a burst, not overload
    b2[f'kvheat_queue_length{{{ARM},queue="waiting"}}'] = 40
    assert diagnose(_snap(a2, b2)) == []


def test_long_prompts() -> None:
    a, b = _healthy()
    b[f'kvheat_prompt_tokens_total{{{ARM},tenant="none"}}'] = 10000 + 40000
    b[f'kvheat_prefix_miss_tokens_total{{{ARM},tenant="none",kind="compulsory"}}'] = 3500 + 33000
    assert _top(a, b) == "long_prompts"
    a2, b2 = _healthy()
    b2['kvheat_rejected_requests_total{status="400"}'] = 30
    assert _top(a2, b2) == "long_prompts"


def _pauses(at: dict[float, int]) -> dict[str, float]:
    """A pause histogram's series (event-loop lag) with `at[bound]` pauses in each bucket."""
    out, acc, total = {}, 0, 0.0
    for bound in (*STALL_BUCKETS, float("inf")):
        acc += at.get(bound, 0)
        total += at.get(bound, 0) * (bound if bound != float("inf") else 10.0)
        le = "+Inf" if bound == float("inf") else str(bound)
        out[f'kvheat_event_loop_lag_seconds_bucket{{le="{le}"}}'] = acc
    out["kvheat_event_loop_lag_seconds_count"] = acc
    out["kvheat_event_loop_lag_seconds_sum"] = total
    return out


def test_stall_from_event_loop_lag() -> None:
    a, b = _healthy()
    a.update(_pauses({0.001: 200}))
    b.update(_pauses({0.001: 380, 0.05: 15}))  # lags under 0.1 s: scheduling noise
    assert diagnose(_snap(a, b)) == []
    b.update(_pauses({0.001: 380, 0.25: 1}))  # one long pause is not a cause
    assert diagnose(_snap(a, b)) == []
    b.update(_pauses({0.001: 380, 0.25: 5}))  # five 0.1-0.25 s pauses in 10 s
    found = diagnose(_snap(a, b))
    assert found[0].cause == "stall" and found[0].score >= 0.9
    assert "event loop is blocked" in found[0].action
    assert found[0].evidence["kvheat_event_loop_lag_seconds >= 0.1 s, count Δ"] == 5


def test_every_cause_scores_in_unit_range() -> None:
    a, b = _healthy()
    for c in CAUSES:
        f = c(_snap(a, b))
        assert 0.0 <= f.score <= 1.0, f.cause


# ---- bad answers ------------------------------------------------------------------------
@pytest.fixture()
def bad_http() -> Iterator[tuple[str, dict[str, bytes]]]:
    bodies: dict[str, bytes] = {}

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            body = bodies.get(self.path)
            if body is None:
                self.send_response(401 if self.path == "/secret" else 404)
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    class Quiet(http.server.ThreadingHTTPServer):
        def handle_error(self, request: object, client_address: object) -> None:
            pass  # the doctor hangs up after max_bytes + 1: a broken pipe, not news

    srv = Quiet(("127.0.0.1", 0), H)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", bodies
    srv.shutdown()
    srv.server_close()


def test_malformed_and_oversized_answers_give_one_clear_error(
        bad_http: tuple[str, dict[str, bytes]]) -> None:
    base, bodies = bad_http
    bodies["/html"] = b"<html><body>login</body></html>"
    bodies["/other"] = b"python_gc_objects_collected_total 3\n"
    bodies["/big"] = b"kvheat_x 1\n" + b"#" * (2 * 1024 * 1024)
    bodies["/binary"] = b"\xff\xfe\x00garbage"
    with pytest.raises(DoctorError, match="not Prometheus text format"):
        scrape(base + "/html")
    with pytest.raises(DoctorError, match="no kvheat_ series"):
        scrape(base + "/other")
    with pytest.raises(DoctorError, match="larger than 1048576 bytes"):
        scrape(base + "/big", max_bytes=1024 * 1024)
    with pytest.raises(DoctorError, match="not Prometheus text format"):
        scrape(base + "/binary")
    with pytest.raises(DoctorError, match="HTTP 401.*token"):
        scrape(base + "/secret")
    for path, why in (("/html", "not Prometheus"), ("/big", "larger than 1024"),
                      ("/missing", "HTTP 404")):
        r = CliRunner().invoke(main, ["doctor", base + path, "--window", "0.1",
                                      "--max-bytes", "1024"])
        assert r.exit_code == 2, r.output
        lines = [ln for ln in r.output.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("kvheat doctor: error:") and why in lines[0]
    r = CliRunner().invoke(main, ["doctor", "http://127.0.0.1:1/metrics", "--window", "0.1"])
    assert r.exit_code == 2 and "cannot read it" in r.output


# ---- end to end, against a real `kvheat serve` ------------------------------------------
def _complete(base: str, prompt: str, max_tokens: int) -> str:
    c = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
    try:
        c.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
        return "ok"
    except openai.APIStatusError as e:
        return str(e.status_code)


def test_e2e_healthy_server_has_no_findings() -> None:
    s = start(ServerConfig(num_blocks=192, threads=1, max_num_seqs=8, max_tokens_limit=32,
                           admin_token="adm"))
    try:
        url = s.base + "/metrics"
        _complete(s.base, SYSTEM + " Warm up.", 4)
        s.wait_idle()
        a = scrape(url)
        for i in range(6):
            assert _complete(s.base, SYSTEM + f" Question {i}?", 4) == "ok"
        s.wait_idle()
        s.wait_metric("kvheat_requests_total", 7)
        b = scrape(url)
        assert diagnose(Snapshot(a, b, 1.0)) == []
        # The command, with /admin/stats, JSON out: empty findings, exit 0.
        r = CliRunner().invoke(main, ["doctor", url, "--window", "0.3", "--json",
                                      "--admin-url", s.base + "/admin/stats",
                                      "--admin-token", "adm", "--fail-on-findings"])
        assert r.exit_code == 0, r.output
        assert json.loads(r.output) == {"findings": []}
        r = CliRunner().invoke(main, ["doctor", url, "--window", "0.1"])
        assert r.exit_code == 0 and r.output.startswith("healthy")
    finally:
        stop(s)


def test_e2e_overload_ranks_first() -> None:
    s = start(ServerConfig(num_blocks=192, threads=1, max_num_seqs=1, max_queued_requests=2,
                           max_tokens_limit=32))
    try:
        url = s.base + "/metrics"
        a = scrape(url)
        with ThreadPoolExecutor(16) as pool:
            outcomes = list(pool.map(lambda i: _complete(s.base, SYSTEM + f" Q{i}", 24),
                                     range(32)))
        assert outcomes.count("503") > 0 and outcomes.count("ok") > 0
        s.wait_idle()
        b = scrape(url)
        found = diagnose(Snapshot(a, b, 1.0))
        assert found and found[0].cause == "overload", [(f.cause, f.score) for f in found]
        # The table names it (rich, nothing cut) and --fail-on-findings exits 1.
        res: dict[str, object] = {}

        def load() -> None:
            with ThreadPoolExecutor(16) as pool:
                res["out"] = list(pool.map(lambda i: _complete(s.base, SYSTEM + f" R{i}", 24),
                                           range(48)))

        th = threading.Thread(target=load)
        th.start()
        try:
            got = run_doctor(url, 1.0)
        finally:
            th.join()
        assert got and got[0].cause == "overload"
    finally:
        stop(s)


def test_e2e_event_loop_stall_ranks_first() -> None:
    """A real stall: a handler (added here, for the test) that blocks the event loop for
    0.25 s, called while ordinary requests are served; the doctor ranks `stall` first."""
    s = start(ServerConfig(num_blocks=192, threads=1, max_num_seqs=8, max_tokens_limit=32))

    async def blocking() -> dict[str, str]:
        time.sleep(0.25)  # sync work on the loop: every request on it waits
        return {"ok": "blocked"}

    s.server.app.add_api_route("/test-block", blocking, methods=["POST"])
    try:
        url = s.base + "/metrics"
        _complete(s.base, SYSTEM + " Warm up.", 4)
        s.wait_idle()
        a = scrape(url)
        t0 = time.monotonic()
        with ThreadPoolExecutor(3) as pool:
            jobs = [pool.submit(_complete, s.base, SYSTEM + f" Q{i}", 4) for i in range(6)]
            for _ in range(6):
                httpx.post(s.base + "/test-block", timeout=10)
                time.sleep(0.1)
            assert all(j.result() == "ok" for j in jobs)
        s.wait_idle()
        time.sleep(0.2)  # the watcher's next wake records the last pause
        b = scrape(url)
        found = diagnose(Snapshot(a, b, time.monotonic() - t0))
        assert found and found[0].cause == "stall", [(f.cause, f.score) for f in found]
        assert found[0].evidence["kvheat_event_loop_lag_seconds >= 0.1 s, count Δ"] >= 5
    finally:
        stop(s)


def test_stall_watch_series_and_containment() -> None:
    """The watcher records a real blocking call on its loop and a real full collection,
    and takes itself out of gc.callbacks when stopped."""
    reg = CollectorRegistry()
    watch = StallWatch(reg)

    async def run() -> None:
        watch.start()
        await asyncio.sleep(0.06)
        time.sleep(0.15)  # blocks the loop: the watcher wakes ~0.1-0.15 s late
        await asyncio.sleep(0.12)
        gc.collect()  # a real generation-2 collection

    try:
        asyncio.run(run())
    finally:
        watch.stop()
    assert watch._on_gc not in gc.callbacks
    late = reg.get_sample_value("kvheat_event_loop_lag_seconds_count") or 0
    fast = reg.get_sample_value("kvheat_event_loop_lag_seconds_bucket", {"le": "0.05"}) or 0
    assert late - fast >= 1  # one wake 50 ms or more late
    assert (reg.get_sample_value("kvheat_gc_pause_seconds_count", {"generation": "2"}) or 0) >= 1
    watch._on_gc("stop", {})  # a stop without a start (hooked mid-collection): ignored
    watch._on_gc("start", {"generation": "x"})
    watch._on_gc("stop", {"generation": "x"})  # a bad payload: counted, never raised
    assert watch.errors == 1
