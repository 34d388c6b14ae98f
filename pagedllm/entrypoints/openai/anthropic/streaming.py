"""The chat path's stream (chat.completion.chunk events) as Anthropic's Messages events.

    message_start, ping,
    then per content block: content_block_start, content_block_delta (thinking_delta / text_delta /
    input_json_delta) ..., content_block_stop,
    message_delta (stop_reason, stop_sequence, usage), message_stop

Every event has its `event:` line (the SDKs dispatch on it), and a failure mid-stream is an `error` event.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from pagedllm.entrypoints.openai.anthropic.protocol import (
    MessagesResponse,
    Usage,
    anthropic_id,
    error_body,
    stop_reason,
)


def sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


class _Blocks:
    """The content blocks sent so far: which one is open (its key), and its index."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None

    def stop(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [sse({"type": "content_block_stop", "index": self.index})]

    def start(self, key: str, block: dict[str, Any]) -> list[str]:
        """Open block `key`, closing the one before."""
        events = self.stop()
        self.index += 1
        self.open = key
        return events + [sse({"type": "content_block_start", "index": self.index, "content_block": block})]

    def delta(self, key: str, block: dict[str, Any], delta: dict[str, Any]) -> list[str]:
        """A delta of block `key`, opening it first when it is not the open one."""
        events = self.start(key, block) if self.open != key else []
        return events + [sse({"type": "content_block_delta", "index": self.index, "delta": delta})]


async def message_events(
    chunks: AsyncIterator[str],
    model: str,
    num_prompt_tokens: int,
    stop_sequences: list[str] | None,
    single_call: bool,
) -> AsyncIterator[str]:
    """single_call: keep only the first tool call (disable_parallel_tool_use with tool_choice auto)."""
    start = MessagesResponse(
        model=model,
        content=[],
        stop_reason=None,
        usage=Usage(input_tokens=num_prompt_tokens, output_tokens=0),
    )
    yield sse({"type": "message_start", "message": start.model_dump()})
    yield sse({"type": "ping"})
    blocks = _Blocks()
    tool_blocks: dict[int, dict[str, Any]] = {}  # chat tool call index -> its tool_use block
    finish_reason: str | None = None
    matched: Any = None
    output_tokens = 0
    try:
        async for raw in chunks:
            data = raw.removeprefix("data: ").strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:  # the engine failed mid-request
                error = chunk["error"]
                yield sse(error_body(error["message"], error.get("code") or 500))
                return
            if chunk.get("usage"):
                output_tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                delta = choice["delta"]
                events: list[str] = []
                if delta.get("reasoning_content"):  # with --reasoning-parser
                    thinking = {"type": "thinking_delta", "thinking": delta["reasoning_content"]}
                    events += blocks.delta(
                        "thinking", {"type": "thinking", "thinking": "", "signature": ""}, thinking
                    )
                if delta.get("content"):
                    text = {"type": "text_delta", "text": delta["content"]}
                    events += blocks.delta("text", {"type": "text", "text": ""}, text)
                for call in delta.get("tool_calls") or []:
                    i = call["index"]
                    if single_call and i > 0:
                        continue
                    if call.get("id"):  # the call's header: its name is complete
                        name = call["function"]["name"]
                        tool_blocks[i] = {
                            "type": "tool_use",
                            "id": anthropic_id("toolu"),
                            "name": name,
                            "input": {},
                        }
                        events += blocks.start(f"tool {i}", tool_blocks[i])
                    arguments = call["function"].get("arguments")
                    if arguments:
                        partial = {"type": "input_json_delta", "partial_json": arguments}
                        events += blocks.delta(f"tool {i}", tool_blocks[i], partial)
                if choice.get("finish_reason"):
                    finish_reason, matched = choice["finish_reason"], choice.get("stop_reason")
                for event in events:
                    yield event
    finally:
        await chunks.aclose()  # a client that left: the chat stream aborts its engine request
    for event in blocks.stop():
        yield event
    reason = stop_reason(finish_reason, matched, stop_sequences)
    yield sse(
        {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": matched if reason == "stop_sequence" else None},
            "usage": {"input_tokens": num_prompt_tokens, "output_tokens": output_tokens},
        }
    )
    yield sse({"type": "message_stop"})
