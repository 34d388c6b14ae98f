"""What one client may cost the server: body size, how long it may take to send a request or to read a
response, and what happens when a handler fails. Each limit has a flag (cli_args.py) and a safe default.

    BodyLimitMiddleware    413 before a body over the limit is read, 408 when a body stalls, and a send
                           that waits on a client that stopped reading ends that response (and its requests)
    InternalErrorMiddleware  any unhandled exception becomes a 500 with an OpenAI body; the connection stays
                           usable for the client's next request
    guarded_h11_protocol   uvicorn's h11 protocol with a deadline for the request head (slowloris) and TCP
                           keepalive / user timeout (half-open connections)
    cap_allocator_growth   glibc's malloc settings that keep a long-running server's RSS flat
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedllm.entrypoints.openai.errors import scoped_error_response

logger = logging.getLogger("pagedllm.server")


def replaying(body: bytes, receive: Receive) -> Receive:
    """An ASGI receive that gives the app the whole body, already read, in one message; later calls wait
    on the real receive (for the disconnect, as the app expects)."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


@dataclass(frozen=True)
class HTTPLimits:
    max_body_bytes: int = 8 * 2**20  # a 128k-token prompt is well under 1 MiB of text
    header_timeout: float = 10.0  # the whole request head (line and headers) must arrive within this
    body_timeout: float = 30.0  # the longest pause between two chunks of a request body
    keep_alive_timeout: float = 5.0  # an idle keep-alive connection is closed after this (uvicorn's)
    write_timeout: float = 60.0  # a response the client has not read from for this long is ended


class BodyLimitMiddleware:
    """Reads the request body itself, bounded in size and time, and hands it to the app whole.

    The app would read it anyway (a JSON body is parsed whole); reading it here means a body over the
    limit is refused from its Content-Length before a byte of it is read, or as soon as a chunked one
    passes the limit, and never sits in memory.
    """

    def __init__(self, app: ASGIApp, limits: HTTPLimits):
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limits.max_body_bytes
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            await self._refuse(scope, receive, send, 413, f"request body exceeds {limit} bytes")
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.limits.body_timeout)
            except asyncio.TimeoutError:
                await self._refuse(
                    scope, receive, send, 408, f"request body stalled for {self.limits.body_timeout:g} s"
                )
                return
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._refuse(scope, receive, send, 413, f"request body exceeds {limit} bytes")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, replaying(b"".join(chunks), receive), self._bounded_send(send))

    def _bounded_send(self, send: Send) -> Send:
        timeout = self.limits.write_timeout

        async def bounded(message: Message) -> None:
            # uvicorn's send waits while the client's socket buffer is full; a client that stopped
            # reading would otherwise hold its engine requests (and their KV blocks) forever.
            try:
                await asyncio.wait_for(send(message), timeout)
            except asyncio.TimeoutError:
                raise ClientStalledError(f"the client read nothing for {timeout:g} s") from None

        return bounded

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, status: int, message: str) -> None:
        # Connection: close, since the rest of the body is never read (h11 then closes after the response)
        response = scoped_error_response(scope, message, status)
        response.headers["connection"] = "close"
        await response(scope, receive, send)


class ClientStalledError(Exception):
    """Raised by a send that timed out: the client stopped reading its response."""


class InternalErrorMiddleware:
    """Outermost: a handler's unhandled exception becomes a 500 with an OpenAI body instead of reaching
    uvicorn, which would log it and close the connection, failing the client's next request on it."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking)
        except ClientStalledError as e:
            logger.warning("%s %s: %s; response ended", scope["method"], scope["path"], e)
        except Exception as e:
            logger.exception("unhandled error in %s %s", scope["method"], scope["path"])
            if not started:
                await scoped_error_response(scope, f"internal error: {e!r}", 500)(scope, receive, send)


def cap_allocator_growth(trim_every_s: float = 60.0) -> None:
    """Keep a long-running server's resident memory flat (glibc only; elsewhere nothing to do).

    glibc raises its mmap threshold each time a large block is freed, after which buffers of that size come
    from the heap and stay there when freed; it gives every thread that contends for the heap its own arena;
    and it returns free pages in the middle of a heap only when asked. Under mixed traffic (prefills of
    every length, tokenizer worker threads) RSS then climbed for minutes: a 20-minute soak grew 9% after
    its first minute. So: the threshold fixed at its ceiling (32 MiB; a lower one, 1 MiB, cost 15-20% of
    decode throughput in page faults), two arenas, and a thread that calls malloc_trim once a minute."""
    import ctypes
    import ctypes.util
    import threading

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt, malloc_trim = libc.mallopt, libc.malloc_trim  # type: ignore[union-attr]
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return
    m_mmap_threshold, m_arena_max = -3, -8  # malloc.h
    mallopt(m_mmap_threshold, 32 << 20)
    mallopt(m_arena_max, 2)

    def trim() -> None:
        while True:
            time.sleep(trim_every_s)
            malloc_trim(0)  # a few ms; releases the free pages of every arena

    threading.Thread(target=trim, name="pagedllm-malloc-trim", daemon=True).start()


def _enable_tcp_keepalive(transport: Any) -> None:
    """A peer that vanished without a FIN (a half-open connection) is found by TCP keepalive within about
    a minute and a half when idle, and by the user timeout when our data goes unacknowledged."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 90_000)  # ms
    except OSError:  # not a TCP socket (a unix socket): nothing to set
        pass


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, plus a deadline for the request head: uvicorn times out idle keep-alive
    connections but not one that sends its headers a byte at a time (slowloris), nor a new connection that
    sends nothing. The deadline runs from the first byte of a request (or from the connection's start) to
    the end of its headers; when it passes, the connection is closed."""

    header_timeout: float = HTTPLimits.header_timeout

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        _enable_tcp_keepalive(transport)
        self._head_deadline: asyncio.TimerHandle | None = None
        self._arm_head_deadline()

    def _in_request(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _arm_head_deadline(self) -> None:
        if self._head_deadline is None:
            self._head_deadline = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _cancel_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def data_received(self, data: bytes) -> None:
        if not self._in_request():
            self._arm_head_deadline()
        super().data_received(data)
        if self._in_request():
            self._cancel_head_deadline()

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if not self._in_request() and not self.transport.is_closing():
            logger.info("closing a connection whose request head took over %g s", self.header_timeout)
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_deadline()
        super().connection_lost(exc)


def guarded_h11_protocol(limits: HTTPLimits) -> type[GuardedH11Protocol]:
    """The protocol class to give uvicorn (it instantiates the class itself, so the limit is a class
    attribute of a subclass made for this server)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout": limits.header_timeout})
