"""Serving under faults (issue 12): nothing on the side stops the engine loop, every
request ends with a response, tenants learn nothing of each other, big bodies do not
freeze the server, tier faults show in /metrics, shutdown is bounded. Real servers (the
tiny model, real forward passes) on loopback, as in test_server.py."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import httpx
from test_server import MODEL, Served, start, stop

from kvheat.server.config import ServerConfig
from kvheat.tiers import TierSpec


def _ids(seed: int, n: int) -> list[int]:
    """`n` seeded random token ids: prompts of two seeds share no block."""
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def _complete(s: Served, prompt: list[int] | str, key: str | None = None,
              **kw: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(s.base + "/v1/completions", headers=headers, timeout=60,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 1, **kw})


# ---- 1. a lower-tier hit must not kill the engine loop --------------------------------------
def test_disk_tier_hits_never_stop_the_engine_loop(tmp_path: Path) -> None:
    """The issue's sequence, replayed: a 160-token prompt, pushed off a 24-block device
    pool by four 200-token prompts, sent again (159 tokens come back from disk), then new
    prompts. The device series was the cache's hit count minus the tiers', counted at
    other times: it went negative and prometheus-client's error killed the loop."""
    s = start(ServerConfig(num_blocks=24, threads=1,
                           tiers=TierSpec(disk_dir=str(tmp_path / "kv"), disk_bytes=64 << 20)))
    try:
        from_disk = 0
        for rnd in range(6):
            keep = _ids(1000 + rnd, 160)
            assert _complete(s, keep).status_code == 200
            for j in range(4):
                assert _complete(s, _ids(100 * rnd + j, 200)).status_code == 200
            for eng in s.server.worker.engines.values():  # its demotion written (a loaded
                assert eng.tiers is not None  # machine lags the demotion thread)
                eng.tiers.flush()
            again = _complete(s, keep)
            assert again.status_code == 200, again.text
            from_disk += again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            s.server.worker.refresh_gauges()  # as the loop does, at once
            for j in range(3):
                r = _complete(s, _ids(50 + 100 * rnd + j, 100))
                assert r.status_code == 200, r.text
            assert httpx.get(s.base + "/health").status_code == 200
        s.wait_idle()
        assert from_disk >= 6 * 144  # the disk tier did serve the repeats
        assert s.metric("kvheat_tier_hit_tokens_total", tier="disk") > 0
        # Per request, the tiers' series add up to the cached tokens exactly.
        assert s.metric("kvheat_tier_hit_tokens_total") == \
            s.metric("kvheat_cached_tokens_total") > 0
        assert s.metric("kvheat_internal_errors_total") == 0
    finally:
        stop(s)


def test_failing_metrics_and_tracing_do_not_stop_serving() -> None:
    s = start(ServerConfig(num_blocks=64, threads=1))
    try:
        def broken(*a: Any, **k: Any) -> None:
            raise ValueError("injected metrics failure")

        m = s.server.metrics
        m.refresh_arm = broken  # type: ignore[method-assign]
        m.observe_request = broken  # type: ignore[method-assign]
        s.server.tracing.child = broken  # type: ignore[method-assign]
        for i in range(3):
            r = _complete(s, f"still serving {i}", max_tokens=2)
            assert r.status_code == 200, r.text
        s.server.worker.refresh_gauges()
        s.wait_idle()
        assert httpx.get(s.base + "/health").json()["status"] == "ok"
        assert s.metric("kvheat_internal_errors_total", where="metrics") >= 3
        assert s.metric("kvheat_internal_errors_total", where="gauges") >= 1
    finally:
        stop(s)


# ---- 2. every request ends with a response ------------------------------------------------
def _stream_events(s: Served, body: dict[str, Any], key: str | None = None,
                   ) -> tuple[int, list[str]]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.stream("POST", s.base + "/v1/completions", headers=headers, timeout=30,
                      json={"model": MODEL, "stream": True, **body}) as r:
        lines = [ln for ln in r.iter_lines() if ln]
        return r.status_code, lines


