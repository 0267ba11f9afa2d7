"""Request -> routing keys: the prompt tokenized and keyed as the replicas' caches key it
(the same tokenizer and chat template, chained block keys rooted at the tenant's salt)."""

from __future__ import annotations

from typing import Any

from ..cache.hashing import block_keys, root_key, tokens_to_bytes
from .config import RouterConfig
from .policy import RouteRequest


def salt_of(tenant: str | None) -> str | None:
    """The cache salt the replicas derive from a tenant (and vLLM gets as `cache_salt`)."""
    return None if tenant is None else "tenant:" + tenant


class PromptKeys:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._tokenizer: Any = None
        self._template: Any = None
        self._roots: dict[str | None, bytes] = {}

    @property
    def tokenizer(self) -> Any:
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
        """What `Tokenizer.apply_chat_template(messages, True)` gives, from the compiled
        template (the tests check they agree)."""
        tok = self.tokenizer
        if self._template is None:
            return tok.apply_chat_template(messages, True)
        text = self._template.render(messages=messages, add_generation_prompt=True,
                                     bos_token=tok.bos_token or "", eos_token=tok.eos_token or "")
        return tok.encode(text, add_special_tokens=False)

    def tenant_of(self, authorization: str) -> tuple[str | None, bool]:
        """(tenant, known): the tenant of the request's API key; without a tenant map the
        API is open (None, True)."""
        if not self.config.tenants:
            return None, True
        scheme, _, key = authorization.partition(" ")
        t = self.config.tenants.get(key.strip()) if scheme.lower() == "bearer" else None
        return t, t is not None

    def prompt_tokens(self, body: dict[str, Any], endpoint: str) -> list[int] | None:
        """The prompt as the replicas tokenize it, or None when the body is not one the
        router can key (the replica then answers it, with its own 400 if it is bad)."""
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

    def route_request(self, tokens: list[int] | None, tenant: str | None,
                      block_size: int) -> RouteRequest:
        if not tokens:
            return RouteRequest([], [], 0)
        root = self._roots.get(tenant)
        if root is None:
            root = self._roots[tenant] = root_key(salt_of(tenant))
        keys, _ = block_keys(tokens, block_size, root)
        return RouteRequest(keys, [block_size] * len(keys), len(tokens))
