"""Request -> routing keys: the prompt tokenized and keyed as the replicas' caches key it
(the same tokenizer and chat template, chained block keys rooted at the tenant's salt, in
the scope of the arm the user reaches), then in the published form of the replicas' KV
events (keyed by the events secret, kvheat/kvevents/secret.py). A vLLM replica's blocks
are rooted at the `cache_salt` the router gave it: the tenant's salt keyed by the tenant
secret (kvheat/cache/tenancy.py), which the index reads back from its events."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..cache.hashing import (
    block_keys,
    prompt_scope,
    root_key,
    scoped_root,
    tenant_salt,
    tokens_to_bytes,
)
from ..cache.tenancy import TenantVouch
from ..server.arms import arm_user, user_bucket
from .config import RouterConfig
from .routing import RouteRequest

MODES = ("block", "exact", "off")


@dataclass(frozen=True, slots=True)
class ArmLayout:
    """A kvheat replica's A/B arms, as its `GET /kv_events` says.

    The arm (event rank) each of the 100 user buckets reaches, and how each arm keys prompts
    (`prefix_caching`)."""

    ranks: tuple[int, ...]  # bucket -> rank
    modes: tuple[str, ...]  # rank -> "block", "exact" or "off"

    @classmethod
    def from_info(cls, arms: Any) -> ArmLayout | None:
        """The layout from `/kv_events`' "arms", or None when absent or malformed.

        "arms" is [{"rank", "share", "prefix_caching"}] in config order; without a layout
        every request is keyed as rank 0."""
        if not isinstance(arms, list) or not 1 <= len(arms) <= 100:
            return None
        ranks: list[int] = []
        modes = ["block"] * len(arms)
        for a in arms:
            if not isinstance(a, dict):
                return None
            rank, share, mode = a.get("rank"), a.get("share"), a.get("prefix_caching")
            if not (type(rank) is int and 0 <= rank < len(arms) and type(share) is int
                    and 0 <= share <= 100 and mode in MODES):
                return None
            modes[rank] = mode
            ranks += [rank] * share
        if len(ranks) != 100:
            return None
        return cls(tuple(ranks), tuple(modes))

    def rank_for(self, user: str) -> int:
        """The arm (event rank) that `user` reaches."""
        return self.ranks[user_bucket(user)]


class PromptKeys:
    """Keys prompts as the replicas' caches key them: tokenizer, tenant salts, arms."""

    def __init__(self, config: RouterConfig,
                 keyer: Callable[[bytes], bytes] | None = None,
                 tenancy: TenantVouch | None = None) -> None:
        self.config = config
        self.keyer = keyer  # the events secret's `event_key`; None: keys as the cache has them
        # Keys vLLM replicas' cache salts (and vouches for their tenants); default: the
        # config's tenant secret, else $KVHEAT_TENANT_SECRET, else a key drawn now.
        self.tenancy = tenancy or TenantVouch.resolve(config.tenant_secret)
        self._tokenizer: Any = None
        self._template: Any = None
        self._roots: dict[tuple[str | None, bool], bytes] = {}

    @property
    def tokenizer(self) -> Any:
        """The replicas' tokenizer (loaded on first use, its chat template compiled once)."""
        if self._tokenizer is None:
            from ..engine.loader import Tokenizer, _jinja_env, tiny_config

            cfg = self.config
            tok = Tokenizer.from_dir(cfg.model) if cfg.model else \
                Tokenizer.tiny(tiny_config(cfg.family).vocab_size)
            # The replicas' chat template, compiled once (the engine compiles it per call).
            self._template = _jinja_env().from_string(tok.chat_template) \
                if tok.chat_template else None
            self._tokenizer = tok
        return self._tokenizer

    def chat_tokens(self, messages: list[dict[str, str]]) -> list[int]:
        """What `Tokenizer.apply_chat_template(messages, True)` gives, from the compiled template.

        The tests check they agree."""
        tok = self.tokenizer
        if self._template is None:
            return tok.apply_chat_template(messages, True)
        text = self._template.render(messages=messages, add_generation_prompt=True,
                                     bos_token=tok.bos_token or "", eos_token=tok.eos_token or "")
        return tok.encode(text, add_special_tokens=False)

    def salt(self, tenant: str | None) -> str | None:
        """The cache salt of a tenant's keys, as kvheat replicas' caches derive it.

        Its share group's when it has one."""
        return tenant_salt(tenant, self.config.share_groups)

    def cache_salt(self, tenant: str | None) -> str | None:
        """The `cache_salt` a vLLM replica gets for a tenant.

        Its salt keyed by the tenant secret, never a string a client could send itself."""
        salt = self.salt(tenant)
        return None if salt is None else self.tenancy.cache_salt(salt)

    def vllm_tenant(self, tenant: str | None) -> tuple[str | None, dict[str, str] | None]:
        """(cache_salt, vouched kv_transfer_params) for a vLLM replica's request.

        The params only with a configured secret (a drawn key vouches to nobody)."""
        salt = self.cache_salt(tenant)
        if tenant is None or not self.tenancy.configured:
            return salt, None
        return salt, self.tenancy.params(tenant, salt)

    def tenant_of(self, authorization: str) -> tuple[str | None, bool]:
        """(tenant, known): the tenant of the request's API key.

        Without a tenant map the API is open (None, True)."""
        if not self.config.tenants:
            return None, True
        scheme, _, key = authorization.partition(" ")
        t = self.config.tenants.get(key.strip()) if scheme.lower() == "bearer" else None
        return t, t is not None

    def prompt_tokens(self, body: dict[str, Any], endpoint: str) -> list[int] | None:
        """The prompt as the replicas tokenize it, or None when the router cannot key the body.

        The replica then answers it, with its own 400 if it is bad."""
        tok = self.tokenizer
        try:
            if endpoint == "chat":
                msgs = []
                for m in body["messages"]:
                    c = m.get("content")
                    text = c if isinstance(c, str) else "".join(
                        p.get("text", "") for p in c) if isinstance(c, list) else ""
                    role = m["role"]
                    if not isinstance(role, str) or not isinstance(text, str):
                        return None
                    msgs.append({"role": "system" if role == "developer" else role,
                                 "content": text})
                return self.chat_tokens(msgs)
            p = body["prompt"]
            if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
                p = p[0]
            if isinstance(p, str):
                return tok.encode(p)
            if isinstance(p, list) and all(isinstance(x, int) and not isinstance(x, bool)
                                           for x in p):
                tokens_to_bytes(p)  # range check
                return list(p)
        except (KeyError, TypeError, AttributeError, ValueError):
            return None
        except Exception:  # a tokenizer or template error: the replica will say what
            return None
        return None

    def route_request(self, tokens: Sequence[int] | None, tenant: str | None,
                      block_size: int, user: str | None = None,
                      arms: ArmLayout | None = None, vllm: bool = False) -> RouteRequest:
        """The request's keys as the arm it reaches keys them.

        `arms`: the replicas' layout (the user picks the arm as the replicas pick it);
        `vllm`: as vLLM replicas' events give them (rooted at the keyed `cache_salt`)."""
        rank = arms.rank_for(arm_user(user, tenant)) if arms is not None else 0
        mode = arms.modes[rank] if arms is not None else "block"
        if not tokens or mode == "off":
            return RouteRequest([], [], len(tokens or ()), rank)
        root = self._roots.get((tenant, vllm))
        if root is None:
            salt = self.cache_salt(tenant) if vllm else self.salt(tenant)
            root = self._roots[(tenant, vllm)] = root_key(salt)
        raw = tokens_to_bytes(list(tokens))  # once: the scope and the keys read it
        if mode == "exact":
            root = scoped_root(root, prompt_scope(raw))
        keys: Sequence[bytes]
        keys, _ = block_keys(raw, block_size, root)
        if self.keyer is not None:
            keys = [self.keyer(k) for k in keys]
        return RouteRequest(keys, [block_size] * len(keys), len(tokens), rank,
                            replicable=mode == "block")
