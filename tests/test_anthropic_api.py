"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) against the real server with the
default model, through the official `anthropic` SDK and langchain-anthropic's ChatAnthropic.

No test measures time: every wait is a bounded poll with a generous timeout.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from test_server import REQUEST_TIMEOUT_S, ServerInfo, running_server
from test_server_structured import TIME as OPENAI_TIME
from test_server_structured import WEATHER as OPENAI_WEATHER

pytestmark = pytest.mark.slow


def _anthropic_tool(tool: dict) -> dict:
    """A chat-completions function tool in Anthropic's form (the same schema as input_schema)."""
    fn = tool["function"]
    return {k: v for k, v in (("name", fn["name"]), ("description", fn.get("description")),
                              ("input_schema", fn["parameters"])) if v is not None}  # fmt: skip


WEATHER, TIME = _anthropic_tool(OPENAI_WEATHER), _anthropic_tool(OPENAI_TIME)
WEATHER_ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
COLORS = [{"role": "user", "content": "Name the three primary colors, then explain why."}]
# The SDK takes no temperature / top_k / top_p arguments any more: they go through extra_body, at the top
# level of the body
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerInfo]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    with running_server(
        log,
        *("--num-kv-blocks", "512", "--max-num-seqs", "8", "--max-model-len", "2048"),
        # the default model writes no think block of its own, so only a forced one is thinking
        *("--reasoning-parser", "qwen3", "--structured-outputs-config", '{"enable_in_reasoning": true}'),
    ) as info:
        yield info


@pytest.fixture(scope="module")
def client(server: ServerInfo) -> Iterator[anthropic.Anthropic]:
    c = anthropic.Anthropic(
        base_url=server.base_url, api_key=server.api_key, timeout=REQUEST_TIMEOUT_S, max_retries=0
    )
    yield c
    c.close()


