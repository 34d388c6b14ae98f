"""The models of a server of several models and their lifecycle: unloaded -> loading -> loaded -> unloaded.

Each loaded model is a whole one-model server in-process (its own engine, KV cache, metrics and FastAPI
app, built by the `load` callable server.py passes in, so this file needs nothing above it). The registry
decides when to load (a request names an unloaded model: loaded in a worker thread while the other models
keep serving), when to unload (--max-loaded-models: the least recently used with nothing in flight;
--idle-unload-s: idle that long) and gives the memory back when it does.

Everything here runs on the server's event loop (one thread), so the states need no lock; only the load
itself and the memory release run in worker threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pagedllm.entrypoints.openai.model_specs import ModelSpec

logger = logging.getLogger("pagedllm.server")

ModelState = Literal["unloaded", "loading", "loaded"]


@dataclass
class LoadedModel:
    """What `load` returns: a one-model server's app, its engine (an EngineClient) and its ServerMetrics."""

    app: Any
    engine: Any
    metrics: Any


@dataclass
class ModelEntry:
    spec: ModelSpec
    state: ModelState = "unloaded"
    loaded: LoadedModel | None = None
    last_used: float = 0.0  # time.monotonic() of the last request's start or end
    in_flight: int = 0  # requests routed to it and not yet answered (never unloaded while > 0)
    reserved: bool = False  # loading, with its place under --max-loaded-models already made
    loading: asyncio.Task | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.spec.name


class ModelLoadTimeout(Exception):
    """The model is still loading after --load-timeout-s; the request gets 503 with Retry-After."""

    def __init__(self, name: str, timeout: float):
        super().__init__(
            f"the model `{name}` is loading and was not ready within {timeout:g} s; retry in a moment"
        )


def _clear_fastapi_caches() -> None:
    """FastAPI (0.16x) classifies each route's endpoint in module-level lru_caches keyed by the endpoint
    function; our endpoints are closures over the model's engine, so those caches alone would keep an
    unloaded model's weights and KV pool alive. Clearing them only costs a re-classification per route."""
    try:
        from fastapi.dependencies import models
    except ImportError:
        return
    for value in vars(models).values():
        if callable(getattr(value, "cache_clear", None)):
            value.cache_clear()


