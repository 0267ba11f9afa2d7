"""The admin API, behind its own bearer token (`admin_token`; off when none is set):

- GET  /admin/stats                      cache, queue, tier and tenant figures per arm
- GET  /admin/arms                       P99 TTFT and hit rate per arm (A/B report)
- GET  /admin/recent-keys                the last admitted prompts per arm as block ids (bounded),
                                         with the block size, pool size and policy: what
                                         `kvheat doctor` replays to size the pool
- POST /admin/tenants/{tenant}/flush     delete a tenant's KV from every tier (per-tier counts)
- PUT  /admin/tenants/{tenant}/quota     set or clear a tenant's block quota, at run time
                                         (a tenant over its new quota loses its coldest blocks)
- POST /admin/pin, /admin/unpin          keep a prefix cached (prefilled first when needed)
- PUT  /admin/cluster                    the entropy of the whole cluster's traffic, from
                                         `kvheat route`, for the eviction regime

Every cache operation runs on the engine thread, between steps, on every arm.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from fastapi import APIRouter, Request, Response

from ..engine import SamplingParams
from .arms import ArmStats
from .config import TenantConfig
from .errors import ApiError
from .handle import Finished, RequestHandle
from .prompts import PromptEncoder
from .protocol import ClusterRequest, PinRequest, QuotaRequest
from .responses import json_response
from .worker import EngineWorker

T = TypeVar("T")


class AdminHost(Protocol):
    """What the admin API uses of the server (`KVHeatServer`)."""

    worker: EngineWorker
    tenants: dict[str, TenantConfig]
    prompts: PromptEncoder
    arm_stats: ArmStats
    model_name: str
    max_model_len: int

    def check_admin(self, authorization: str) -> None:
        """Raise an ApiError unless `authorization` carries the admin token."""

    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, run off the event loop."""


