"""One request validation: the context-length check is written once
(`kvheat.engine.engine.check_context_length`); the engine raises it, the server answers
it with a 400 `context_length_exceeded`, with the same words. They were two checks that
said different things ("prompt (4096) + max_tokens (1) exceeds the model's 4096
positions" from the engine, "the prompt has 4096 tokens; ..." from the server)."""

from __future__ import annotations

import httpx
import pytest
from test_server import MODEL, start, stop

from kvheat.engine import SamplingParams
from kvheat.engine.engine import ContextLengthExceeded, check_context_length
from kvheat.server.config import ServerConfig


def test_the_check_says_which_field_is_at_fault() -> None:
    check_context_length(10, 6, 16)
    with pytest.raises(ContextLengthExceeded, match="the prompt has 16 tokens") as e:
        check_context_length(16, 1, 16)
    assert e.value.param == "prompt"
    with pytest.raises(ContextLengthExceeded, match=r"plus max_tokens \(7\)") as e:
        check_context_length(10, 7, 16)
    assert e.value.param == "max_tokens"


def test_the_server_and_the_engine_refuse_a_long_request_alike() -> None:
    s = start(ServerConfig(num_blocks=64, threads=1))
    try:
        eng = s.server.worker.engines["default"]
        ctx = s.server.max_model_len
        for n, max_tokens, param in ((ctx, 1, "prompt"), (ctx - 10, 20, "max_tokens")):
            prompt = [5] * n
            r = httpx.post(s.base + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": prompt, "max_tokens": max_tokens})
            err = r.json()["error"]
            assert r.status_code == 400 and err["code"] == "context_length_exceeded"
            assert err["param"] == param
            with pytest.raises(ContextLengthExceeded) as e:
                s.on_engine_thread(lambda p=prompt, m=max_tokens: eng.add_request(
                    p, SamplingParams(max_tokens=m)))
            assert str(e.value) == err["message"]
        assert not eng.requests
    finally:
        stop(s)
