"""A `kvheat serve` inside this process: the benches that inject faults into a live server
(bench/operations/) reach its engine, tiers and healer directly while clients talk HTTP."""

from __future__ import annotations

import socket
import threading
import time

from kvheat.server.app import KVHeatServer
from kvheat.server.config import ServerConfig


class InProcessServer:
    """`KVHeatServer(cfg)` served by uvicorn on a thread, on a free port of `host`."""

    def __init__(self, cfg: ServerConfig, host: str = "127.0.0.1",
                 freeze_startup_heap: bool = False) -> None:
        self.server = KVHeatServer(cfg)
        if freeze_startup_heap:  # as `kvheat serve` does before serving
            self.server.freeze_startup_heap()
        # Bound here, then handed to uvicorn: a port only probed free could be taken by
        # another connection's ephemeral port before uvicorn binds it.
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        self.port = sock.getsockname()[1]
        self.uv = self.server.uvicorn(host, self.port, "error")
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.uv.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        # Listening on every address, it is reached on loopback.
        self.base = f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{self.port}"

    def close(self) -> None:
        self.uv.should_exit = True
        self.thread.join(timeout=30)