def admin_router(server: AdminHost) -> APIRouter:
    """The /admin API over `server`: stats, arms, recent keys, quotas, flushes, pins, cluster."""
    router = APIRouter(prefix="/admin", tags=["admin"])
    worker = server.worker

    def check(request: Request) -> None:
        server.check_admin(request.headers.get("authorization", ""))

    def tenant_of(name: str | None) -> str | None:
        if name is None or name == "none":
            if server.tenants:
                raise ApiError(400, "name a tenant", param="tenant")
            return None
        if name not in server.tenants:
            raise ApiError(404, f"unknown tenant {name!r}", param="tenant")
        return name

    async def on_engines(fn: Any) -> dict[str, Any]:
        try:
            return await worker.acall(lambda: {arm: fn(eng) for arm, eng in
                                               worker.engines.items()})
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        except RuntimeError as e:
            raise ApiError(503, str(e), "server_error") from None

    def prompt_of(body: PinRequest) -> list[int]:
        given = [x is not None for x in (body.prompt, body.messages, body.token_ids)]
        if sum(given) != 1:
            raise ApiError(400, "give exactly one of prompt, messages, token_ids")
        if body.token_ids is not None:
            return server.prompts.completion(body.token_ids)
        if body.messages is not None:
            if not body.messages:
                raise ApiError(400, "messages is empty", param="messages")
            return server.prompts.chat(body.messages, body.add_generation_prompt)
        ids = server.prompts.encode(body.prompt or "")
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        return ids

    @router.get("/stats")
    async def stats(request: Request) -> Response:
        check(request)

        def one(eng: Any) -> dict[str, Any]:
            c = eng.cache
            st = c.stats
            out: dict[str, Any] = {
                "policy": eng.config.policy,
                "blocks": {"total": len(c.blocks), "free": c.num_free,
                           "referenced": c.num_referenced, "cached": c.num_cached},
                "block_size": c.block_size,
                "hit_rate": st.hit_rate,
                "cache": {"requests": st.requests, "query_tokens": st.query_tokens,
                          "hit_tokens": st.hit_tokens, "inserted_blocks": st.inserted_blocks,
                          "evicted_blocks": st.evicted_blocks, "collisions": st.collisions},
                "queue": {"waiting": len(eng.scheduler.waiting),
                          "running": len(eng.scheduler.running)},
                "engine": {"steps": eng.stats.steps, "prefill_tokens": eng.stats.prefill_tokens,
                           "decode_tokens": eng.stats.decode_tokens,
                           "preemptions": eng.stats.preemptions},
            }
            if server.tenants:
                out["tenants"] = {t: {"blocks": c.tenant_usage(t),
                                      "quota": worker.tenant_quotas.get(t)}
                                  for t in server.tenants}
            if eng.tiers is not None:
                out["tiers"] = eng.tiers.stats()
            mode = getattr(c.policy, "mode", None)
            if mode is not None:  # a policy with an entropy regime
                heat = c.policy.stats()
                out["regime"] = {"mode": mode, "entropy_bits": heat.get("entropy_bits"),
                                 "cluster_entropy_bits": heat.get("cluster_entropy_bits")}
            return out

        arms = await on_engines(one)
        # Miss classes per tenant, isolation included: only here, never in /metrics.
        misses = await worker.acall(lambda: {a: {t: dict(k) for t, k in per.items()}
                                             for a, per in worker.misses.items()})
        for arm, per in misses.items():
            if arm in arms:
                arms[arm]["misses"] = per
        return json_response({"model": server.model_name, "arms": arms,
                      "active_requests": worker.num_active})

    @router.get("/arms")
    async def arms(request: Request) -> Response:
        check(request)
        return json_response({"arms": server.arm_stats.summary()})

    @router.get("/recent-keys")
    async def recent_keys(request: Request) -> Response:
        """Which admitted prompts shared which prefix blocks, lately: ids that stand for the
        cache's salted, chained keys within this answer (never tokens or text), bounded by
        `RecentKeys` in prompts and blocks per arm."""
        check(request)

        def one(eng: Any) -> dict[str, Any]:
            return {"policy": eng.config.policy, "block_size": eng.cache.block_size,
                    "blocks": len(eng.cache.blocks)}

        arms = await on_engines(one)
        recent = await worker.acall(lambda: {a: r.export() for a, r in worker.recent.items()})
        for arm, reqs in recent.items():
            if arm in arms:
                arms[arm]["requests"] = reqs
        return json_response({"arms": arms})

    @router.post("/tenants/{tenant}/flush")
    async def flush(tenant: str, request: Request) -> Response:
        check(request)
        t = tenant_of(tenant)
        deleted = await on_engines(lambda eng: eng.flush_tenant(t))
        # `evicted_blocks`: device blocks, as before; `deleted`: entries per tier.
        return json_response({"tenant": tenant,
                      "evicted_blocks": {arm: d["device"] for arm, d in deleted.items()},
                      "deleted": deleted})

    @router.put("/tenants/{tenant}/quota")
    async def quota(tenant: str, body: QuotaRequest, request: Request) -> Response:
        check(request)
        t = tenant_of(tenant)
        if t is None:
            raise ApiError(400, "quotas need tenants (none are configured)")

        def apply(eng: Any) -> tuple[int, int]:
            cut = eng.set_tenant_quota(t, body.blocks)
            return cut, int(eng.cache.tenant_usage(t))

        res = await on_engines(apply)
        worker.tenant_quotas[t] = body.blocks  # rebuilt engines get it too
        return json_response({"tenant": t, "quota_blocks": body.blocks,
                      "usage_blocks": {arm: u for arm, (_c, u) in res.items()},
                      "deleted_blocks": {arm: c for arm, (c, _u) in res.items()}})

    @router.put("/cluster")
    async def cluster(body: ClusterRequest, request: Request) -> Response:
        check(request)

        def apply(eng: Any) -> str | None:
            eng.cache.set_cluster_entropy(body.entropy_bits)
            return getattr(eng.cache.policy, "mode", None)

        modes = await on_engines(apply)
        return json_response({"entropy_bits": body.entropy_bits, "regime": modes})

    @router.post("/pin")
    async def pin(body: PinRequest, request: Request) -> Response:
        check(request)
        t = tenant_of(body.tenant)
        prompt = await server.offload(prompt_of, body)
        if len(prompt) >= server.max_model_len:
            raise ApiError(400, f"the prefix has {len(prompt)} tokens; the context length is "
                           f"{server.max_model_len}", param="prompt")
        # Prefill the prefix on every arm first (one generated token), so there is KV to pin.
        loop = asyncio.get_running_loop()
        handles = []
        for arm in worker.arms:
            h = RequestHandle(loop, f"pin-{arm}-{uuid.uuid4().hex}", arm, t, "admin_pin")
            try:
                await worker.submit(h, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
            except ValueError as e:
                raise ApiError(400, str(e)) from None
            handles.append(h)
        for h in handles:
            while not isinstance(await h.next(), Finished):
                pass
        pinned = await on_engines(lambda eng: eng.pin_prefix(prompt, t))
        return json_response({"tenant": t, "prompt_tokens": len(prompt), "pinned_tokens": pinned})

    @router.post("/unpin")
    async def unpin(body: PinRequest, request: Request) -> Response:
        check(request)
        t = tenant_of(body.tenant)
        prompt = await server.offload(prompt_of, body)
        unpinned = await on_engines(lambda eng: eng.unpin_prefix(prompt, t))
        return json_response({"tenant": t, "unpinned": unpinned})

    return router
