"""Which session a request belongs to, for the cache policy's hints (docs/server.md,
"Sessions").

In order: the `X-Session-Id` header, the OpenAI `user` field, or, for a chat with neither,
the conversation's own opening (its messages up to and including the first user message,
which every later turn of the same conversation repeats). Whatever the source, the policy
gets a keyed digest, never the string itself: keyed by a secret drawn when the server
starts and by the tenant's salt (`cache.hashing.tenant_salt`), so two tenants that send the
same session string or the same opening get different sessions (one tenant's traffic never
moves another's), and an id that leaked into a log would say nothing of the prompt it came
from. Session ids appear in no response, metric, span or log.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence

from ..cache.hashing import tenant_salt
from ..cache.hints import session_digest
from .errors import ApiError
from .protocol import ChatMessage

SESSION_HEADER = "x-session-id"
MAX_SESSION_CHARS = 256  # as the OpenAI `user` field
_SESSION_CHARS = re.compile(r"[A-Za-z0-9._:/+=@-]+")


def check_session_header(value: str) -> str:
    """The header's value, or a 400 naming what is wrong with it."""
    if not 1 <= len(value) <= MAX_SESSION_CHARS or not _SESSION_CHARS.fullmatch(value):
        raise ApiError(400, f"the X-Session-Id header must be 1 to {MAX_SESSION_CHARS} "
                       "characters of A-Z a-z 0-9 . _ : / + = @ -", param="X-Session-Id",
                       code="invalid_session_id")
    return value


def conversation_opening(messages: Sequence[ChatMessage]) -> list[tuple[str, str]]:
    """(role, text) of the messages up to and including the first user message.

    What every turn of one conversation starts with."""
    out: list[tuple[str, str]] = []
    for m in messages:
        out.append((m.role, m.text()))
        if m.role == "user":
            break
    return out


class SessionIds:
    """Session ids of one server's requests.

    One secret for its lifetime: the policy's session state lives no longer."""

    def __init__(self, share_groups: Mapping[str, str], secret: bytes | None = None) -> None:
        self.share_groups = dict(share_groups)
        self._key = secret if secret is not None else os.urandom(32)

    def session_of(self, header: str | None, user: str | None, tenant: str | None,
                   messages: Sequence[ChatMessage] | None = None) -> str | None:
        """The request's session, or None.

        A completion with neither header nor user has none (a bare prompt does not say where
        its conversation starts)."""
        if header is not None:
            return self._digest("header", check_session_header(header), tenant)
        if user:
            return self._digest("user", user, tenant)
        if messages:
            opening = json.dumps(conversation_opening(messages), ensure_ascii=False)
            return self._digest("chat", opening, tenant)
        return None

    def _digest(self, kind: str, value: str, tenant: str | None) -> str:
        salt = tenant_salt(tenant, self.share_groups) or ""
        return session_digest(self._key, kind, salt, kind, value)
