"""What a request tells the cache beyond its tokens: the hints an eviction policy may use.

A serving stack knows three things about a block's future that a trace of keys does not:

- the **session** a request belongs to (`Request.session`: the `user` field, an
  `X-Session-Id` header, a trace's `session_id`, or the request whose whole prompt this one
  extends): the policy sees it on insert and access (`EvictionPolicy.on_session`);
- **how the request ended** (`Outcome`, and the model's finish reason: "stop", "length",
  "tool_use", "end_turn", ...): the policy sees them on release (`EvictionPolicy.on_finish`);
- **which blocks queued requests will need** (`KVCacheManager.queue` / `dequeue`): the policy
  sees the keys (`EvictionPolicy.on_queue` / `on_dequeue`).

Every hint is optional. Without any (session None, no queue calls, `free()` with its
defaults) no hint hook is called and every policy decides exactly as before.
"""

from __future__ import annotations

import enum
import hashlib

# The key of vLLM's `kv_transfer_params` that carries a request's session to kvheat's
# vLLM policies (the offload adapter, KVHeatConnector); `kvheat route` puts it there.
SESSION_PARAM = "kvheat_session"


def session_digest(key: bytes, kind: str, *parts: str) -> str:
    """A session as a policy may hold it: `kind:` and a keyed digest of `parts`.

    The digest is BLAKE2b, its parts length-prefixed (no two part lists collide), keyed by a
    secret the client does not know, so an id seen in a log or a metric says nothing of the
    prompt it came from."""
    h = hashlib.blake2b(key=key, digest_size=16)
    for part in parts:
        b = part.encode("utf-8", "surrogatepass")
        h.update(len(b).to_bytes(8, "little") + b)
    return kind + ":" + h.hexdigest()


class Outcome(enum.Enum):
    """How a request ended: its answer delivered, or cancelled."""

    FINISHED = "finished"  # the answer was delivered
    CANCELLED = "cancelled"  # the client went away / aborted

    @classmethod
    def parse(cls, value: Outcome | str) -> Outcome:
        """An `Outcome` from itself or its value ("finished", "cancelled").

        Anything else raises a ValueError naming the choices."""
        if isinstance(value, Outcome):
            return value
        if isinstance(value, str):
            try:
                return cls(value)
            except ValueError:
                pass
        raise ValueError(f"outcome must be one of {[o.value for o in cls]}, got {value!r}")


# Finish reasons longer than this are a caller's bug (a message, not a reason), refused.
MAX_REASON_CHARS = 64


def check_reason(reason: object) -> str | None:
    """A finish reason as the policy receives it: None, or a short non-empty string."""
    if reason is None:
        return None
    if not isinstance(reason, str) or not reason or len(reason) > MAX_REASON_CHARS:
        raise ValueError(f"finish_reason must be None or a string of 1-{MAX_REASON_CHARS} "
                         f"characters, got {reason!r}")
    return reason


def check_session(session: object) -> str | None:
    """A session id as the cache keeps it: None, or a string."""
    if session is not None and not isinstance(session, str):
        raise ValueError(f"session must be None or a string, got {type(session).__name__}")
    return session