def post(server: ServerInfo, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(
        server.url(path),
        json=body,
        headers={"x-api-key": server.api_key, **headers},
        timeout=REQUEST_TIMEOUT_S,
    )


def raw_events(server: ServerInfo, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(event line, data) of each server-sent event of a streamed request, checking that every data line
    has its `event:` line, naming the data's type."""
    r = post(server, "/v1/messages", {**body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in r.text.strip().split("\n\n"):
        lines = block.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: "), block
        name, data = lines[0].removeprefix("event: "), json.loads(lines[1].removeprefix("data: "))
        assert data["type"] == name
        events.append((name, data))
    return events


def text_of(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def assert_serves(client: anthropic.Anthropic, server: ServerInfo) -> None:
    """The server still answers after an error."""
    m = client.messages.create(model=server.model, max_tokens=2, messages=COLORS, **GREEDY)
    assert m.usage.output_tokens >= 1


# ---------------------------------------------------------------------------------------------- create


def test_create_streamed_equals_not_under_greedy(client: anthropic.Anthropic, server: ServerInfo) -> None:
    kwargs = dict(model=server.model, max_tokens=24, messages=COLORS, **GREEDY, system="Be brief.")
    full = client.messages.create(**kwargs)
    assert full.type == "message" and full.role == "assistant" and full.id.startswith("msg_")
    assert full.model == server.model and full.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in full.content] == ["text"] and text_of(full).strip()
    with client.messages.stream(**kwargs) as stream:
        deltas = [e.delta.text for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "".join(deltas) == text_of(final) == text_of(full)
    assert (final.stop_reason, final.stop_sequence) == (full.stop_reason, full.stop_sequence)
    assert final.usage.input_tokens == full.usage.input_tokens > 0
    assert final.usage.output_tokens == full.usage.output_tokens > 0
    # temperature went through extra_body (at 1.0, the default, two samples would differ); top_k and
    # vLLM's fields too: out of range, they are 400s naming them (test_bad_input_is_400_in_anthropic_shape)


def test_stream_event_sequence(server: ServerInfo) -> None:
    body = {"model": server.model, "max_tokens": 8, "messages": COLORS, "temperature": 0}
    events = raw_events(server, body)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    assert names[2:-2] == ["content_block_start"] + ["content_block_delta"] * (len(names) - 6) + [
        "content_block_stop"
    ]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert {d["delta"]["type"] for n, d in events if n == "content_block_delta"} == {"text_delta"}
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == 8
    # the prompt's tokens in message_start are what count_tokens and a plain create say
    counted = post(server, "/v1/messages/count_tokens", {"model": server.model, "messages": COLORS}).json()
    assert start["usage"]["input_tokens"] == counted["input_tokens"]


def test_max_tokens_stop_reason(client: anthropic.Anthropic, server: ServerInfo) -> None:
    m = client.messages.create(model=server.model, max_tokens=3, messages=COLORS, **GREEDY)
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None and m.usage.output_tokens == 3


def test_stop_sequences(client: anthropic.Anthropic, server: ServerInfo) -> None:
    kwargs = dict(model=server.model, max_tokens=24, messages=COLORS, **GREEDY)
    text = text_of(client.messages.create(**kwargs))
    words = text.split()
    assert len(words) >= 4, text
    stop = " " + words[2]  # a word in the middle of the greedy answer
    cut = text[: text.index(stop)]
    m = client.messages.create(**kwargs, stop_sequences=["never appears", stop])
    assert (m.stop_reason, m.stop_sequence, text_of(m)) == ("stop_sequence", stop, cut)
    with client.messages.stream(**kwargs, stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, text_of(final)) == ("stop_sequence", stop, cut)


def test_prefill_is_continued(client: anthropic.Anthropic, server: ServerInfo) -> None:
    prefill = "The three primary colors are red,"
    m = client.messages.create(
        model=server.model,
        max_tokens=6,
        **GREEDY,
        messages=COLORS + [{"role": "assistant", "content": prefill}],
    )
    # what the chat path gives for the same continued (not closed) assistant turn
    chat = httpx.post(
        server.url("/v1/chat/completions"),
        json={"model": server.model, "max_tokens": 6, "temperature": 0, "add_generation_prompt": False,
              "continue_final_message": True, "messages": COLORS + [{"role": "assistant", "content": prefill}]},
        headers=server.headers, timeout=REQUEST_TIMEOUT_S,
    ).json()  # fmt: skip
    assert text_of(m) == chat["choices"][0]["message"]["content"] and text_of(m)
    assert m.usage.input_tokens == chat["usage"]["prompt_tokens"]


# a think block and an answer forced by a regex constraint (words bounded: an unbounded [a-z]+ lets the
# small model run one word on to max_tokens)
THINK = r"[a-z]{1,10}( [a-z]{1,10}){1,5}"
ANSWER = r"[A-Z][a-z]{1,10}( [a-z]{1,10}){1,5}\."


def test_thinking_block_from_the_reasoning_parser_streamed_and_not(
    client: anthropic.Anthropic, server: ServerInfo
) -> None:
    ask = [{"role": "user", "content": "Is the sky blue? Think first, then answer."}]
    forced = {"temperature": 0, "structured_outputs": {"regex": "<think>" + THINK + "</think>" + ANSWER}}
    common = dict(model=server.model, max_tokens=80, messages=ask, extra_body=forced)
    m = client.messages.create(**common, thinking={"type": "disabled"})  # accepted; the regex forces a block
    assert [b.type for b in m.content] == ["thinking", "text"] and m.stop_reason == "end_turn"
    thinking, answer = m.content[0].thinking, m.content[1].text
    assert re.fullmatch(THINK, thinking) and re.fullmatch(ANSWER, answer)
    chat = httpx.post(
        server.url("/v1/chat/completions"),
        json={"model": server.model, "max_tokens": 80, "messages": ask, **forced},
        headers=server.headers,
        timeout=REQUEST_TIMEOUT_S,
    ).json()["choices"][0]["message"]
    assert (chat["reasoning_content"], chat["content"]) == (thinking, answer)
    with client.messages.stream(**common) as stream:
        deltas = [e.delta for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == thinking
    assert "".join(d.text for d in deltas if d.type == "text_delta") == answer
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert (final.content[0].thinking, final.content[1].text) == (thinking, answer)
    # a thinking budget is taken (max_reasoning_tokens on the chat path); this model writes no think block
    budget = client.messages.create(
        model=server.model,
        max_tokens=8,
        messages=ask,
        thinking={"type": "enabled", "budget_tokens": 4},
        **GREEDY,
    )
    assert budget.stop_reason in ("end_turn", "max_tokens") and budget.usage.output_tokens >= 1


# ---------------------------------------------------------------------------------------------- tools


def test_named_tool_gives_a_valid_tool_use(client: anthropic.Anthropic, server: ServerInfo) -> None:
    kwargs = dict(
        model=server.model, max_tokens=80, messages=WEATHER_ASK, tools=[WEATHER, TIME], **GREEDY,
        tool_choice={"type": "tool", "name": "get_weather"},
    )  # fmt: skip
    m = client.messages.create(**kwargs)
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER["input_schema"])
    with client.messages.stream(**kwargs) as stream:
        partial = "".join(e.delta.partial_json for e in stream if e.type == "content_block_delta")
        final = stream.get_final_message()
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and streamed.name == "get_weather"
    assert streamed.input == use.input == json.loads(partial)


def test_tool_choice_any_and_a_tool_result_round_trip(
    client: anthropic.Anthropic, server: ServerInfo
) -> None:
    m = client.messages.create(
        model=server.model, max_tokens=80, messages=WEATHER_ASK, tools=[WEATHER, TIME], **GREEDY,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )  # fmt: skip
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(uses) == 1
    schema = {"get_weather": WEATHER, "get_time": TIME}[uses[0].name]["input_schema"]
    jsonschema.validate(uses[0].input, schema)
    history = WEATHER_ASK + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": uses[0].id, "content": '{"temperature": 21, "sky": "clear"}'},
            {"type": "text", "text": "Answer in one sentence."},
        ]},
    ]  # fmt: skip
    reply = client.messages.create(
        model=server.model, max_tokens=12, messages=history, tools=[WEATHER], tool_choice={"type": "none"}
    )
    assert reply.stop_reason in ("end_turn", "max_tokens") and text_of(reply)
    assert not [b for b in reply.content if b.type == "tool_use"]
    # the result is in the prompt: the conversation counts more tokens than it without the result
    without = history[:-1] + [{"role": "user", "content": "Answer in one sentence."}]
    none = {"tools": [WEATHER], "tool_choice": {"type": "none"}}  # tools not offered: not in the prompt
    count = client.messages.count_tokens(model=server.model, messages=history, **none).input_tokens
    assert count == reply.usage.input_tokens
    assert count > client.messages.count_tokens(model=server.model, messages=without, **none).input_tokens


def test_count_tokens_equals_usage(client: anthropic.Anthropic, server: ServerInfo) -> None:
    for extra in ({}, {"system": [{"type": "text", "text": "You are terse."}]}, {"tools": [WEATHER]}):
        counted = client.messages.count_tokens(model=server.model, messages=COLORS, **extra)
        m = client.messages.create(model=server.model, max_tokens=1, messages=COLORS, **extra)
        assert counted.input_tokens == m.usage.input_tokens > 0, extra
    # tools are part of the prompt
    assert client.messages.count_tokens(model=server.model, messages=COLORS, tools=[WEATHER]).input_tokens > (
        client.messages.count_tokens(model=server.model, messages=COLORS).input_tokens
    )


# ---------------------------------------------------------------------------------------------- errors, auth


BAD = [
    ({"messages": COLORS}, "max_tokens"),  # required
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "nope", "text": "x"}]}]}, "'nope'"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ({"max_tokens": 0, "messages": COLORS}, "max_tokens"),
    ({"max_tokens": 4, "messages": COLORS, "stop": ["x"]}, "stop_sequences"),
    ({"max_tokens": 4, "messages": COLORS, "min_p": 5}, "min_p"),  # a passed-through field, checked
    ({"max_tokens": 4, "messages": COLORS, "top_k": 10**9}, "top_k"),
    ({"max_tokens": 4, "messages": COLORS, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "web_search_20250305"),
    ({"max_tokens": 4, "messages": COLORS, "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"max_tokens": 4, "messages": COLORS, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
     "nope"),
    ({"max_tokens": 4, "messages": COLORS, "container": "c-1"}, "container"),
    # a budget with a constraint over the whole output (this server's enable_in_reasoning)
    ({"max_tokens": 4, "messages": COLORS, "thinking": {"type": "enabled", "budget_tokens": 1024},
      "structured_outputs": {"regex": "[a-z]+"}}, "thinking.budget_tokens"),
    ({"max_tokens": 4000, "messages": COLORS}, "context length"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "named"), BAD)
def test_bad_input_is_400_in_anthropic_shape(
    client: anthropic.Anthropic, server: ServerInfo, body: dict[str, Any], named: str
) -> None:
    r = post(server, "/v1/messages", {"model": server.model, **body})
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert named in error["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):  # the SDK raises it as Anthropic's error
        client.post("/v1/messages", cast_to=object, body={"model": server.model, **body})
    assert_serves(client, server)


def test_auth_model_and_route_errors(client: anthropic.Anthropic, server: ServerInfo) -> None:
    body = {"model": server.model, "max_tokens": 2, "messages": COLORS}
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0).messages.create(**body)
    assert e.value.body["error"]["type"] == "authentication_error"
    # Authorization: Bearer works as well as x-api-key
    bearer = anthropic.Anthropic(base_url=server.base_url, auth_token=server.api_key, max_retries=0)
    assert bearer.messages.create(**body).usage.output_tokens >= 1
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(**{**body, "model": "claude-nope"})
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    # a streamed request refused before it starts is a plain error response, not a stream
    r = post(
        server, "/v1/messages", {**body, "stream": True, "messages": [{"role": "user", "content": [{}]}]}
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert_serves(client, server)


def test_openapi_documents_the_routes(server: ServerInfo) -> None:
    doc = httpx.get(server.url("/openapi.json"), headers={"x-api-key": server.api_key}, timeout=30).json()
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        responses = doc["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "404", "500", "503"} <= set(responses), path
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "AnthropicErrorResponse"
        )
    assert "text/event-stream" in doc["paths"]["/v1/messages"]["post"]["responses"]["200"]["content"]


# ---------------------------------------------------------------------------------------------- langchain


def test_langchain_chat_anthropic_invoke_and_bind_tools(server: ServerInfo) -> None:
    from langchain_anthropic import ChatAnthropic

    llm = ChatAnthropic(
        model=server.model, base_url=server.base_url, api_key=server.api_key, **GREEDY, max_tokens=60,
        max_retries=0, timeout=REQUEST_TIMEOUT_S,
    )  # fmt: skip
    reply = llm.invoke("Name one primary color.")
    assert isinstance(reply.content, str) and reply.content.strip()
    assert reply.response_metadata["stop_reason"] in ("end_turn", "max_tokens")
    assert reply.usage_metadata["input_tokens"] > 0 and reply.usage_metadata["output_tokens"] > 0

    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return "sunny"

    for choice in ("get_weather", "any"):
        message = llm.bind_tools([get_weather], tool_choice=choice).invoke("What is the weather in Paris?")
        (call,) = message.tool_calls
        assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
        assert message.response_metadata["stop_reason"] == "tool_use"
