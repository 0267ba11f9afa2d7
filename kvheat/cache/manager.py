"""The block cache: a pool of KV blocks shared across requests by prefix hash.

One request goes through `allocate` (reuse its cached prefix, take blocks for the rest),
`append_tokens` while it decodes, and `free`. Blocks are never evicted while referenced,
and only leaves go (a block whose child is cached stays), in the order the policy picks.
Every operation is O(1) per block: dict lookups, intrusive lists, a free-block stack.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .block import Block
from .hashing import block_keys, chain_key, root_key, tokens_to_bytes
from .policy import EvictionPolicy, make_policy


class CacheError(Exception):
    """Base class of the cache's own errors; the pool is unchanged when one is raised."""


class PromptTooLong(CacheError):
    pass


class OutOfBlocks(CacheError):
    pass


class UnknownRequest(CacheError):
    pass


@dataclass(slots=True)
class CacheConfig:
    num_blocks: int
    block_size: int = 16
    policy: str = "lru"
    # tenant -> share group: tenants in one group see each other's blocks. Default: none.
    share_groups: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_blocks <= 0 or self.block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")


@dataclass(slots=True)
class CacheStats:
    requests: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    hit_blocks: int = 0
    inserted_blocks: int = 0
    evicted_blocks: int = 0
    collisions: int = 0  # a key matched but the tokens differed: served as a miss

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class Request:
    """A sequence holding blocks. Token requests hash their full blocks once, at creation;
    trace requests come with precomputed keys and per-block token counts."""

    __slots__ = (
        "request_id", "tenant", "session", "root", "keys", "contents", "block_tokens",
        "num_tokens", "blocks", "num_cached_tokens", "raw", "lora",
    )

    def __init__(self, request_id: str, tenant: str | None, root: bytes, keys: list[bytes],
                 contents: list[bytes], block_tokens: list[int], num_tokens: int,
                 raw: bytearray | None = None, session: str | None = None,
                 lora: str | None = None) -> None:
        self.request_id = request_id
        self.tenant = tenant
        self.session = session
        self.lora = lora
        self.root = root
        self.keys = keys  # keys of the cacheable blocks, in order
        self.contents = contents
        self.block_tokens = block_tokens  # tokens in each block the request needs
        self.num_tokens = num_tokens
        self.blocks: list[Block] = []
        self.num_cached_tokens = 0  # prompt tokens served from cache at allocate
        self.raw = raw  # token bytes (token requests only), grown by append_tokens

    @property
    def block_table(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    def head(self, n_tokens: int, block_size: int) -> Request:
        """A request for this one's first `n_tokens` tokens, reusing its block keys (a
        chunk of a chunked prefill)."""
        n_full = n_tokens // block_size
        bt = [block_size] * n_full
        if n_tokens % block_size:
            bt.append(n_tokens % block_size)
        raw = self.raw[:4 * n_tokens] if self.raw is not None else None
        return Request(self.request_id, self.tenant, self.root, self.keys[:n_full],
                       self.contents[:n_full], bt, n_tokens, raw, self.session, self.lora)


class KVCacheManager:
    def __init__(self, config: CacheConfig, policy: EvictionPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.block_size = config.block_size
        self.blocks = [Block(i) for i in range(config.num_blocks)]
        self.free_stack: list[Block] = self.blocks[::-1]  # uncached, unreferenced blocks
        self.cached: dict[bytes, Block] = {}
        self.requests: dict[str, Request] = {}
        # session -> keys of its latest turn; the oldest sessions are forgotten past
        # `num_blocks` entries (every per-key table the cache keeps is bounded).
        self.sessions: dict[str, list[bytes]] = {}
        self.pins: dict[str, Request] = {}  # pinned prefixes: holders of an extra reference
        self.policy = policy if policy is not None else make_policy(config.policy)
        self.policy.bind(config.num_blocks)
        # Tenants with a block quota get a policy of their own (a partition); the rest share
        # `self.policy`. Blocks belong to the tenant that filled them.
        self.partitions: dict[str | None, EvictionPolicy] = {}
        self.quotas: dict[str | None, int] = {}
        self.usage: dict[str | None, int] = {}  # blocks held or cached, by owning tenant
        # Skip the per-block call where the policy does not use the hook.
        self._on_hit = None if type(self.policy).on_hit is EvictionPolicy.on_hit else self.policy.on_hit
        self._on_insert = (None if type(self.policy).on_insert is EvictionPolicy.on_insert
                           else self.policy.on_insert)
        self._on_acquire = (None if type(self.policy).on_acquire is EvictionPolicy.on_acquire
                            else self.policy.on_acquire)
        self._acquire_all = (None if type(self.policy).on_acquire_all is EvictionPolicy.on_acquire_all
                             else self.policy.on_acquire_all)
        self._release_all = (None if type(self.policy).on_release_all is EvictionPolicy.on_release_all
                             else self.policy.on_release_all)
        self.clock = clock
        self.num_referenced = 0
        self.stats = CacheStats()
        self._roots: dict[tuple[str | None, str | None], bytes] = {}
        # Called with each block about to lose its KV (tiers demote it here).
        self.evict_listeners: list[Callable[[Block], None]] = []
        # Called instead with each block whose KV is deleted on purpose (a flush, a quota
        # cut): tiers delete the key everywhere rather than demote it.
        self.drop_listeners: list[Callable[[Block], None]] = []
        # Called with (block, True) once a block is registered under its key, and with
        # (block, False) just before it leaves the index for any reason (evicted, dropped,
        # rolled back, discarded): KV events for routers (kvheat.kvevents).
        self.index_listeners: list[Callable[[Block, bool], None]] = []

    # ---- keys -------------------------------------------------------------------------
    def salt_of(self, tenant: str | None) -> str | None:
        if tenant is None:
            return None
        return "group:" + self.config.share_groups[tenant] if tenant in self.config.share_groups \
            else "tenant:" + tenant

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
        root = self.root_for(tenant, lora)
        return root if scope is None else chain_key(root, b"kvheat-scope\0" + scope)

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
        keys, contents = [], []
        h = root
        for bid in block_ids:
            c = int(bid).to_bytes(8, "little", signed=False)
            h = chain_key(h, c)
            keys.append(h)
            contents.append(c)
        bt = [bs] * (n_blocks - 1) + [num_tokens - (n_blocks - 1) * bs]
        return Request(request_id, tenant, root, keys, contents, bt, num_tokens, None, session)

    # ---- lookup -----------------------------------------------------------------------
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

    # ---- lifetime ---------------------------------------------------------------------
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
        if req.session is not None:
            sessions = self.sessions
            sessions.pop(req.session, None)
            sessions[req.session] = req.keys
            if len(sessions) > len(self.blocks):
                del sessions[next(iter(sessions))]
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

    def _acquire(self, hit: list[Block], now: float) -> int:
        """Reference the blocks of a cached prefix; returns their token count."""
        if self._acquire_all is not None and self._on_hit is None and not self.partitions:
            tokens = 0
            fresh = []
            for b in hit:
                if b.ref_cnt == 0:
                    fresh.append(b)
                b.ref_cnt += 1
                b.last_access = now
                tokens += b.num_tokens
            self.num_referenced += len(fresh)
            self._acquire_all(fresh)
            return tokens
        parts = self.partitions
        policy = self.policy
        on_hit = self._on_hit
        tokens = 0
        for b in hit:
            pol = parts.get(b.tenant, policy) if parts else policy
            if b.ref_cnt == 0:
                self.num_referenced += 1
                if pol is not policy:
                    pol.on_acquire(b)
                elif self._on_acquire is not None:
                    self._on_acquire(b)
            b.ref_cnt += 1
            b.last_access = now
            if pol is not policy:
                pol.on_hit(b, now)
            elif on_hit is not None:
                on_hit(b, now)
            tokens += b.num_tokens
        return tokens

    def _undo(self, blocks: list[Block], n_hit: int, now: float) -> None:
        """Roll back a failed allocate: new blocks leave the cache uncomputed, hits are released."""
        for b in reversed(blocks[n_hit:]):
            b.ref_cnt = 0
            self.num_referenced -= 1
            if b.key is not None:
                self._pol(b).forget(b)
                self._unlink(b, evicted=False)
            else:
                self._reset(b)
                self.free_stack.append(b)
        for b in reversed(blocks[:n_hit]):
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.num_referenced -= 1
                self._pol(b).on_release(b, now)

    def _pol(self, b: Block) -> EvictionPolicy:
        return self.partitions.get(b.tenant, self.policy) if self.partitions else self.policy

    def _register(self, b: Block, key: bytes, content: bytes, parent: Block | None,
                  now: float, parent_key: bytes | None = None) -> None:
        if key in self.cached:  # the same prefix was filled by another request meanwhile
            return  # this copy stays private and is freed uncached
        if parent is not None and parent.key is None:
            # The parent is a private copy of a cached block (e.g. a fully cached prompt whose
            # last block is recomputed). Hang this block off the cached original, which holds
            # the same KV; with no original it stays private, as a cached child of a block
            # freed uncached would break the tree.
            parent = self.cached.get(parent_key) if parent_key is not None else None
            if parent is None:
                return
        b.key = key
        b.content = content
        b.parent = parent
        b.depth = parent.depth + 1 if parent is not None else 0
        if parent is not None:
            parent.num_children += 1
        self.cached[key] = b
        self.stats.inserted_blocks += 1
        for listener in self.index_listeners:
            listener(b, True)
        if self.partitions:
            self._pol(b).on_insert(b, now)
        elif self._on_insert is not None:
            self._on_insert(b, now)

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

    def _release(self, r: Request) -> None:
        now = self.clock()
        parts, policy = self.partitions, self.policy
        if self._release_all is not None and not parts:
            done: list[Block] = []
            free_stack = self.free_stack
            for b in reversed(r.blocks):
                b.ref_cnt -= 1
                if b.ref_cnt == 0:
                    if b.key is None:
                        self._reset(b)
                        free_stack.append(b)
                    else:
                        done.append(b)
                    self.num_referenced -= 1
            if done:
                self._release_all(done, now)
            r.blocks = []
            return
        on_release = policy.on_release
        released = 0
        for b in reversed(r.blocks):
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                released += 1
                if b.key is None:
                    self._reset(b)
                    self.free_stack.append(b)
                elif parts and b.tenant in parts:
                    parts[b.tenant].on_release(b, now)
                else:
                    on_release(b, now)
        self.num_referenced -= released
        r.blocks = []

    def touch(self, blocks: Sequence[Block]) -> None:
        """Mark blocks used now (tail-first), without changing who holds them."""
        now = self.clock()
        for b in reversed(blocks):
            if b.key is None:
                continue
            policy = self._pol(b)
            b.last_access = now
            if b.ref_cnt == 0:
                policy.on_acquire(b)
                policy.on_hit(b, now)
                policy.on_release(b, now)
            else:
                policy.on_hit(b, now)

    def evict(self, n: int) -> int:
        """Evict up to `n` unreferenced cached blocks into the free pool; returns how many."""
        done = 0
        while done < n and self._evict_one(None):
            done += 1
        return done

    # ---- tenants: quotas, flush, pins -------------------------------------------------
    def set_tenant_quota(self, tenant: str | None, blocks: int | None) -> int:
        """Cap a tenant's blocks when the pool is contended (None lifts the cap).

        Free blocks are used by anyone; once the pool is full, a tenant at its quota can
        only evict its own blocks, and others evict from tenants over their quota first.
        A tenant over its new quota loses its coldest unreferenced blocks at once, deleted,
        not demoted (demoting them would push other tenants out of the lower tiers).
        Returns how many were deleted.
        """
        if blocks is not None and blocks <= 0:
            raise ValueError("a quota is a positive number of blocks")
        old = self.partitions.get(tenant, self.policy)
        if blocks is None:
            self.quotas.pop(tenant, None)
            new = self.policy
            self.partitions.pop(tenant, None)
        else:
            self.quotas[tenant] = blocks
            if tenant in self.partitions:
                self.partitions[tenant].bind(blocks)
                return self._trim(tenant)
            new = self._new_policy()
            new.bind(blocks)
            self.partitions[tenant] = new
        if new is not old:
            # Move the tenant's cached blocks over, oldest first and children before
            # parents, so the new policy sees them in the order they were used.
            mine = sorted((b for b in self.cached.values() if b.tenant == tenant),
                          key=lambda b: (b.last_access, -b.depth))
            for b in mine:
                old.forget(b)
            for b in mine:
                new.on_insert(b, b.last_access)
                if b.ref_cnt == 0:
                    new.on_release(b, b.last_access)
        return self._trim(tenant)

    def _trim(self, tenant: str | None) -> int:
        """Delete a tenant's coldest unreferenced blocks while it is over its quota."""
        quota = self.quotas.get(tenant)
        pol = self.partitions.get(tenant)
        n = 0
        while quota is not None and pol is not None and self.usage.get(tenant, 0) > quota:
            b = pol.victim()
            if b is None:
                break
            pol.on_evict(b)
            self._unlink(b, drop=True)
            n += 1
        return n

    def _new_policy(self) -> EvictionPolicy:
        from .policy import _REGISTRY

        name = self.policy.name
        return make_policy(name) if name in _REGISTRY else type(self.policy)()

    def tenant_usage(self, tenant: str | None) -> int:
        """Blocks a tenant holds or has cached."""
        return self.usage.get(tenant, 0)

    def flush_tenant(self, tenant: str | None) -> int:
        """Delete every unreferenced cached block the tenant owns (not demoted: the drop
        listeners delete the keys from the lower tiers too); returns how many."""
        mine = sorted((b for b in self.cached.values() if b.tenant == tenant and b.ref_cnt == 0),
                      key=lambda b: -b.depth)
        n = 0
        for b in mine:  # deepest first, so each is a leaf by the time it is reached
            if b.key is not None and b.ref_cnt == 0 and b.num_children == 0:
                self._pol(b).forget(b)
                self._unlink(b, drop=True)
                n += 1
        return n

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

    # ---- internals --------------------------------------------------------------------
    def _take_free_block(self, tenant: str | None = None) -> Block:
        return self.free_stack.pop() if self.free_stack else self._evict_for_new(tenant)

    def _evict_for_new(self, tenant: str | None) -> Block:
        if not self._evict_one(tenant):
            if tenant in self.quotas:
                raise OutOfBlocks(f"tenant {tenant!r} is at its quota of {self.quotas[tenant]} "
                                  "blocks and none of its own blocks can be evicted")
            raise OutOfBlocks("no free or evictable block")  # excluded by the callers' checks
        return self.free_stack.pop()

    def _victim_sources(self, tenant: str | None) -> list[EvictionPolicy]:
        """Which policies to ask for a victim, in order, when `tenant` needs a block."""
        if not self.partitions:
            return [self.policy]
        quota, usage = self.quotas, self.usage
        if tenant in quota and usage.get(tenant, 0) >= quota[tenant]:
            return [self.partitions[tenant]]  # at its quota: only its own blocks go
        by_pressure = sorted(quota, key=lambda t: usage.get(t, 0) / quota[t], reverse=True)
        over = [self.partitions[t] for t in by_pressure if usage.get(t, 0) > quota[t]]
        rest = [self.partitions[t] for t in by_pressure if usage.get(t, 0) <= quota[t]]
        return over + [self.policy] + rest

    def _evict_one(self, tenant: str | None) -> bool:
        if not self.partitions:  # the common case: one policy for everyone
            pol = self.policy
            b = pol.victim()
            if b is None:
                return False
            pol.on_evict(b)
            self._unlink(b)
            return True
        for pol in self._victim_sources(tenant):
            b = pol.victim()
            if b is not None:
                assert b.ref_cnt == 0 and b.num_children == 0, f"policy chose an unevictable {b}"
                pol.on_evict(b)
                self._unlink(b)
                return True
        return False

    def _unlink(self, b: Block, evicted: bool = True, drop: bool = False) -> None:
        """Take a refcount-0 leaf out of the cache and into the free pool. `evicted` is
        False only for blocks whose KV was never computed (a rolled-back allocate);
        `drop`: its KV is deleted on purpose (flush, quota cut), not demoted."""
        if evicted:
            for listener in (self.drop_listeners if drop else self.evict_listeners):
                listener(b)
        for index_listener in self.index_listeners:
            index_listener(b, False)
        del self.cached[b.key]  # type: ignore[arg-type]
        parent = b.parent
        self._reset(b)
        if parent is not None:
            parent.num_children -= 1
            if parent.num_children == 0 and parent.ref_cnt == 0:
                self._pol(parent).on_leaf(parent)
        self.free_stack.append(b)
        if evicted:
            self.stats.evicted_blocks += 1

    def _reset(self, b: Block) -> None:
        self.usage[b.tenant] -= 1
        b.key = None
        b.content = None
        b.parent = None
        b.num_children = 0
        b.num_tokens = 0
        b.state = 0
        b.freq = 0
        b.parked = None
        b.tenant = None
        b.heap_ver += 1

    # ---- introspection ----------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free_stack)

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    def check_invariants(self) -> None:
        """Full consistency check (O(pool)); for tests."""
        n = len(self.blocks)
        free_ids = {b.block_id for b in self.free_stack}
        assert len(free_ids) == len(self.free_stack), "a block is twice in the free pool"
        held: dict[int, int] = {}
        for r in [*self.requests.values(), *self.pins.values()]:
            for b in r.blocks:
                held[b.block_id] = held.get(b.block_id, 0) + 1
        children: dict[int, int] = {}
        for b in self.blocks:
            assert b.ref_cnt >= 0
            assert b.ref_cnt == held.get(b.block_id, 0), f"refcount of {b} != holders"
            if b.block_id in free_ids:
                assert b.key is None and b.ref_cnt == 0
            if b.key is not None:
                assert self.cached.get(b.key) is b
                if b.parent is not None:
                    assert b.parent.key is not None, "a cached block's parent was evicted"
                    children[b.parent.block_id] = children.get(b.parent.block_id, 0) + 1
            elif b.block_id not in free_ids:
                assert b.ref_cnt > 0, f"{b} is neither free, cached nor held"
        for b in self.blocks:
            assert b.num_children == children.get(b.block_id, 0), f"child count of {b}"
        assert sum(1 for b in self.blocks if b.ref_cnt) == self.num_referenced
        assert len(self.cached) + len(self.free_stack) + sum(
            1 for b in self.blocks if b.key is None and b.ref_cnt) == n
        owned: dict[str | None, int] = {}
        for b in self.blocks:
            if b.block_id not in free_ids:
                owned[b.tenant] = owned.get(b.tenant, 0) + 1
        assert owned == {t: c for t, c in self.usage.items() if c}, "tenant usage drifted"
