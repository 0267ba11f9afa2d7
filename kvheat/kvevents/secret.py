"""The KV events' shared secret: it keys every hash the events carry and authenticates the
event sockets.

Why keyed: a cache key is an xxh3 chain over the prompt's tokens, rooted at the tenant's
salt. Published as is, anyone who reads the events can hash guessed prompts offline and
test them against the keys (a 4-digit PIN falls in under a second). So every key and
parent key leaves the process as BLAKE2b-128 of the cache key under a key derived from
this secret (`event_key`); the router computes the same from the prompt it keys, and
nobody without the secret can. The cache itself keeps its own fast keys.

Why authenticated: with a secret, both event sockets (PUB and the replay ROUTER) run ZMQ
CURVE. The publisher's and the subscriber's key pairs are derived from the secret, and
the publisher's authenticator accepts only the subscriber key the secret gives; traffic is
encrypted. A subscriber without the secret cannot connect, let alone ask for a snapshot.

Without a configured secret (`kv_events_secret`, or `KVHEAT_EVENTS_SECRET`), a replica
keys its events under a random per-process secret: still unguessable, but no router can
match them, and the sockets are plain ZMQ (a warning says so when they are bound beyond
loopback).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from collections.abc import Sequence

import zmq
from zmq.utils import z85

SECRET_ENV = "KVHEAT_EVENTS_SECRET"
MIN_SECRET = 16


class EventSecret:
    """One deployment's events secret: the key of event hashes and the CURVE key pairs."""

    def __init__(self, secret: str | bytes, configured: bool = True) -> None:
        raw = secret.encode() if isinstance(secret, str) else bytes(secret)
        if len(raw) < MIN_SECRET:
            raise ValueError(f"the KV events secret must have at least {MIN_SECRET} bytes")
        self.configured = configured  # False: a random per-process one (nobody shares it)
        # The keyed state, copied per key: cheaper than keying a new hash each time.
        self._keyed = hashlib.blake2b(key=_derive(raw, b"event-keys"), digest_size=16)
        self._server_secret = z85.encode(_derive(raw, b"curve-server"))
        self._client_secret = z85.encode(_derive(raw, b"curve-client"))
        self._prewarm_key = _derive(raw, b"prewarm-mark")
        self.server_public = zmq.curve_public(self._server_secret)
        self.client_public = zmq.curve_public(self._client_secret)

    @classmethod
    def resolve(cls, secret: str | bytes | None) -> EventSecret:
        """`secret`, else `KVHEAT_EVENTS_SECRET`, else a random per-process secret."""
        if secret is None:
            secret = os.environ.get(SECRET_ENV) or None
        if secret is None:
            return cls(os.urandom(32), configured=False)
        return cls(secret)

    @classmethod
    def from_config(cls, secret: str | bytes | None) -> EventSecret | None:
        """For a consumer (the router): `secret`, else the environment; None when neither."""
        if secret is None:
            secret = os.environ.get(SECRET_ENV) or None
        return None if secret is None else cls(secret)

    def event_key(self, key: bytes) -> bytes:
        """The published form of a cache key: BLAKE2b-128 under the events key."""
        h = self._keyed.copy()
        h.update(key)
        return h.digest()

    # ---- a router's prewarms ----------------------------------------------------------------
    def prewarm_mark(self, tokens: Sequence[int]) -> str:
        """The `x-kvheat-prewarm` value of a router's prewarm of `tokens`.

        A MAC under this secret, so a client (who lacks it) cannot pass its requests off as
        prewarms, which a replica counts apart from its clients' traffic."""
        h = hashlib.blake2b(key=self._prewarm_key, digest_size=16)
        h.update(",".join(map(str, tokens)).encode())
        return h.hexdigest()

    def is_prewarm(self, tokens: Sequence[int], mark: str | None) -> bool:
        """Whether `mark` is this secret's prewarm mark of `tokens`.

        Never for a random per-process secret (no router shares it)."""
        return bool(mark) and self.configured and isinstance(mark, str) and \
            hmac.compare_digest(mark.encode(errors="replace"), self.prewarm_mark(tokens).encode())

    # ---- CURVE --------------------------------------------------------------------------
    def curve_server(self, sock: zmq.Socket) -> None:
        """Make `sock` (a bound PUB or ROUTER) a CURVE server."""
        sock.curve_secretkey = self._server_secret
        sock.curve_publickey = self.server_public
        sock.curve_server = True

    def curve_client(self, sock: zmq.Socket) -> None:
        """Make `sock` (a connecting SUB or DEALER) this secret's CURVE client."""
        sock.curve_secretkey = self._client_secret
        sock.curve_publickey = self.client_public
        sock.curve_serverkey = self.server_public


def _derive(secret: bytes, purpose: bytes) -> bytes:
    return hashlib.blake2b(purpose, key=hashlib.blake2b(secret, digest_size=32).digest(),
                           digest_size=32, person=b"kvheat-events").digest()


def is_private_endpoint(endpoint: str) -> bool:
    """Whether a ZMQ endpoint is reachable from this machine only (ipc, inproc, loopback).

    Is a ZMQ endpoint reachable from this machine only (ipc, inproc, loopback)?"""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    m = re.fullmatch(r"tcp://(.+):[0-9*]+", endpoint)
    if m is None:
        return False
    host = m.group(1).strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")
