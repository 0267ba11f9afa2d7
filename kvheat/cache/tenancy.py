"""Tenants across the router -> vLLM hop: a keyed `cache_salt`, and a tenant vouched for.

Everything in a request body is the client's claim. A vLLM replica's only tenant signals
are body fields (`cache_salt`, `kv_transfer_params`), so a client that reaches vLLM's port
could name any tenant there. One secret, shared by `kvheat route` and the replicas'
`KVHeatConnector` (`tenant_secret`, or `KVHEAT_TENANT_SECRET`), closes both doors:

- `cache_salt(salt)`: the `cache_salt` the router gives a tenant's requests is BLAKE2b of
  the tenant's salt (`hashing.tenant_salt`) under a key derived from the secret, never the
  guessable `tenant:<name>`. vLLM chains it into every block hash, so its device prefix
  cache and the connector's tiers (keyed by those hashes) match a tenant's blocks only for
  requests that carry the salt, which no client sees or can compute.
- `vouch(tenant, cache_salt)`: the router puts the tenant in `kv_transfer_params` with a
  MAC over (tenant, the request's cache_salt) under another derived key; the connector
  accepts the tenant only when `vouched` says the MAC is right (`TENANT_PARAM`,
  `VOUCH_PARAM`). The MAC is bound to the tenant's keyed salt, so replaying it needs that
  salt, itself the tenant's secret; a client-set tenant without it is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from typing import Any

TENANT_SECRET_ENV = "KVHEAT_TENANT_SECRET"
MIN_SECRET = 16
TENANT_PARAM = "tenant"  # kv_transfer_params: the tenant the router vouches for
VOUCH_PARAM = "kvheat_tenant_mac"  # kv_transfer_params: its MAC
SALT_PREFIX = "kvheat-salt:"  # a keyed cache_salt (what vLLM logs show of it)


class TenantVouch:
    """One deployment's tenant secret: keys vLLM cache salts and vouches for tenants."""

    def __init__(self, secret: str | bytes, configured: bool = True) -> None:
        raw = secret.encode() if isinstance(secret, str) else bytes(secret)
        if len(raw) < MIN_SECRET:
            raise ValueError(f"the tenant secret must have at least {MIN_SECRET} bytes")
        # False: a key drawn at start (no replica shares it: salts only, no vouching).
        self.configured = configured
        self._salt_key = _derive(raw, b"cache-salt")
        self._mac_key = _derive(raw, b"tenant-vouch")

    @classmethod
    def from_config(cls, secret: str | None) -> TenantVouch | None:
        """`secret`, else `KVHEAT_TENANT_SECRET`; None when neither is set."""
        if secret is None:
            secret = os.environ.get(TENANT_SECRET_ENV) or None
        return None if secret is None else cls(secret)

    @classmethod
    def resolve(cls, secret: str | None) -> TenantVouch:
        """As `from_config`, else a key drawn now (salts unguessable, vouching off)."""
        return cls.from_config(secret) or cls(os.urandom(32), configured=False)

    def cache_salt(self, salt: str) -> str:
        """The vLLM `cache_salt` of a tenant's salt: keyed, so nobody can name it."""
        d = hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), key=self._salt_key,
                            digest_size=16)
        return SALT_PREFIX + d.hexdigest()

    def vouch(self, tenant: str, cache_salt: str | None) -> str:
        """The MAC of `tenant` for a request salted `cache_salt`."""
        h = hashlib.blake2b(key=self._mac_key, digest_size=16)
        for part in (tenant, cache_salt or ""):
            b = part.encode("utf-8", "surrogatepass")
            h.update(len(b).to_bytes(4, "little") + b)  # length-prefixed: no ambiguity
        return h.hexdigest()

    def params(self, tenant: str, cache_salt: str | None) -> dict[str, str]:
        """What the router adds to a vLLM request's `kv_transfer_params`."""
        return {TENANT_PARAM: tenant, VOUCH_PARAM: self.vouch(tenant, cache_salt)}

    def vouched(self, tenant: str, cache_salt: str | None, mac: Any) -> bool:
        """Whether this secret's holder vouched for `tenant` on a request salted `cache_salt`.

        Did this secret's holder vouch for `tenant` on a request salted `cache_salt`?"""
        return self.configured and isinstance(mac, str) and \
            hmac.compare_digest(mac.encode("utf-8", "surrogatepass"),
                                self.vouch(tenant, cache_salt).encode())


def strip_claims(params: Mapping[str, Any]) -> dict[str, Any]:
    """A client's `kv_transfer_params` without what only a trusted front may put there."""
    return {k: v for k, v in params.items() if k not in (TENANT_PARAM, VOUCH_PARAM)}


def _derive(secret: bytes, purpose: bytes) -> bytes:
    return hashlib.blake2b(purpose, key=hashlib.blake2b(secret, digest_size=32).digest(),
                           digest_size=32, person=b"kvheat-tenants").digest()
