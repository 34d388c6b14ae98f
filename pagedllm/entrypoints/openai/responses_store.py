"""Stored Responses (`store: true`, the default): what GET /v1/responses/{id} returns and what
`previous_response_id` continues from, in memory, least recently used first out.

Bounded both in entries and in bytes of their JSON: a chain of turns stores each turn's whole conversation
again (it is what the next turn prepends), so a count alone would not bound the memory. Nothing survives
a restart, as OpenAI's own docs allow for (stored responses may expire).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.openai.protocol_responses import ResponseObject

DEFAULT_MAX_ENTRIES = 1024
DEFAULT_MAX_BYTES = 64 << 20


@dataclass
class StoredResponse:
    response: ResponseObject
    # the conversation before this response's output, as chat messages (instructions excluded: OpenAI
    # does not carry them over to a continuation)
    messages: list[dict[str, Any]]
    size: int  # bytes of JSON, the store's measure


class ResponsesStore:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: ResponseObject, messages: list[dict[str, Any]]) -> None:
        size = len(response.model_dump_json()) + len(json.dumps(messages))
        self.delete(response.id)
        self._entries[response.id] = StoredResponse(response, messages, size)
        self._bytes += size
        # the newest entry stays even when it alone is over max_bytes: it is the one about to be continued
        while len(self._entries) > 1 and (
            len(self._entries) > self.max_entries or self._bytes > self.max_bytes
        ):
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.size

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._bytes -= entry.size
        return True