def release_memory() -> None:
    """Collect the dropped engine's cycles, then ask glibc to return freed heap pages to the OS (without
    malloc_trim the RSS of a process that freed a model's weights and KV pool barely moves)."""
    _clear_fastapi_caches()
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class ModelRegistry:
    def __init__(
        self,
        specs: list[ModelSpec],
        load: Callable[[ModelSpec], LoadedModel],
        *,
        load_timeout_s: float,
        max_loaded_models: int | None = None,
        idle_unload_s: float | None = None,
        shutdown_timeout: float = 10.0,
    ):
        self.entries = {spec.name: ModelEntry(spec) for spec in specs}
        self.default = specs[0].name  # for requests that name no model
        self._load = load
        self.load_timeout_s = load_timeout_s
        self.max_loaded_models = max_loaded_models
        self.idle_unload_s = idle_unload_s
        self.shutdown_timeout = shutdown_timeout
        self._reaper: asyncio.Task | None = None
        self._running = True

    # ------------------------------------------------------------------ any thread, before serving

    def preload(self, name: str) -> None:
        """Load a model synchronously (the server's start-up thread, before the event loop routes here)."""
        entry = self.entries[name]
        entry.loaded = self._load(entry.spec)
        entry.state = "loaded"
        entry.last_used = time.monotonic()

    # ------------------------------------------------------------------ event loop

    @property
    def is_running(self) -> bool:
        return self._running

    def start(self) -> None:
        """Start the idle reaper on the running loop (once)."""
        if self._reaper is None and self.idle_unload_s is not None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap_idle())

    def get(self, name: str) -> ModelEntry | None:
        return self.entries.get(name)

    def loaded(self) -> dict[str, LoadedModel]:
        return {n: e.loaded for n, e in self.entries.items() if e.state == "loaded" and e.loaded is not None}

    async def acquire(self, entry: ModelEntry) -> LoadedModel:
        """The loaded model for one request (loading it first if need be); pair with release()."""
        entry.in_flight += 1
        entry.last_used = time.monotonic()
        try:
            if entry.state != "loaded":
                if entry.loading is None:
                    entry.loading = asyncio.get_running_loop().create_task(self._load_entry(entry))
                try:
                    await asyncio.wait_for(asyncio.shield(entry.loading), self.load_timeout_s)
                except asyncio.TimeoutError:
                    raise ModelLoadTimeout(entry.name, self.load_timeout_s) from None
            assert entry.loaded is not None
            return entry.loaded
        except BaseException:
            self.release(entry)
            raise

    def release(self, entry: ModelEntry) -> None:
        entry.in_flight -= 1
        entry.last_used = time.monotonic()

    async def _load_entry(self, entry: ModelEntry) -> None:
        entry.state = "loading"
        try:
            await self._make_room(entry)
            logger.info("loading model %s (%s)", entry.name, entry.spec.path)
            t0 = time.monotonic()
            loaded = await asyncio.to_thread(self._load, entry.spec)
            if not self._running:  # the server stopped while it loaded
                await loaded.engine.shutdown(timeout=1.0)
                raise RuntimeError("the server is shutting down")
            entry.loaded, entry.state = loaded, "loaded"
            entry.last_used = time.monotonic()
            logger.info("loaded model %s in %.1f s", entry.name, entry.last_used - t0)
        except BaseException:
            entry.state = "unloaded"
            raise
        finally:
            entry.loading, entry.reserved = None, False

    async def _make_room(self, entry: ModelEntry) -> None:
        """With --max-loaded-models, unload least recently used models (nothing in flight) until `entry`
        fits; waits while every loaded model is busy (the request's own load timeout bounds the wait)."""
        limit = self.max_loaded_models
        while limit is not None:
            # a model still waiting for room does not count, or two loads could wait on each other forever
            others = [
                e for e in self.entries.values() if e is not entry and (e.state == "loaded" or e.reserved)
            ]
            if len(others) < limit:
                entry.reserved = True
                return
            idle = [e for e in others if e.state == "loaded" and e.in_flight == 0]
            if idle:
                await self.unload(min(idle, key=lambda e: e.last_used), why="--max-loaded-models")
            else:
                await asyncio.sleep(0.1)

    async def unload(self, entry: ModelEntry, why: str) -> None:
        """Shut the model's engine down, drop every reference to it and give its memory back."""
        loaded, entry.loaded, entry.state = entry.loaded, None, "unloaded"
        if loaded is None:
            return
        logger.info("unloading model %s (%s)", entry.name, why)
        engine = loaded.engine
        del loaded
        try:
            await engine.shutdown(timeout=self.shutdown_timeout)
        except Exception:
            logger.exception("shutting down model %s failed", entry.name)
        del engine
        await asyncio.to_thread(release_memory)

    async def _reap_idle(self) -> None:
        assert self.idle_unload_s is not None
        period = min(1.0, self.idle_unload_s / 4)
        while self._running:
            await asyncio.sleep(period)
            now = time.monotonic()
            for entry in list(self.entries.values()):
                idle = now - entry.last_used
                if entry.state == "loaded" and entry.in_flight == 0 and idle >= self.idle_unload_s:
                    await self.unload(entry, why=f"idle {idle:.0f} s")

    async def shutdown(self, timeout: float = 10.0) -> None:
        """The server's drain: every loaded engine drains and stops, concurrently."""
        self._running = False
        if self._reaper is not None:
            self._reaper.cancel()
        engines = [e.loaded.engine for e in self.entries.values() if e.loaded is not None]
        await asyncio.gather(
            *(engine.shutdown(timeout=timeout) for engine in engines), return_exceptions=True
        )
