"""`kvheat doctor` against hostile endpoints, real local HTTP servers each: NaN, ±Inf and
overflowing values (from /metrics, /admin/stats and a Prometheus answer), a server that
drips its answer a byte at a time, a base URL without /metrics, and a 404. Every unusable
answer is one `error:` line and exit 2 (never a traceback, never exit 1: that is the
"findings" code); a legal NaN is "no data"; every fetch ends by its --timeout."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from click.testing import CliRunner, Result

from kvheat.cli import main
from kvheat.doctor import DoctorError, scrape

# A /metrics body a server with capacity trouble could give, with `{v}` put in some series.
GOOD_A = ('kvheat_requests_total{tenant="none"} 100\n'
          'kvheat_prompt_tokens_total{tenant="none"} 10000\n'
          'kvheat_cached_tokens_total{tenant="none"} 6000\n')
GOOD_B = ('kvheat_requests_total{tenant="none"} 200\n'
          'kvheat_prompt_tokens_total{tenant="none"} 20000\n'
          'kvheat_cached_tokens_total{tenant="none"} 12000\n')


def _miss(capacity: str, compulsory: str = "100") -> str:
    return (f'kvheat_prefix_miss_tokens_total{{kind="capacity"}} {capacity}\n'
            f'kvheat_prefix_miss_tokens_total{{kind="compulsory"}} {compulsory}\n'
            'kvheat_evictions_total{tier="device"} 50\n')


Handler = Callable[[http.server.BaseHTTPRequestHandler], None]


class Server:
    """A ThreadingHTTPServer on a free loopback port; each path answers with its list of
    handlers in turn (the last one repeats), and the paths asked are recorded."""

    def __init__(self) -> None:
        self.routes: dict[str, list[Handler]] = {}
        self.asked: list[str] = []
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                path = self.path.split("?")[0]
                outer.asked.append(path)
                hs = outer.routes.get(path)
                if not hs:
                    self.send_error(404)
                    return
                (hs.pop(0) if len(hs) > 1 else hs[0])(self)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def route(self, path: str, *handlers: Handler) -> None:
        self.routes[path] = list(handlers)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def body(text: str, ctype: str = "text/plain; version=0.0.4") -> Handler:
    def h(req: http.server.BaseHTTPRequestHandler) -> None:
        data = text.encode()
        req.send_response(200)
        req.send_header("Content-Type", ctype)
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        req.wfile.write(data)
    return h


def drip(text: str, every_s: float = 1.0, in_headers: bool = False) -> Handler:
    """Each byte `every_s` apart (each read is quick, the whole is not), for at most 30 s."""
    def h(req: http.server.BaseHTTPRequestHandler) -> None:
        data = text.encode()
        head = (f"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\nContent-Length: "
                f"{len(data)}\r\n\r\n").encode()
        slow, fast = (head + data, b"") if in_headers else (data, head)
        try:
            req.wfile.write(fast)
            req.wfile.flush()
            for i in range(min(len(slow), 30)):
                req.wfile.write(slow[i:i + 1])
                req.wfile.flush()
                time.sleep(every_s)
        except OSError:
            pass  # the doctor hung up: what it should do
        req.close_connection = True
    return h


@pytest.fixture
def srv() -> Iterator[Server]:
    s = Server()
    yield s
    s.close()


def doctor(*args: str) -> Result:
    return CliRunner().invoke(main, ["doctor", *args])


def assert_error_line(r: Result, *needles: str) -> str:
    """Exit 2, one `kvheat doctor: error:` line on stderr naming each needle, no traceback."""
    assert r.exit_code == 2, (r.exit_code, r.output, r.exception)
    assert isinstance(r.exception, SystemExit)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvheat doctor: error: "), r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


# ---- numbers from /metrics ------------------------------------------------------------
@pytest.mark.parametrize("bad", ["+Inf", "-Inf", "1e999", "-1e400", "1e300"])
def test_infinite_or_huge_metric_is_one_error_line(srv: Server, bad: str) -> None:
    srv.route("/metrics", body(GOOD_A + _miss("300")), body(GOOD_B + _miss(bad)))
    line = assert_error_line(doctor(srv.url + "/metrics", "--window", "0.1"),
                             "kvheat_prefix_miss_tokens_total", "not a finite value")
    assert srv.url in line


def test_nan_metric_is_no_data_not_a_crash(srv: Server) -> None:
    # NaN is legal Prometheus text. Today's code crashed on it (int(NaN) in `capacity`)
    # with a traceback and exit 1, which reads as "findings".
    srv.route("/metrics", body(GOOD_A + _miss("NaN")), body(GOOD_B + _miss("NaN")))
    r = doctor(srv.url + "/metrics", "--window", "0.1", "--json")
    assert r.exit_code == 0, (r.output, r.exception)
    assert json.loads(r.stdout) == {"findings": []}


def test_nan_at_one_end_leaves_the_series_out(srv: Server) -> None:
    # Unknown at the start: the counter's increase is unknown, not its whole value (5000
    # capacity-miss tokens counted from zero would be a false `capacity` finding).
    srv.route("/metrics", body(GOOD_A + _miss("NaN", "NaN")), body(GOOD_B + _miss("5000", "5100")))
    r = doctor(srv.url + "/metrics", "--window", "0.1", "--json")
    assert r.exit_code == 0, (r.output, r.exception)
    assert json.loads(r.stdout) == {"findings": []}
    # The same counters with a known start are a finding: the NaN is what hid it.
    srv.route("/metrics", body(GOOD_A + _miss("0", "0")), body(GOOD_B + _miss("5000", "100")))
    r = doctor(srv.url + "/metrics", "--window", "0.1", "--json")
    assert [f["cause"] for f in json.loads(r.stdout)["findings"]][:1] == ["capacity"]


def test_nan_in_the_real_cli_prints_no_traceback(srv: Server) -> None:
    srv.route("/metrics", body(GOOD_A + _miss("1e999")))
    r = subprocess.run([sys.executable, "-m", "kvheat.cli", "doctor", srv.url + "/metrics",
                        "--window", "0.1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert "error:" in r.stderr


def test_admin_stats_with_nan_or_infinity_is_one_error_line(srv: Server) -> None:
    srv.route("/metrics", body(GOOD_A + _miss("300")), body(GOOD_B + _miss("5000")))
    for bad in ("NaN", "Infinity", "1e999", "1" + "0" * 40):
        srv.route("/admin/stats", body('{"arms": {"a": {"block_size": ' + bad + '}}}',
                                       "application/json"))
        assert_error_line(doctor(srv.url + "/metrics", "--window", "0.1", "--admin-url",
                                 srv.url + "/admin/stats"), "/admin/stats")


def test_admin_stats_of_the_wrong_shape_is_ignored_not_fatal(srv: Server) -> None:
    srv.route("/metrics", body(GOOD_A + _miss("0", "0")), body(GOOD_B + _miss("5000", "100")))
    srv.route("/admin/stats", body(json.dumps({"arms": {"a": {
        "block_size": "sixteen", "tenants": ["x"], "regime": "lru"}}}), "application/json"))
    r = doctor(srv.url + "/metrics", "--window", "0.1", "--admin-url", srv.url + "/admin/stats",
               "--json")
    assert r.exit_code == 0, (r.output, r.exception)
    found = json.loads(r.stdout)["findings"]
    assert found[0]["cause"] == "capacity" and "5000 more tokens" in found[0]["action"]


def test_a_histogram_bucket_that_is_no_number_is_skipped(srv: Server) -> None:
    hist = ('kvheat_event_loop_lag_seconds_bucket{le="0.5"} %d\n'
            'kvheat_event_loop_lag_seconds_bucket{le="soon"} %d\n'
            'kvheat_event_loop_lag_seconds_bucket{le="+Inf"} %d\n')
    srv.route("/metrics", body(GOOD_A + hist % (0, 0, 0)), body(GOOD_B + hist % (0, 9, 9)))
    r = doctor(srv.url + "/metrics", "--window", "0.1", "--json")
    assert r.exit_code == 0, (r.output, r.exception)
    assert isinstance(json.loads(r.stdout)["findings"], list)


# ---- numbers from Prometheus ------------------------------------------------------------
def _prom_answer(values: dict[str, str]) -> str:
    return json.dumps({"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {"__name__": n, "instance": "a:8000", **({"kind": "capacity"}
                                                             if "miss" in n else {})},
         "value": [1796526000.0, v]} for n, v in values.items()]}})


PROM_OK = {"kvheat_requests_total": "100", "kvheat_prompt_tokens_total": "10000",
           "kvheat_cached_tokens_total": "6000"}


def test_prometheus_nan_is_no_data(srv: Server) -> None:
    # A rate over an empty window is NaN in a Prometheus answer: legal, no data.
    srv.route("/api/v1/query", body(_prom_answer(
        {**PROM_OK, "kvheat_prefix_miss_tokens_total": "NaN"}), "application/json"))
    r = doctor("--prometheus", srv.url, "--start", "-10m", "--json")
    assert r.exit_code == 0, (r.output, r.exception)
    assert json.loads(r.stdout) == {"findings": []}


@pytest.mark.parametrize("bad", ["+Inf", "-Inf", "1e999"])
def test_prometheus_infinite_value_is_one_error_line(srv: Server, bad: str) -> None:
    srv.route("/api/v1/query", body(_prom_answer(
        {**PROM_OK, "kvheat_prefix_miss_tokens_total": bad}), "application/json"))
    assert_error_line(doctor("--prometheus", srv.url, "--start", "-10m"),
                      "/api/v1/query", "kvheat_prefix_miss_tokens_total", "not a finite value")


def test_prometheus_json_with_a_bare_nan_is_one_error_line(srv: Server) -> None:
    text = _prom_answer(PROM_OK).replace("1796526000.0", "NaN")
    srv.route("/api/v1/query", body(text, "application/json"))
    assert_error_line(doctor("--prometheus", srv.url, "--start", "-10m"), "NaN")


# ---- deadlines ----------------------------------------------------------------------------
@pytest.mark.parametrize("in_headers", [False, True], ids=["body", "headers"])
def test_a_dripping_endpoint_ends_at_the_deadline(srv: Server, in_headers: bool) -> None:
    # A byte a second: every read is quick, so a per-read timeout never fires; today's
    # doctor waited for the whole answer (30 s here, forever for a slower drip).
    srv.route("/metrics", drip(GOOD_A + _miss("300"), 1.0, in_headers))
    t0 = time.monotonic()
    line = assert_error_line(doctor(srv.url + "/metrics", "--window", "0.1", "--timeout", "1.5"),
                             "within 1.5 s", "--timeout")
    took = time.monotonic() - t0
    assert took < 6, (took, line)


def test_fetch_deadline_covers_the_whole_body(srv: Server) -> None:
    srv.route("/metrics", drip(GOOD_A, 0.5))
    t0 = time.monotonic()
    with pytest.raises(DoctorError, match="within 1 s"):
        scrape(srv.url + "/metrics", timeout_s=1.0)
    assert time.monotonic() - t0 < 5


def test_prometheus_drip_ends_at_the_deadline(srv: Server) -> None:
    srv.route("/api/v1/query", drip(_prom_answer(PROM_OK), 1.0))
    t0 = time.monotonic()
    assert_error_line(doctor("--prometheus", srv.url, "--timeout", "1"), "within 1 s")
    assert time.monotonic() - t0 < 6


# ---- URLs ---------------------------------------------------------------------------------
@pytest.mark.parametrize("tail", ["", "/"])
def test_a_base_url_reads_its_metrics(srv: Server, tail: str) -> None:
    srv.route("/metrics", body(GOOD_A), body(GOOD_B))
    srv.route("/admin/stats", body('{"arms": {}}', "application/json"))
    r = doctor(srv.url + tail, "--window", "0.1", "--admin-url", srv.url + tail)
    assert r.exit_code == 0, (r.output, r.stderr, r.exception)
    assert "healthy" in r.stdout
    assert set(srv.asked) >= {"/metrics", "/admin/stats"} and "/" not in srv.asked


def test_a_404_says_what_was_tried_and_what_is_expected(srv: Server) -> None:
    line = assert_error_line(doctor(srv.url + "/stats", "--window", "0.1"),
                             srv.url + "/stats", "HTTP 404", "/metrics URL")
    assert "http://host:8000/metrics" in line
    line = assert_error_line(doctor("--prometheus", srv.url + "/graph"), "HTTP 404",
                             "Prometheus server's base URL")


def test_kvheat_arms_has_the_same_deadline_and_number_checks(srv: Server) -> None:
    # `kvheat arms` reads /admin/arms: the sibling fetch, with a per-read timeout only before.
    from kvheat.server.cli import arms_command

    srv.route("/admin/arms", drip(json.dumps({"arms": []}), 1.0, False))
    t0 = time.monotonic()
    r = CliRunner().invoke(arms_command, ["--url", srv.url, "--admin-token", "t",
                                          "--timeout", "1"])
    assert r.exit_code != 0 and "within 1 s" in r.output, r.output
    assert time.monotonic() - t0 < 6
    srv.route("/admin/arms", body('{"arms": [{"arm": "a", "p99": NaN}]}', "application/json"))
    r = CliRunner().invoke(arms_command, ["--url", srv.url, "--admin-token", "t"])
    assert r.exit_code != 0 and "Error:" in r.output and r.exception is not None
    assert isinstance(r.exception, SystemExit), r.exception  # a message, no traceback
