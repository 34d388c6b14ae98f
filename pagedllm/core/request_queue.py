"""The scheduler's waiting queue, one class per --scheduling-policy (vLLM's v1 request_queue.py).

fcfs: arrival order; a preempted request goes back to the front. priority: the smallest key first, the
scheduler's (priority, arrival time, add order), so a preempted request goes back to its own rank.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from pagedllm.core.request import Request
from pagedllm.errors import InputError

SCHEDULING_POLICIES = ("fcfs", "priority")


class FCFSRequestQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def prepend_request(self, request: Request) -> None:
        self._queue.appendleft(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        """Put back requests taken from the front, in their order."""
        self._queue.extendleft(reversed(list(requests)))

    def peek_request(self) -> Request:
        return self._queue[0]

    def pop_request(self) -> Request:
        return self._queue.popleft()

    def remove_request(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue:
    """A heap on key(request); the key must be unique per request (the scheduler's ends in its add order)."""

    def __init__(self, key: Callable[[Request], Any]) -> None:
        self._key = key
        self._heap: list[tuple[Any, Request]] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, (self._key(request), request))

    # where a request goes back is its rank, wherever it came from
    prepend_request = add_request

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.add_request(request)

    def peek_request(self) -> Request:
        return self._heap[0][1]

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove_request(self, request: Request) -> None:
        kept = [entry for entry in self._heap if entry[1] is not request]
        if len(kept) == len(self._heap):
            raise ValueError(f"request {request.request_id!r} is not waiting")
        self._heap = kept
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In the order they would be popped."""
        return (request for _, request in sorted(self._heap, key=lambda entry: entry[0]))


RequestQueue = FCFSRequestQueue | PriorityRequestQueue


def check_scheduling_policy(policy: str) -> None:
    if policy not in SCHEDULING_POLICIES:
        raise InputError(
            f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {policy!r}",
            param="scheduling_policy",
        )


def make_request_queue(policy: str, key: Callable[[Request], Any]) -> RequestQueue:
    check_scheduling_policy(policy)
    if policy == "priority":
        return PriorityRequestQueue(key)
    return FCFSRequestQueue()
