"""KVPublisher: ships KVCacheView snapshots from the engine's thread to the pages watching, at a bounded rate.

AsyncEngine owns one. Subscribing and unsubscribing are commands the engine's thread applies, so the view
is opened (LLMEngine.open_kv_view) when the first page arrives and closed when the last one leaves: with
nobody watching, the engine records nothing and the loop pays one truth test per iteration. While pages
watch, `tick()` runs between steps and takes a snapshot when something happened (a step ran or a command
changed the requests) and MIN_INTERVAL_S has passed since the last one, so a fast engine is drawn at
10 Hz at most and an idle one not at all; a snapshot that takes long (a huge pool) spaces the next ones
out so that snapshots never take more than MAX_SHARE of the engine thread.

Each page has a KVSubscription on its own event loop holding only the newest snapshot: a page that reads
slowly skips snapshots (each is the whole picture) but keeps their events, merged into the next one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

logger = logging.getLogger(__name__)

MIN_INTERVAL_S = 0.1  # at most 10 snapshots a second
MAX_SHARE = 0.1  # and never more than this share of the engine thread's time (huge pools space them out)
MAX_MERGED_EVENTS = 500  # events a slow page keeps across skipped snapshots


class KVViewUnavailable(RuntimeError):
    """This engine publishes no KV cache view (a stand-in engine, or data-parallel replicas)."""


class KVSubscription:
    """One watcher's mailbox, on its event loop: the newest snapshot, or None once the stream has ended."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._latest: dict[str, Any] | None = None
        self._ready = asyncio.Event()
        self.ended = False

    def offer(self, snapshot: dict[str, Any] | None) -> None:
        """On the watcher's loop: keep the newest snapshot (its events after the skipped ones'); None ends."""
        if snapshot is None:
            self.ended = True
        elif self._latest is not None:
            merged = [*self._latest["events"], *snapshot["events"]][-MAX_MERGED_EVENTS:]
            self._latest = {**snapshot, "events": merged}
        else:
            self._latest = snapshot
        self._ready.set()

    async def next(self, timeout: float) -> dict[str, Any] | None:
        """The next snapshot; None after `timeout` s without one (or once ended: check `ended`)."""
        if self._latest is None and not self.ended:
            try:
                await asyncio.wait_for(self._ready.wait(), timeout)
            except asyncio.TimeoutError:
                return None
        self._ready.clear()
        snapshot, self._latest = self._latest, None
        return snapshot


class KVPublisher:
    """The engine-thread side: who watches, when the last snapshot went, the view while anyone watches."""

    def __init__(self, engine: Any, min_interval_s: float = MIN_INTERVAL_S):
        self.engine = engine
        self.min_interval_s = min_interval_s
        self._subs: list[KVSubscription] = []
        self._view: Any = None
        self._last_time = 0.0
        self._interval = min_interval_s  # grows when a snapshot is slow (MAX_SHARE)
        self._last_step = -1
        self._touched = False
        self.seq = 0  # snapshots taken so far; the page shows it, tests wait on it

    @property
    def supported(self) -> bool:
        return hasattr(self.engine, "open_kv_view")

    @property
    def active(self) -> bool:
        return bool(self._subs)

    def view(self) -> Any:
        """The open view, opening one when nobody watches yet (closed again by the next remove)."""
        if not self.supported:
            raise KVViewUnavailable("this engine publishes no KV cache view")
        if self._view is None:
            self._view = self.engine.open_kv_view()
        return self._view

    def add(self, sub: KVSubscription) -> None:
        """A new watcher; it (and everyone else: a snapshot's events go to all) gets a snapshot at once."""
        self.view()
        self._subs.append(sub)
        self.publish()

    def remove(self, sub: KVSubscription) -> None:
        if sub in self._subs:
            self._subs.remove(sub)
        self.release_if_unwatched()

    def release_if_unwatched(self) -> None:
        """Close the view when nobody watches (one a single call opened, or the last watcher's)."""
        if not self._subs and self._view is not None:
            self.engine.close_kv_view()
            self._view = None

    def touch(self) -> None:
        """Something other than a step changed the requests (an add, an abort): worth a snapshot."""
        self._touched = True

    def tick(self) -> None:
        """Between steps: a snapshot to every watcher if one is due."""
        if not self._subs:
            return
        now = time.monotonic()
        changed = self._touched or self._view.log.step != self._last_step
        if changed and now - self._last_time >= self._interval:
            self.publish()

    def publish(self) -> int:
        """Take a snapshot now and offer it to every watcher; returns its seq."""
        view = self.view()
        start = time.monotonic()
        snapshot = view.snapshot()
        self.seq += 1
        snapshot["seq"] = self.seq
        self._last_time, self._last_step, self._touched = time.monotonic(), view.log.step, False
        self._interval = max(self.min_interval_s, (self._last_time - start) / MAX_SHARE)
        for sub in list(self._subs):
            self._send(sub, snapshot)
        return self.seq

    def _send(self, sub: KVSubscription, snapshot: dict[str, Any] | None) -> None:
        try:
            sub.loop.call_soon_threadsafe(sub.offer, snapshot)
        except RuntimeError:  # its event loop is closed: nobody reads it any more
            self.remove(sub)

    def close_all(self) -> None:
        """The engine stops: end every watcher's stream."""
        for sub in list(self._subs):
            self._send(sub, None)
            self.remove(sub)
