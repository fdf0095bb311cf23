"""The Files and Batch APIs and this replica's batch runner, opened and routed together
(router.app wires them in with one app key)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass

from aiohttp import web

from router.admission.gate import Admission
from router.batch import files_api
from router.batch.api import BatchesApi
from router.batch.files_api import FilesApi
from router.batch.runner import BatchRunner
from router.batch.state import BatchStore
from router.config_reload import ConfigHolder
from router.proxy.handlers import Proxy
from worker import redis_client


@dataclass(frozen=True)
class BatchService:
    files: FilesApi
    batches: BatchesApi
    runner: BatchRunner  # run it supervised (router.app): a crash restarts it


@contextlib.asynccontextmanager
async def opened(redis_url: str, proxy: Proxy, admission: Admission | None,
                 configs: ConfigHolder, keys: Mapping[str, bytes] | None = None
                 ) -> AsyncIterator[BatchService]:
    """The service, with Redis pools of its own (closed after) and the blob store that
    `batch.storage` names (read here only: changing it takes a restart); `keys`: the
    heartbeat keys, which sign its file and batch records."""
    async with files_api.opened(redis_url, admission, configs, keys) as files:
        redis = redis_client.connect(redis_url)
        try:
            store = BatchStore(redis, redis_client.one_slot_prefix(
                configs.current.redis.key_prefix, redis_url), keys)
            yield BatchService(
                files, BatchesApi(store, files.store, admission, configs),
                BatchRunner(store, files.store, proxy, admission, configs))
        finally:
            await redis.aclose()


def add_routes(app: web.Application, key: web.AppKey[BatchService]) -> None:
    """Register the Files and Batch APIs' routes on `app` (before it starts: the service
    is opened when it does, and found at `app[key]`)."""
    files_api.add_routes(app, lambda running: running[key].files)

    def route(handler: Callable[[BatchesApi, web.Request], Awaitable[web.StreamResponse]]
              ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def serve(request: web.Request) -> web.StreamResponse:
            return await handler(request.app[key].batches, request)
        return serve

    app.router.add_post("/v1/batches", route(BatchesApi.create))
    app.router.add_get("/v1/batches", route(BatchesApi.list))
    app.router.add_get("/v1/batches/{batch_id}", route(BatchesApi.retrieve))
    app.router.add_post("/v1/batches/{batch_id}/cancel", route(BatchesApi.cancel))