def test_requests_that_fill_the_pool_or_never_fit_get_answers() -> None:
    s = start(ServerConfig(num_blocks=32, threads=1, admin_token="adm"))
    try:
        # Prompt + max_tokens fill the whole pool; the repeat (its prefix cached) hung.
        whole = {"prompt": _ids(1, 480), "max_tokens": 32, "ignore_eos": True,
                 "temperature": 0}
        first = httpx.post(s.base + "/v1/completions", timeout=60,
                           json={"model": MODEL, **whole})
        assert first.status_code == 200, first.text
        again = httpx.post(s.base + "/v1/completions", timeout=60,
                           json={"model": MODEL, **whole})
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
        status, lines = _stream_events(s, whole)
        assert status == 200 and lines[-1] == "data: [DONE]"
        # Pinned prefixes leave 32 - 20 = 12 blocks: a 128-token prompt + 64 tokens (12
        # blocks) fits, 13 blocks never can: a 400, streaming too, at once.
        pinned = _ids(2, 320)
        assert _complete(s, pinned).status_code == 200
        r = httpx.post(s.base + "/admin/pin", headers={"Authorization": "Bearer adm"},
                       json={"token_ids": pinned}, timeout=30)
        assert r.status_code == 200 and r.json()["pinned_tokens"] == {"default": 320}
        assert _complete(s, _ids(3, 128), max_tokens=64).status_code == 200
        r = _complete(s, _ids(4, 128), max_tokens=65)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and "pinned" in err["message"]
        status, lines = _stream_events(s, {"prompt": _ids(5, 128), "max_tokens": 80})
        assert status == 400
        # Pinned after the request was queued: the engine cannot schedule it and ends it;
        # the server answers it (it waited forever before).
        r = httpx.post(s.base + "/admin/unpin", headers={"Authorization": "Bearer adm"},
                       json={"token_ids": pinned}, timeout=30)
        assert r.status_code == 200
        w = s.server.worker
        big = _ids(6, 300)  # 18 full blocks: 14 left, and the request needs 15
        assert _complete(s, big).status_code == 200
        hold = w.call(lambda: __import__("time").sleep(0.5))  # queue the next two behind it
        import threading
        got: list[httpx.Response] = []
        t = threading.Thread(target=lambda: got.append(_complete(s, _ids(7, 100),
                                                                 max_tokens=140)))
        t.start()
        __import__("time").sleep(0.2)
        eng = w.engines["default"]
        w.call(lambda: eng.cache.pin_prefix(big)).result(timeout=10)
        hold.result(timeout=10)
        t.join(timeout=30)
        assert not t.is_alive(), "the request hung"
        assert got[0].status_code == 400, got[0].text
        assert got[0].json()["error"]["code"] == "context_length_exceeded"
        s.wait_idle()
        assert httpx.get(s.base + "/health").json()["active_requests"] == 0
        assert s.metric("kvheat_requests_total", finish_reason="error") == 1
    finally:
        stop(s)


# ---- 3. tenants learn nothing of each other's prompts ---------------------------------------
def _public_view(s: Served, tenant: str) -> dict[str, float]:
    """What anyone reads about a tenant in /metrics (it needs no key)."""
    out: dict[str, float] = {}
    for line in httpx.get(s.base + "/metrics").text.splitlines():
        if not line.startswith("#") and f'tenant="{tenant}"' in line \
                and "_seconds" not in line and "_created" not in line:  # clocks, not state
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_no_public_metric_says_what_another_tenant_sent() -> None:
    """Tenant B sends two prompts of the same length: one tenant A sent before, one no
    one did. Everything B (or anyone) can read must be the same for both; it was not:
    /metrics counted the first prompt's blocks as `isolation` misses."""
    from kvheat.server.config import TenantConfig

    tenants = [TenantConfig("a", ["sk-a"]), TenantConfig("b", ["sk-b"])]
    views, answers, isolation = [], [], []
    for sent_by_a in (True, False):
        s = start(ServerConfig(num_blocks=64, threads=1, admin_token="adm", tenants=tenants))
        try:
            prompt = _ids(11, 96)
            if sent_by_a:
                assert _complete(s, prompt, "sk-a").status_code == 200
            r = _complete(s, prompt, "sk-b", temperature=0, max_tokens=2)
            assert r.status_code == 200
            body = r.json()
            answers.append((body["usage"], body["choices"][0]["text"],
                            sorted(k for k in r.headers if k not in ("date", "content-length"))))
            s.wait_idle()
            s.on_engine_thread(s.server.worker.refresh_gauges)  # gauges up to date
            views.append(_public_view(s, "tenant-1"))
            st = httpx.get(s.base + "/admin/stats", headers={"Authorization": "Bearer adm"})
            isolation.append(st.json()["arms"]["default"].get("misses", {}).get("b", {}))
        finally:
            stop(s)
    assert answers[0] == answers[1]
    assert views[0] == views[1] and views[0]
    # Operators still see it, in the admin API.
    assert [m.get("isolation") for m in isolation] == [96, 0]


