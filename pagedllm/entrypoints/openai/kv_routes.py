"""/kv: the paged KV cache, live. The page, its event stream and the block details its hover asks for.

    GET /kv                   the page (static/kv.html); ?request=ID selects that request's rows
    GET /kv/events            server-sent events: one KVCacheView snapshot (JSON) per message, 10 Hz at most
    GET /kv/blocks/{id}       one block: state, ref_cnt, hash, holders, token ids and their text
    POST /kv/debug/hold       test-only (--kv-debug-routes): stop or resume stepping, with the KVCacheManager's
                              own state at that instant

Everything here goes through the EngineClient's KV members (watch_kv, kv_block, hold_steps; AsyncEngine runs
them on the engine's thread between steps); nothing here touches the scheduler. An engine without a view
(data-parallel replicas, each with its own pool) gets a 409 that says so, on every route.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from pagedllm.engine.protocol import EngineClient
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.pages import check_query, page

KEEP_ALIVE_S = 15.0  # an SSE comment this often on an idle engine, so proxies keep the stream open
NO_PARAMS: frozenset[str] = frozenset()


def check_view(engine: EngineClient) -> None:
    """409 unless this engine publishes a KV cache view."""
    if engine.publishes_kv_view:
        return
    labels = engine.replica_labels
    if labels is not None:
        raise APIError(
            f"/kv shows one engine's KV cache, and this server runs {len(labels)} data-parallel replicas, "
            "each with its own pool; serve without --data-parallel-size to watch it",
            status=409,
        )
    raise APIError("this engine publishes no KV cache view for /kv", status=409)


async def snapshots(engine: EngineClient) -> AsyncIterator[str]:
    """The SSE body: the page's subscription lives exactly as long as this generator (the page leaving,
    or pausing, closes the connection; Starlette then cancels us and `finally` unsubscribes)."""
    sub = await engine.watch_kv()
    try:
        yield "retry: 1000\n\n"
        while True:
            snapshot = await sub.next(timeout=KEEP_ALIVE_S)
            if snapshot is not None:
                yield f"data: {json.dumps(snapshot, separators=(',', ':'))}\n\n"
            elif sub.ended:  # the engine is shutting down
                return
            else:
                yield ": keep-alive\n\n"
    finally:
        engine.unwatch_kv(sub)


def add_kv_routes(app: FastAPI, engine: EngineClient, *, debug_routes: bool = False) -> None:
    """The /kv routes; debug_routes adds POST /kv/debug/hold (tests only: it stops the engine)."""

    @app.get("/kv", include_in_schema=False)
    async def kv_page(raw: Request) -> Response:
        check_query(raw, frozenset({"api_key", "request"}))
        check_view(engine)
        return page("kv.html")

    @app.get("/kv/events", include_in_schema=False)
    async def kv_events(raw: Request) -> Response:
        check_query(raw, NO_PARAMS)
        check_view(engine)
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(snapshots(engine), media_type="text/event-stream", headers=headers)

    @app.get("/kv/blocks/{block_id}", include_in_schema=False)
    async def kv_block(block_id: int, raw: Request) -> dict[str, Any]:
        check_query(raw, NO_PARAMS)
        check_view(engine)
        info = await engine.kv_block(block_id)
        ids = info["token_ids"]
        decode = engine.tokenizer.decode
        info["text"] = (
            None if ids is None else await asyncio.to_thread(decode, ids, skip_special_tokens=False)
        )
        return info

    if not debug_routes:
        return

    @app.post("/kv/debug/hold", include_in_schema=False)
    async def kv_hold(hold: bool, raw: Request) -> dict[str, Any]:
        check_query(raw, frozenset({"hold"}))
        check_view(engine)
        return await engine.hold_steps(hold)
