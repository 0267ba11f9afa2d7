"""The session hint on its way to a replica (docs/vllm.md, "Request hints through the
connector and the router").

A kvheat replica reads the session from the `X-Session-Id` header or the OpenAI `user`
field itself (kvheat/server/sessions.py): the router forwards both unchanged. vLLM ignores
the header and drops `user` before its engine, so a vLLM replica gets the session where
its KV connector (and kvheat's offload policy) read it, `kv_transfer_params` in the body
(`SESSION_PARAM`), beside what the client put there. The router sends a keyed digest, as
a kvheat server keeps it (`SessionIds`: the tenant's salt, a secret), never the string
itself: two tenants naming the same session stay apart, and nothing the replica logs says
what the client sent. A bad header is the 400 a kvheat server answers.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from ..cache.hints import SESSION_PARAM
from ..cache.tenancy import strip_claims
from ..server.errors import ApiError
from ..server.sessions import SessionIds, check_session_header
from .proxy import RouterError


class SessionHints:
    """Session digests for vLLM replicas.

    Keyed by `secret` (routers in front of the same replicas given one key the same session
    alike; None: a key drawn at start) and by the tenant's salt (`share_groups`, as the
    replicas group tenants)."""

    def __init__(self, share_groups: dict[str, str], secret: str | None = None) -> None:
        key = hashlib.blake2b(secret.encode(), digest_size=32,
                              person=b"kvheat-sessions").digest() if secret else None
        self.ids = SessionIds(share_groups, key)

    @staticmethod
    def check_header(value: str | None) -> None:
        """A bad X-Session-Id header is the client's 400 (as a kvheat server answers it)."""
        if value is None:
            return
        try:
            check_session_header(value)
        except ApiError as e:
            raise RouterError(e.status, e.message, e.type, e.code, e.param) from None

    def session_of(self, header: str | None, user: str | None, tenant: str | None
                   ) -> str | None:
        """The digest of the session the client gave (header, else `user`), or None."""
        return self.ids.session_of(header, user, tenant)


def vllm_body(body: dict[str, Any], raw: bytes, cache_salt: str | None,
              session: str | None, tenant: dict[str, str] | None = None) -> bytes:
    """The body a vLLM replica gets: the client's, with the router's tenant and session.

    The tenant's keyed `cache_salt`, the router's vouched `tenant` (`cache/tenancy.py`) and
    the session in `kv_transfer_params`. What only the operator assigns is the client's
    claim and goes: a tenant or its MAC in `kv_transfer_params`, and `priority` (vLLM's
    scheduling class). A session the client put there itself is kept, as is every other
    parameter; a `kv_transfer_params` that is not an object is left for vLLM to refuse.
    `raw` unchanged when there is nothing to change."""
    out = dict(body)
    changed = out.pop("priority", None) is not None
    if cache_salt is not None:
        out["cache_salt"] = cache_salt
        changed = True
    params = out.get("kv_transfer_params")
    if params is None and (session is not None or tenant is not None):
        params = {}
    if isinstance(params, dict):
        mine = strip_claims(params)
        if tenant is not None:
            mine.update(tenant)
        if session is not None and SESSION_PARAM not in mine:
            mine[SESSION_PARAM] = session
        if mine != params or "kv_transfer_params" not in out:
            out["kv_transfer_params"] = mine
            changed = True
    return msgspec.json.encode(out) if changed else raw