# ---- 4. big bodies never freeze the server --------------------------------------------------
def _raw(s: Served, head: str, body: bytes = b"", chunks: list[bytes] | None = None) -> str:
    """Send a raw request (headers, then maybe a body) and return the status line and
    the response body."""
    import socket

    host, port = s.base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode() + b"\r\n" + body)
        for c in chunks or []:
            try:
                sock.sendall(b"%x\r\n" % len(c) + c + b"\r\n")
            except OSError:  # the server answered and closed: what we want
                break
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            part = sock.recv(65536)
            if not part:
                break
            data += part
    return data.decode("latin-1")


def test_big_bodies_are_refused_before_they_are_read() -> None:
    from kvheat.server.config import TenantConfig

    s = start(ServerConfig(num_blocks=64, threads=1, max_body_bytes="1MiB",
                           tenants=[TenantConfig("a", ["sk-a"])]))
    try:
        post = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        # 20 MB declared and never sent: the answer comes from the headers alone.
        out = _raw(s, post + "Authorization: Bearer sk-a\r\nContent-Length: 20000000\r\n")
        assert out.startswith("HTTP/1.1 413") and "body_too_large" in out
        out = _raw(s, post + "Content-Length: 30000000\r\n")  # no key: 401 first
        assert out.startswith("HTTP/1.1 401")
        # Chunked, no length: counted as it arrives, refused past the limit.
        out = _raw(s, post + "Authorization: Bearer sk-a\r\nTransfer-Encoding: chunked\r\n",
                   chunks=[b'{"model": "m", "prompt": "' + b"x" * 65536] * 40)
        assert out.startswith("HTTP/1.1 413"), out[:200]
        # Under the body limit but too long to fit the context: refused by its byte
        # length, before tokenizing (the message counts bytes, not tokens).
        text = "word " * (s.server.prompts.byte_limit // 5 + 1)
        r = _complete(s, text, "sk-a")
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and "bytes" in err["message"]
        r = httpx.post(s.base + "/v1/chat/completions", headers={"Authorization": "Bearer sk-a"},
                       json={"model": MODEL, "messages": [{"role": "user", "content": text}]},
                       timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert s.metric("kvheat_rejected_requests_total", status="413") == 2
        assert httpx.get(s.base + "/health").status_code == 200
    finally:
        stop(s)


def test_prompts_are_tokenized_off_the_event_loop() -> None:
    import threading

    s = start(ServerConfig(num_blocks=64, threads=1))
    try:
        tok = s.server.tokenizer
        seen: list[str] = []
        encode = tok.encode

        def recording(text: str, *a: Any, **k: Any) -> list[int]:
            seen.append(threading.current_thread().name)
            return encode(text, *a, **k)

        tok.encode = recording  # type: ignore[method-assign]
        try:
            assert _complete(s, "hello there").status_code == 200
            r = httpx.post(s.base + "/v1/chat/completions", timeout=30,
                           json={"model": MODEL, "max_tokens": 1,
                                 "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200
        finally:
            del tok.encode
        assert len(seen) == 2 and all(n.startswith("kvheat-tokenize") for n in seen), seen
    finally:
        stop(s)


# ---- 5. tier faults show in /metrics ---------------------------------------------------------
def _fill_device(s: Served, seed: int, n: int = 4) -> None:
    """Prompts enough to push earlier ones off a 24-block device pool (to the tiers)."""
    for j in range(n):
        assert _complete(s, _ids(seed + j, 200)).status_code == 200


def test_disk_faults_found_at_start_up_are_exported(tmp_path: Path) -> None:
    cfg = ServerConfig(num_blocks=24, threads=1,
                       tiers=TierSpec(disk_dir=str(tmp_path / "kv"), disk_bytes=64 << 20))
    s = start(cfg)
    try:
        _fill_device(s, 100, 5)
    finally:
        stop(s)  # pending demotions are written first
    files = sorted((tmp_path / "kv" / "default").glob("*.kv"))
    assert len(files) >= 3
    with open(files[0], "r+b") as f:  # torn: cut short
        f.truncate(f.seek(0, 2) // 2)
    with open(files[1], "r+b") as f:  # bad magic
        f.write(b"XXXX")
    s = start(cfg)
    try:
        s.wait_metric("kvheat_tier_faults_total", 1, tier="disk", kind="corrupt_torn")
        assert s.metric("kvheat_tier_faults_total", tier="disk", kind="corrupt_format") == 1
        assert s.metric("kvheat_tier_faults_total", tier="disk", kind="rejected_on_open") == 2
        assert s.metric("kvheat_tier_writable", tier="disk") == 1
    finally:
        stop(s)


def test_a_full_disk_shows_in_metrics(tmp_path: Path) -> None:
    import subprocess

    import pytest

    mnt = tmp_path / "small"
    mnt.mkdir()
    # A real file system that fills up: 512 KiB holds about seven 64 KiB blocks.
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        s = start(ServerConfig(num_blocks=24, threads=1,
                               tiers=TierSpec(disk_dir=str(mnt), disk_bytes=64 << 20)))
        try:
            _fill_device(s, 200, 6)
            s.wait_metric("kvheat_tier_faults_total", 1, tier="disk", kind="full_events")
            assert s.metric("kvheat_tier_faults_total", tier="disk", kind="io_errors") >= 1
            s.wait_metric("kvheat_tier_faults_total", 1, tier="disk", kind="put_refused")
            # Writes stay paused for a while after the file system said full.
            deadline = __import__("time").monotonic() + 5
            while s.metric("kvheat_tier_writable", tier="disk") != 0:
                assert __import__("time").monotonic() < deadline, "writable stayed 1"
                _fill_device(s, 300, 1)
            assert s.metric("kvheat_tier_up", tier="disk") == 1  # still readable
            assert httpx.get(s.base + "/health").status_code == 200
        finally:
            stop(s)
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_redis_faults_show_in_metrics(redis_server: Any) -> None:
    s = start(ServerConfig(num_blocks=24, threads=1,
                           tiers=TierSpec(redis_url=redis_server.url, redis_bytes=64 << 20)))
    try:
        keep = _ids(400, 160)
        assert _complete(s, keep).status_code == 200
        _fill_device(s, 410)
        eng = s.server.worker.engines["default"]
        s.on_engine_thread(lambda: eng.tiers.flush())
        assert s.on_engine_thread(lambda: len(eng.tiers.lower.indexes[0])) > 0
        redis_server.stop()  # its entries are gone; the tier's index still lists them
        redis_server.start()
        r = _complete(s, keep)
        assert r.status_code == 200  # recomputed: never wrong, never an error
        s.wait_metric("kvheat_tier_load_faults_total", 1, kind="load_failed")
        assert httpx.get(s.base + "/health").status_code == 200
    finally:
        stop(s)


# ---- 6. shutdown drains under a deadline ------------------------------------------------------
def test_shutdown_ends_long_streams_at_the_drain_deadline() -> None:
    import threading
    import time

    s = start(ServerConfig(num_blocks=512, threads=1, drain_timeout_s=1.0))
    results: dict[str, Any] = {}

    def stream(i: int) -> None:
        status, lines = _stream_events(s, {"prompt": f"story {i}", "max_tokens": 4000,
                                           "ignore_eos": True})
        results[f"s{i}"] = (status, lines)

    def whole() -> None:
        results["whole"] = _complete(s, "a long one", max_tokens=4000, ignore_eos=True)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    threads.append(threading.Thread(target=whole))
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while s.server.worker.num_active < 4:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(0.3)  # they are generating
    t0 = time.monotonic()
    s.uv.should_exit = True  # what SIGTERM does
    s.thread.join(timeout=30)
    took = time.monotonic() - t0
    for t in threads:
        t.join(timeout=10)
    assert not s.thread.is_alive() and took < 10, took  # not the 4000 tokens' time
    for i in range(3):
        status, lines = results[f"s{i}"]
        assert status == 200 and lines[-1] == "data: [DONE]", lines[-3:]
        assert '"code":"shutting_down"' in lines[-2]
        assert len(lines) > 3  # it was streaming tokens before
    r = results["whole"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    assert r.headers["retry-after"] == "1"


# ---- 7. no U+FFFD where a token ends inside a character ---------------------------------------
def test_text_never_ends_with_a_replacement_character() -> None:
    from kvheat.engine.loader import Tokenizer
    from kvheat.server.detokenizer import TextAssembler

    tok = Tokenizer.tiny()
    euro = tok.encode("€", add_special_tokens=False)
    hi = tok.encode(" hi", add_special_tokens=False)
    assert len(euro) == 3  # one byte-level token per byte
    ta = TextAssembler(tok, [])
    out = [ta.add(t) for t in hi + euro[:2]]  # ends two bytes into "€"
    assert "".join(out) + ta.flush() == " hi"  # was " hi\ufffd"
    ta = TextAssembler(tok, [])
    ids = hi + euro + hi + euro[:1]
    text = "".join(ta.add(t) for t in ids) + ta.flush()
    assert text == " hi€ hi" == tok.decode(ids[:-1])
    # Through the server: every token the first byte of "€", streamed and not.
    s = start(ServerConfig(num_blocks=64, threads=1))
    try:
        body = {"prompt": "Price:", "max_tokens": 2, "logit_bias": {str(euro[0]): 100},
                "temperature": 0}
        r = httpx.post(s.base + "/v1/completions", json={"model": MODEL, **body}, timeout=60)
        assert r.status_code == 200 and "\ufffd" not in r.json()["choices"][0]["text"]
        status, lines = _stream_events(s, body)
        assert status == 200 and "\\ufffd" not in "".join(lines) and "\ufffd" not in \
            "".join(lines)
    finally:
        stop(s)


# ---- 8. validation gaps ----------------------------------------------------------------------
def test_loose_input_is_refused_with_clear_errors() -> None:
    from kvheat.server.config import ConfigError, TenantConfig

    s = start(ServerConfig(num_blocks=16, threads=1, admin_token="adm",
                           tenants=[TenantConfig("a", ["sk-a"])]))
    try:
        auth = {"Authorization": "Bearer sk-a"}

        def post(body: dict[str, Any] | bytes) -> httpx.Response:
            kw: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {
                "json": {"model": MODEL, "max_tokens": 1, **body}}
            return httpx.post(s.base + "/v1/completions", timeout=30, **kw,
                              headers={**auth, "Content-Type": "application/json"})

        cases: list[tuple[dict[str, Any] | bytes, str | None]] = [
            ({"prompt": ""}, "prompt"),
            ({"prompt": [""]}, "prompt"),
            ({"prompt": [True, False]}, "prompt"),  # not token ids 1 and 0
            ({"prompt": "hi", "stream": "yes"}, "stream"),
            ({"prompt": "hi", "stream": 1}, "stream"),
            ({"prompt": "hi", "max_tokens": True}, "max_tokens"),
            ({"prompt": "hi", "temperature": "0.5"}, "temperature"),
            ({"prompt": "hi", "logit_bias": {"5_0": 1}}, "logit_bias"),  # not token 50
            ({"prompt": "hi", "logit_bias": {" 5": 1}}, "logit_bias"),
            ({"prompt": "hi", "stream_options": {"include_usage": "no"}}, "stream_options"),
            (b'{"model": "kvheat-tiny-llama", "prompt": ', None),  # not a char offset
        ]
        for body, param in cases:
            r = post(body)
            assert r.status_code == 400, (body, r.status_code, r.text)
            assert r.json()["error"]["param"] == param, (body, r.json())
        assert "not valid JSON" in post(cases[-1][0]).json()["error"]["message"]
        # Still fine: an int temperature, a real token-id list, a decimal logit_bias key.
        ok = post({"prompt": [5, 6, 7], "temperature": 0, "logit_bias": {"50": 1}})
        assert ok.status_code == 200, ok.text
        # More than the KV pool (16 blocks) holds: the code the docs promise.
        r = post({"prompt": _ids(9, 200), "max_tokens": 100})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        adm = {"Authorization": "Bearer adm"}
        for blocks in (10**23, 0, True, "5"):
            r = httpx.put(s.base + "/admin/tenants/a/quota", headers=adm,
                          json={"blocks": blocks})
            assert r.status_code == 400, (blocks, r.text)
        r = httpx.put(s.base + "/admin/tenants/a/quota", headers=adm, json={"blocks": 8})
        assert r.status_code == 200
    finally:
        stop(s)
    import pytest

    for bad in ({"5_0": 1.0}, {" 5": 1.0}, {"x": 1.0}):
        with pytest.raises(ConfigError):
            TenantConfig("t", ["k"], logit_bias=bad)
    with pytest.raises(ConfigError):
        TenantConfig("t", ["k"], quota_blocks=10**23)
