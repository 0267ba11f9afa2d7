"""The block cache: a pool of KV blocks shared across requests by prefix hash.

One request goes through `allocate` (reuse its cached prefix, take blocks for the rest),
`append_tokens` while it decodes, and `free`. The mechanism (blocks, free stack, index,
eviction) is the `BlockPool` it holds; this adds requests, their keys, tenants and pinned
prefixes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from .block import Block
from .eviction import EvictionPolicy
from .hashing import (
    BlockKey,
    Namespace,
    block_keys,
    chain_key,
    root_key,
    tenant_salt,
    tokens_to_bytes,
    trace_block_keys,
)
from .hashing import scoped_root as _scoped_root
from .hints import Outcome, check_reason, check_session
from .pool import BlockPool, check_invariants
from .request import (
    CacheConfig,
    CacheError,
    CacheStats,
    OutOfBlocks,
    PromptTooLong,
    Request,
    UnknownRequest,
)
from .tenants import TenantQuotas


class KVCacheManager:
    """Requests on one block pool: made, matched, allocated, grown, freed and pinned.

    The manager holds the pool and uses its public methods only; tenant quotas and queued
    requests are kept here too."""

    def __init__(self, config: CacheConfig, policy: EvictionPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.block_size = config.block_size
        self.pool = BlockPool(config, policy, clock)
        self.requests: dict[str, Request] = {}
        self.pins: dict[str, Request] = {}  # pinned prefixes: holders of an extra reference
        self.tenants = TenantQuotas(self.pool)
        self.queued: dict[str, Request] = {}  # requests waiting for admission (`queue`)
        self._roots: dict[tuple[str | None, str | None], bytes] = {}
        self._namespaces: dict[str | None, Namespace] = {}  # one per tenant, as `_roots`

    # ---- the pool, as callers read it -------------------------------------------------
    @property
    def policy(self) -> EvictionPolicy:
        """The eviction policy (the shared one, when tenants with quotas have their own)."""
        return self.tenants.policy.shared

    @property
    def blocks(self) -> list[Block]:
        """Every block of the pool, by block id."""
        return self.pool.blocks

    @property
    def cached(self) -> dict[bytes, Block]:
        """The cached blocks, by key."""
        return self.pool.cached

    @property
    def stats(self) -> CacheStats:
        """The pool's counters: prompts, hits, inserts, evictions."""
        return self.pool.stats

    @property
    def clock(self) -> Callable[[], float]:
        """The cache clock (seconds)."""
        return self.pool.clock

    @property
    def evict_listeners(self) -> list[Callable[[Block], None]]:
        """Called with each block about to lose its KV (see `BlockPool`)."""
        return self.pool.evict_listeners

    @property
    def drop_listeners(self) -> list[Callable[[Block], None]]:
        """Callbacks given each block whose KV is deleted on purpose (a flush, a quota cut)."""
        return self.pool.drop_listeners

    @property
    def index_listeners(self) -> list[Callable[[Block, bool], None]]:
        """Callbacks given (block, True) once it is cached, (block, False) as it leaves."""
        return self.pool.index_listeners

    @property
    def num_free(self) -> int:
        """Blocks in the free stack: uncached and unreferenced."""
        return self.pool.num_free

    @property
    def num_cached(self) -> int:
        """Blocks cached under a key."""
        return self.pool.num_cached

    @property
    def num_referenced(self) -> int:
        """Blocks held by at least one request or pin."""
        return self.pool.num_referenced

    @property
    def usage(self) -> dict[str | None, int]:
        """Blocks each tenant holds or has cached."""
        return self.pool.usage

    @property
    def quotas(self) -> dict[str | None, int]:
        """Each tenant's block quota, for the tenants that have one."""
        return self.tenants.quotas

    def evict(self, n: int) -> int:
        """Evict up to `n` unreferenced cached blocks; returns how many."""
        return self.pool.evict(n)

    def touch(self, blocks: Sequence[Block]) -> None:
        """Mark blocks used now (tail-first), without changing who holds them."""
        self.pool.touch(blocks)

    def set_cluster_entropy(self, bits: float) -> None:
        """Give the policies the entropy of the traffic a router spreads over the cluster.

        That is the traffic of this cache and its peers: every policy here that reads an entropy
        regime uses it, others ignore it."""
        self.pool.set_cluster_entropy(bits)

    # ---- keys and requests --------------------------------------------------------------
    def salt_of(self, tenant: str | None) -> str | None:
        """The salt of `tenant`'s keys (its share group's when the config gives it one)."""
        return tenant_salt(tenant, self.config.share_groups)

    def namespace_of(self, tenant: str | None) -> Namespace:
        """The namespace of `tenant`'s keys in the lower tiers (its salt's), made once."""
        ns = self._namespaces.get(tenant)
        if ns is None:
            ns = self._namespaces[tenant] = Namespace.of(self.salt_of(tenant))
        return ns

    def root_for(self, tenant: str | None, lora: str | None = None) -> bytes:
        """The root key of the blocks of `tenant` (and `lora`), made once per pair."""
        r = self._roots.get((tenant, lora))
        if r is None:
            r = self._roots[(tenant, lora)] = root_key(self.salt_of(tenant), lora)
        return r

    def known_tenants(self) -> list[str | None]:
        """The tenants whose keys this cache has made, once each."""
        return list(dict.fromkeys(t for t, _lora in self._roots))

    def scoped_root(self, tenant: str | None, lora: str | None, scope: bytes | None) -> bytes:
        """The root of `tenant`'s keys, or of a scope within it.

        A scope is e.g. one whole prompt, for exact-prompt caching: the tenant stays the tenant,
        and nothing per scope is kept."""
        return _scoped_root(self.root_for(tenant, lora), scope)

    def make_request(self, request_id: str, tokens: Sequence[int], tenant: str | None = None,
                     lora: str | None = None, session: str | None = None,
                     scope: bytes | None = None) -> Request:
        """A request from token ids; its full blocks are hashed here, once.

        `scope`: see `scoped_root`."""
        check_session(session)
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
        """A request from a trace's block ids, each of which already names a prefix.

        The last block holds the remaining, possibly partial, token count and is cacheable too."""
        check_session(session)
        bs = self.block_size
        n_blocks = len(block_ids)
        if n_blocks == 0 or num_tokens > n_blocks * bs or num_tokens <= (n_blocks - 1) * bs:
            raise ValueError(f"{num_tokens} tokens do not fit {n_blocks} blocks of {bs}")
        root = self.root_for(tenant)
        keys, contents = trace_block_keys(root, block_ids)
        bt = [bs] * (n_blocks - 1) + [num_tokens - (n_blocks - 1) * bs]
        return Request(request_id, tenant, root, keys, contents, bt, num_tokens, None, session)

    def make_keyed_request(self, request_id: str, keys: list[BlockKey], num_tokens: int,
                           tenant: str | None = None, session: str | None = None) -> Request:
        """A request from block keys made already (a spooled trace's).

        This is `make_hashed_request` for keys that were made once, as that method makes them:
        each key, naming its whole prefix, stands for the block's content too."""
        check_session(session)
        bs = self.block_size
        n_blocks = len(keys)
        if n_blocks == 0 or num_tokens > n_blocks * bs or num_tokens <= (n_blocks - 1) * bs:
            raise ValueError(f"{num_tokens} tokens do not fit {n_blocks} blocks of {bs}")
        bt = [bs] * (n_blocks - 1) + [num_tokens - (n_blocks - 1) * bs]
        return Request(request_id, tenant, self.root_for(tenant), keys, list(keys), bt,
                       num_tokens, None, session)

    # ---- lookup and lifetime -----------------------------------------------------------
    def match_prefix(self, req: Request) -> list[Block]:
        """The cached blocks of the request's longest cached prefix (no side effects).

        A key hit whose tokens differ (a hash collision) ends the match."""
        cached = self.pool.cached
        out: list[Block] = []
        for key, content in zip(req.keys, req.contents):
            b = cached.get(key)
            if b is None:
                break
            if b.content != content:
                self.pool.stats.collisions += 1
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
        """Give `req` its blocks and return its block table.

        Its cached prefix comes first, shared, then new blocks for the rest (evicting when the
        free pool is empty)."""
        if req.request_id in self.requests:
            raise CacheError(f"request {req.request_id!r} already holds blocks")
        pool = self.pool
        n_need = len(req.block_tokens)
        n_pool = len(pool.blocks)
        if n_need > n_pool:
            raise PromptTooLong(
                f"request needs {n_need} blocks ({req.num_tokens} tokens) but the pool has "
                f"{n_pool} blocks of {self.block_size} tokens")
        hit = self.match_prefix(req) if matched is None else matched
        n_new = n_need - len(hit)
        # Every unreferenced block can be freed (a referenced block's ancestors are
        # referenced too), so this check is exact and failure changes nothing.
        if n_new > pool.num_free:
            can_free = n_pool - pool.num_referenced - sum(1 for b in hit if b.ref_cnt == 0)
            if n_new > can_free:
                raise OutOfBlocks(f"request needs {n_new} new blocks; only {can_free} are not in use")
        now = pool.clock()
        if self.queued and req.request_id in self.queued:
            self.dequeue(req.request_id)  # admitted
        if req.session is not None:
            pool.policy.on_session(req.session, now)
        hit_tokens = pool.acquire(hit, now)
        blocks = list(hit)
        if n_new:  # on OutOfBlocks (a tenant held to its quota) the pool undid it all
            pool.allocate_blocks(blocks, n_need, req.tenant, req.keys, req.contents,
                                 req.block_tokens, now)
        req.blocks = blocks
        req.num_cached_tokens = hit_tokens
        self.requests[req.request_id] = req
        if count_stats:
            self.record_prompt(req.num_tokens, hit_tokens, len(hit))
        return [b.block_id for b in blocks]

    def record_prompt(self, num_tokens: int, hit_tokens: int, hit_blocks: int) -> None:
        """Count one prompt in the hit statistics.

        For a caller that allocates a prompt in pieces (`allocate(..., count_stats=False)`) and
        knows its hits only at the end."""
        st = self.pool.stats
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
        pool = self.pool
        if n_new > len(pool.blocks) - pool.num_referenced:
            raise OutOfBlocks(f"request needs {n_new} more blocks; none can be freed")
        taken = pool.take_free_blocks(n_new, req.tenant)
        now = pool.clock()
        req.raw.extend(data)
        req.num_tokens = n_total
        new_ids: list[int] = []
        pool.hold(taken, req.tenant, now)
        for b in taken:
            req.blocks.append(b)
            req.block_tokens.append(0)
            new_ids.append(b.block_id)
        # Fill counts, and cache each block that became full.
        if req.session is not None:
            pool.policy.on_session(req.session, now)
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
                    pool.register(b, key, content, req.blocks[i - 1] if i else None, now,
                                  parent_key if i else None)
        return new_ids

    def discard(self, req: Request, from_block: int) -> int:
        """Un-cache the blocks of `req` from `from_block` on, whose KV was never written.

        The forward pass that was to write it failed: their keys go, without eviction listeners,
        and they stay held by `req` as private blocks that `free` releases uncached. Returns how
        many were un-cached. Raises CacheError and changes nothing when another holder or a block
        outside the tail depends on one of them."""
        if self.requests.get(req.request_id) is not req:
            raise UnknownRequest(f"request {req.request_id!r} holds no blocks")
        tail = req.blocks[max(from_block, 0):]
        for b in tail:
            if b.key is not None and (b.ref_cnt != 1 or b.num_children != sum(
                    1 for c in tail if c.parent is b)):
                raise CacheError(f"block {b.block_id} is shared; its KV cannot be discarded")
        n = 0
        for b in reversed(tail):  # children first, so the tree stays whole
            if b.key is not None:
                self.pool.unregister(b)
                n += 1
        del req.keys[from_block:], req.contents[from_block:]
        return n

    def free(self, req: Request | str, outcome: Outcome | str = Outcome.FINISHED,
             finish_reason: str | None = None) -> None:
        """Release a request's blocks, tail-first, so its first block ends most recent.

        `outcome` (delivered or cancelled) and `finish_reason` (the model's stop reason as the
        server knows it: "stop", "length", "tool_use", "end_turn", ...) reach the policy
        (`on_finish`) with the request's session, when any of them is a hint."""
        outcome = Outcome.parse(outcome)
        finish_reason = check_reason(finish_reason)
        rid = req if isinstance(req, str) else req.request_id
        r = self.requests.pop(rid, None)
        if r is None:
            raise UnknownRequest(f"free of unknown request {rid!r}")
        pool = self.pool
        if r.session is not None or outcome is not Outcome.FINISHED or finish_reason is not None:
            pool.policy.on_finish(r.blocks, r.session, outcome, finish_reason, pool.clock())
        pool.release(r.blocks)
        r.blocks = []

    # ---- the waiting queue (a hint) -----------------------------------------------------
    def queue(self, req: Request) -> None:
        """Record that `req` waits for admission and will need its blocks.

        The policy learns their keys (`on_queue`) until `dequeue` or `allocate` of the same
        request id. Queuing an id again replaces the earlier entry."""
        if not isinstance(req, Request):
            raise TypeError(f"queue takes a Request, got {type(req).__name__}")
        if req.request_id in self.queued:
            self.dequeue(req.request_id)
        self.queued[req.request_id] = req
        self.pool.policy.on_queue(req.request_id, req.keys, req.session)

    def dequeue(self, request_id: str) -> bool:
        """End a queued request's wait (admitted, cancelled or dropped).

        Returns whether it was queued: dequeuing an id that is not is harmless, so an engine may
        call it for every request it admits."""
        if self.queued.pop(request_id, None) is None:
            return False
        self.pool.policy.on_dequeue(request_id)
        return True

    # ---- tenants and pins ---------------------------------------------------------------
    def set_tenant_quota(self, tenant: str | None, blocks: int | None) -> int:
        """Cap a tenant's blocks (None lifts the cap); returns how many were deleted to fit.

        See `TenantQuotas.set_quota`."""
        return self.tenants.set_quota(tenant, blocks)

    def tenant_usage(self, tenant: str | None) -> int:
        """Blocks a tenant holds or has cached."""
        return self.pool.usage.get(tenant, 0)

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
        last_key = hit[-1].key
        assert last_key is not None  # a matched block is cached
        pin_id = "pin:" + last_key.hex()
        if pin_id in self.pins:
            return sum(b.num_tokens for b in hit)
        holder = Request(pin_id, tenant, probe.root, probe.keys[:len(hit)],
                         probe.contents[:len(hit)], [b.num_tokens for b in hit],
                         sum(b.num_tokens for b in hit))
        holder.blocks = list(hit)
        holder.num_cached_tokens = self.pool.acquire(hit, self.pool.clock())
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
                self.pool.release(pin.blocks)
                pin.blocks = []
        return n

    def pinned(self) -> list[tuple[str, str | None, int]]:
        """(pin id, tenant, tokens) of every pinned prefix."""
        return [(r.request_id, r.tenant, r.num_tokens) for r in self.pins.values()]

    def check_invariants(self) -> None:
        """Full consistency check (O(pool)); for tests."""
        check_invariants(self.pool, [*self.requests.values(), *self.pins.values()])
