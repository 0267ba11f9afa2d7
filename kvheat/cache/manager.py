"""The block cache: a pool of KV blocks shared across requests by prefix hash.

One request goes through `allocate` (reuse its cached prefix, take blocks for the rest),
`append_tokens` while it decodes, and `free`. The mechanism (blocks, free stack, index,
eviction) is `BlockPool`; this adds requests, their keys, tenants and pinned prefixes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from .block import Block
from .hashing import block_keys, chain_key, root_key, tenant_salt, tokens_to_bytes, trace_block_keys
from .hashing import scoped_root as _scoped_root
from .policy import EvictionPolicy
from .pool import BlockPool, check_invariants
from .request import CacheConfig, CacheError, OutOfBlocks, PromptTooLong, Request, UnknownRequest
from .tenants import TenantQuotas


class KVCacheManager(BlockPool):
    def __init__(self, config: CacheConfig, policy: EvictionPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(config, policy, clock)
        self.requests: dict[str, Request] = {}
        self.pins: dict[str, Request] = {}  # pinned prefixes: holders of an extra reference
        self.tenants = TenantQuotas(self)
        self._roots: dict[tuple[str | None, str | None], bytes] = {}

    # ---- keys and requests --------------------------------------------------------------
    def salt_of(self, tenant: str | None) -> str | None:
        return tenant_salt(tenant, self.config.share_groups)

    def root_for(self, tenant: str | None, lora: str | None = None) -> bytes:
        r = self._roots.get((tenant, lora))
        if r is None:
            r = self._roots[(tenant, lora)] = root_key(self.salt_of(tenant), lora)
        return r

    def known_tenants(self) -> list[str | None]:
        """The tenants whose keys this cache has made, once each."""
        return list(dict.fromkeys(t for t, _lora in self._roots))

    def scoped_root(self, tenant: str | None, lora: str | None, scope: bytes | None) -> bytes:
        """The root of `tenant`'s keys, or of a scope within it (e.g. one whole prompt, for
        exact-prompt caching): the tenant stays the tenant, and nothing per scope is kept."""
        return _scoped_root(self.root_for(tenant, lora), scope)

    def make_request(self, request_id: str, tokens: Sequence[int], tenant: str | None = None,
                     lora: str | None = None, session: str | None = None,
                     scope: bytes | None = None) -> Request:
        """A request from token ids; its full blocks are hashed here, once. `scope`: see
        `scoped_root`."""
        raw = bytearray(tokens_to_bytes(list(tokens)))
        root = self.scoped_root(tenant, lora, scope)
        keys, contents = block_keys(bytes(raw), self.block_size, root)
        n = len(tokens)
        bt = [self.block_size] * (n // self.block_size)
        if n % self.block_size:
            bt.append(n % self.block_size)
        return Request(request_id, tenant, root, keys, contents, bt, n, raw, session, lora)

    def make_hashed_request(self, request_id: str, block_ids: Sequence[int], num_tokens: int,
                            tenant: str | None = None, session: str | None = None) -> Request:
        """A request from a trace's block ids (each already names a prefix); the last block
        holds the remaining, possibly partial, token count and is cacheable too."""
        bs = self.block_size
        n_blocks = len(block_ids)
        if n_blocks == 0 or num_tokens > n_blocks * bs or num_tokens <= (n_blocks - 1) * bs:
            raise ValueError(f"{num_tokens} tokens do not fit {n_blocks} blocks of {bs}")
        root = self.root_for(tenant)
        keys, contents = trace_block_keys(root, block_ids)
        bt = [bs] * (n_blocks - 1) + [num_tokens - (n_blocks - 1) * bs]
        return Request(request_id, tenant, root, keys, contents, bt, num_tokens, None, session)

    # ---- lookup and lifetime -----------------------------------------------------------
    def match_prefix(self, req: Request) -> list[Block]:
        """The cached blocks of the request's longest cached prefix (no side effects).
        A key hit whose tokens differ (a hash collision) ends the match."""
        cached = self.cached
        out: list[Block] = []
        for key, content in zip(req.keys, req.contents):
            b = cached.get(key)
            if b is None:
                break
            if b.content != content:
                self.stats.collisions += 1
                break
            out.append(b)
        return out

    def match_tokens(self, tokens: Sequence[int], tenant: str | None = None,
                     lora: str | None = None) -> int:
        """Number of leading tokens whose KV is cached for this tenant."""
        req = self.make_request("", tokens, tenant, lora)
        return sum(b.num_tokens for b in self.match_prefix(req))

    def allocate(self, req: Request, matched: list[Block] | None = None,
                 count_stats: bool = True) -> list[int]:
        """Give `req` its blocks: its cached prefix, shared, then new blocks for the rest
        (evicting when the free pool is empty). Returns the block table."""
        if req.request_id in self.requests:
            raise CacheError(f"request {req.request_id!r} already holds blocks")
        n_need = len(req.block_tokens)
        if n_need > len(self.blocks):
            raise PromptTooLong(
                f"request needs {n_need} blocks ({req.num_tokens} tokens) but the pool has "
                f"{len(self.blocks)} blocks of {self.block_size} tokens")
        hit = self.match_prefix(req) if matched is None else matched
        n_new = n_need - len(hit)
        # Every unreferenced block can be freed (a referenced block's ancestors are
        # referenced too), so this check is exact and failure changes nothing.
        if n_new > len(self.free_stack):
            can_free = len(self.blocks) - self.num_referenced - sum(1 for b in hit if b.ref_cnt == 0)
            if n_new > can_free:
                raise OutOfBlocks(f"request needs {n_new} new blocks; only {can_free} are not in use")
        now = self.clock()
        hit_tokens = self._acquire(hit, now)
        blocks = list(hit)
        if n_new:
            parent = hit[-1] if hit else None
            keys, contents, bt = req.keys, req.contents, req.block_tokens
            n_keys = len(keys)
            free_stack = self.free_stack
            tenant = req.tenant
            self.usage[tenant] = self.usage.get(tenant, 0) + n_new
            try:
                for i in range(len(hit), n_need):
                    b = free_stack.pop() if free_stack else self._evict_for_new(tenant)
                    b.ref_cnt = 1
                    b.num_tokens = bt[i]
                    b.tenant = tenant
                    b.last_access = b.inserted_at = now
                    if i < n_keys:
                        self._register(b, keys[i], contents[i], parent, now,
                                       keys[i - 1] if i else None)
                    blocks.append(b)
                    parent = b
            except OutOfBlocks:  # only a tenant held to its quota gets here
                self.num_referenced += len(blocks) - len(hit)
                self.usage[tenant] -= n_new - (len(blocks) - len(hit))
                self._undo(blocks, len(hit), now)
                raise
            self.num_referenced += n_new
        req.blocks = blocks
        req.num_cached_tokens = hit_tokens
        self.requests[req.request_id] = req
        if count_stats:
            self.record_prompt(req.num_tokens, hit_tokens, len(hit))
        return [b.block_id for b in blocks]

    def record_prompt(self, num_tokens: int, hit_tokens: int, hit_blocks: int) -> None:
        """Count one prompt in the hit statistics: for a caller that allocates a prompt in
        pieces (`allocate(..., count_stats=False)`) and knows its hits only at the end."""
        st = self.stats
        st.requests += 1
        st.query_tokens += num_tokens
        st.hit_tokens += hit_tokens
        st.hit_blocks += hit_blocks

    def append_tokens(self, req: Request, tokens: Sequence[int]) -> list[int]:
        """Grow a token request by decoded tokens; blocks that fill up become cached.
        Returns the ids of newly taken blocks. On OutOfBlocks nothing changes."""
        if req.raw is None:
            raise CacheError("append_tokens needs a request made from tokens")
        if self.requests.get(req.request_id) is not req:
            raise UnknownRequest(f"request {req.request_id!r} holds no blocks")
        data = tokens_to_bytes(list(tokens))
        bs = self.block_size
        n_old = req.num_tokens
        n_total = n_old + len(tokens)
        n_blocks_needed = -(-n_total // bs)
        n_new = n_blocks_needed - len(req.blocks)
        if n_new > len(self.blocks) - self.num_referenced:
            raise OutOfBlocks(f"request needs {n_new} more blocks; none can be freed")
        taken: list[Block] = []
        try:
            for _ in range(n_new):
                taken.append(self._take_free_block(req.tenant))
        except OutOfBlocks:  # a tenant held to its quota: give the fresh blocks back
            self.free_stack.extend(reversed(taken))
            raise
        now = self.clock()
        req.raw.extend(data)
        req.num_tokens = n_total
        new_ids: list[int] = []
        if n_new:
            self.usage[req.tenant] = self.usage.get(req.tenant, 0) + n_new
        for b in taken:
            b.ref_cnt = 1
            self.num_referenced += 1
            b.num_tokens = 0
            b.tenant = req.tenant
            b.last_access = b.inserted_at = now
            req.blocks.append(b)
            req.block_tokens.append(0)
            new_ids.append(b.block_id)
        # Fill counts, and cache each block that became full.
        first = n_old // bs
        for i in range(first, n_blocks_needed):
            cnt = min(bs, n_total - i * bs)
            req.blocks[i].num_tokens = req.block_tokens[i] = cnt
            if cnt == bs and i >= len(req.keys):
                parent_key = req.keys[i - 1] if i else req.root
                content = bytes(req.raw[i * 4 * bs:(i + 1) * 4 * bs])
                key = chain_key(parent_key, content)
                req.keys.append(key)
                req.contents.append(content)
                b = req.blocks[i]
                if b.key is None:
                    self._register(b, key, content, req.blocks[i - 1] if i else None, now,
                                   parent_key if i else None)
        return new_ids

    def discard(self, req: Request, from_block: int) -> int:
        """Un-cache `req.blocks[from_block:]`, registered but never given their KV (the
        forward pass that was to write it failed): their keys go, without eviction
        listeners, and they stay held by `req` as private blocks that `free` releases
        uncached. Returns how many were un-cached. Raises CacheError and changes nothing
        when another holder or a block outside the tail depends on one of them."""
        if self.requests.get(req.request_id) is not req:
            raise UnknownRequest(f"request {req.request_id!r} holds no blocks")
        tail = req.blocks[max(from_block, 0):]
        for b in tail:
            if b.key is not None and (b.ref_cnt != 1 or b.num_children != sum(
                    1 for c in tail if c.parent is b)):
                raise CacheError(f"block {b.block_id} is shared; its KV cannot be discarded")
        n = 0
        for b in reversed(tail):  # children first, so the tree stays whole
            if b.key is None:
                continue
            for listener in self.index_listeners:
                listener(b, False)
            self._pol(b).forget(b)
            del self.cached[b.key]
            parent = b.parent
            if parent is not None:
                parent.num_children -= 1
                if parent.num_children == 0 and parent.ref_cnt == 0:
                    self._pol(parent).on_leaf(parent)
            b.key = b.content = b.parent = None
            b.state = b.freq = 0
            b.parked = None
            b.heap_ver += 1
            n += 1
        del req.keys[from_block:], req.contents[from_block:]
        return n

    def free(self, req: Request | str) -> None:
        """Release a request's blocks, tail-first, so its first block ends most recent."""
        rid = req if isinstance(req, str) else req.request_id
        r = self.requests.pop(rid, None)
        if r is None:
            raise UnknownRequest(f"free of unknown request {rid!r}")
        self._release(r)

    # ---- tenants and pins ---------------------------------------------------------------
    def set_tenant_quota(self, tenant: str | None, blocks: int | None) -> int:
        """`TenantQuotas.set_quota`: cap a tenant's blocks (None lifts the cap); returns
        how many of its blocks were deleted to fit."""
        return self.tenants.set_quota(tenant, blocks)

    def tenant_usage(self, tenant: str | None) -> int:
        """Blocks a tenant holds or has cached."""
        return self.usage.get(tenant, 0)

    def flush_tenant(self, tenant: str | None) -> int:
        """`TenantQuotas.flush`: delete the tenant's unreferenced cached blocks."""
        return self.tenants.flush(tenant)

    def pin_prefix(self, tokens: Sequence[int], tenant: str | None = None,
                   lora: str | None = None, scope: bytes | None = None) -> int:
        """Hold the cached prefix of `tokens` so it is never evicted; returns tokens pinned.
        Pinning twice is harmless; only what is cached now can be pinned. `scope`: as in
        `make_request` (exact-prompt caching keys each prompt in a scope of its own)."""
        probe = self.make_request("", tokens, tenant, lora, scope=scope)
        hit = self.match_prefix(probe)
        if not hit:
            return 0
        pin_id = "pin:" + hit[-1].key.hex()  # type: ignore[union-attr]
        if pin_id in self.pins:
            return sum(b.num_tokens for b in hit)
        holder = Request(pin_id, tenant, probe.root, probe.keys[:len(hit)],
                         probe.contents[:len(hit)], [b.num_tokens for b in hit],
                         sum(b.num_tokens for b in hit))
        holder.blocks = list(hit)
        holder.num_cached_tokens = self._acquire(hit, self.clock())
        self.pins[pin_id] = holder
        return holder.num_cached_tokens

    def unpin_prefix(self, tokens: Sequence[int], tenant: str | None = None,
                     lora: str | None = None, scope: bytes | None = None) -> int:
        """Release pins on prefixes of `tokens` (longest first); returns tokens unpinned."""
        probe = self.make_request("", tokens, tenant, lora, scope=scope)
        n = 0
        for key in reversed(probe.keys):
            pin = self.pins.pop("pin:" + key.hex(), None)
            if pin is not None:
                n = max(n, pin.num_tokens)
                self._release(pin)
        return n

    def pinned(self) -> list[tuple[str, str | None, int]]:
        """(pin id, tenant, tokens) of every pinned prefix."""
        return [(r.request_id, r.tenant, r.num_tokens) for r in self.pins.values()]

    def check_invariants(self) -> None:
        """Full consistency check (O(pool)); for tests."""
        check_invariants(self, [*self.requests.values(), *self.pins.values()])
