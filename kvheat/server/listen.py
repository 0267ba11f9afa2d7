"""The listening socket of `kvheat serve` and `kvheat route`, bound before start-up says
anything: a port in use is one clear error and a non-zero exit, not a "serving ... on"
line followed by uvicorn's failure (after the model has loaded)."""

from __future__ import annotations

import errno
import socket
import sys
from typing import Any

import click


def bind_port(host: str, port: int, option: str = "--port") -> socket.socket:
    """A TCP socket bound to (host, port), as uvicorn binds it.

    IPv6 where the host has a colon, SO_REUSEADDR; it listens once uvicorn serves on it
    (`Server.run(sockets=...)`). A port taken or not allowed raises `click.ClickException`
    naming the address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        hint = (f": another server listens there; stop it or pick another {option}"
                if e.errno == errno.EADDRINUSE else "")
        raise click.ClickException(f"cannot listen on {host}:{port} "
                                   f"({e.strerror or e}){hint}") from None
    return sock


def bound_port(sock: socket.socket) -> int:
    """The port the socket holds (the one the OS picked, for --port 0)."""
    return int(sock.getsockname()[1])


STARTUP_FAILURE = 3  # uvicorn.run's exit code when the app's start-up fails


def serve_on(server: Any, sock: socket.socket) -> None:
    """Run a `uvicorn.Server` on the bound socket as `uvicorn.run` runs one.

    Ctrl-C ends it quietly, a failed start-up exits non-zero."""
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    if not server.started:
        sys.exit(STARTUP_FAILURE)
