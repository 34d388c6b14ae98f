"""OpenAI's Responses API (POST /v1/responses, GET / DELETE /v1/responses/{id}) on the real server with the
default model, through the official `openai` client: the same text as chat completions under greedy,
streamed events in the order the SDK's stream helper checks, text.format json_schema, a named function
call, previous_response_id, stored responses, max_output_tokens giving `incomplete`, and bad inputs."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
from test_server import REQUEST_TIMEOUT_S, running_server
from test_server_structured import WEATHER as CHAT_WEATHER

from pagedllm.entrypoints.openai.protocol_responses import ResponseObject
from pagedllm.entrypoints.openai.responses_store import ResponsesStore
from pagedllm.entrypoints.openai.serving_responses import input_messages

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """The real server with the default model (SmolLM2-135M), one per module, splitting think blocks."""
    log = tmp_path_factory.mktemp("responses") / "server.log"
    with running_server(
        log,
        *("--num-kv-blocks", "256", "--max-num-seqs", "8", "--max-model-len", "1024"),
        # no prefix caching: tests compare a response's greedy tokens with chat completions' on the same
        # conversation, which holds only where both compute the prompt alike (at the amx tier a cache hit
        # leaves the last few prompt tokens to the int8 gemv where a whole prompt runs the bf16 AMX tiles)
        "--no-prefix-caching",
        # the default model writes no think block of its own, so only a forced one is reasoning
        *("--reasoning-parser", "qwen3", "--structured-outputs-config", '{"enable_in_reasoning": true}'),
    ) as info:
        yield info


@pytest.fixture
def client(server) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(
        base_url=server.url("/v1"), api_key=server.api_key, timeout=REQUEST_TIMEOUT_S, max_retries=0
    )
    yield c
    c.close()


QUESTION = "What is the capital of France? Answer in one short sentence."
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}
# the chat tests' tool, as the Responses API defines a function tool (its fields at the top level)
WEATHER = {"type": "function", **CHAT_WEATHER["function"]}
# the lifecycle events of one message, in the order openai's ResponseStreamState requires
MESSAGE_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def chat_text(client: openai.OpenAI, model: str, messages: list[dict], max_tokens: int) -> tuple[str, str]:
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content, r.choices[0].finish_reason


def collapsed(types: list[str]) -> list[str]:
    """Event types with runs of the same type (the deltas) kept once."""
    return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t]


def test_output_text_equals_chat_completions_under_greedy(client, server):
    r = client.responses.create(
        model=server.model, input=QUESTION, instructions="Be brief.", max_output_tokens=24, temperature=0
    )
    text, finish = chat_text(
        client,
        server.model,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}],
        24,
    )
    assert r.id.startswith("resp_") and r.object == "response" and r.model == server.model
    assert r.output_text == text and text
    assert r.status == ("incomplete" if finish == "length" else "completed")
    assert [item.type for item in r.output] == ["message"]
    assert r.output[0].role == "assistant" and r.output[0].content[0].type == "output_text"
    assert r.instructions == "Be brief." and r.max_output_tokens == 24 and r.temperature == 0
    assert r.usage.output_tokens >= 1 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_streamed_deltas_equal_the_final_text(client, server):
    whole = client.responses.create(model=server.model, input=QUESTION, max_output_tokens=24, temperature=0)
    events = []
    with client.responses.stream(
        model=server.model, input=QUESTION, max_output_tokens=24, temperature=0
    ) as stream:
        for event in stream:
            events.append(event)
        final = stream.get_final_response() if whole.status == "completed" else None
    types = [e.type for e in events]
    last = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert collapsed(types) == [*MESSAGE_EVENTS, last]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    assert next(e for e in events if e.type == "response.output_text.done").text == deltas
    done = events[-1].response
    assert done.output_text == deltas and done.status == whole.status
    assert done.usage.output_tokens == whole.usage.output_tokens
    assert len({e.response.id for e in events if hasattr(e, "response")}) == 1
    if final is not None:
        assert final.output_text == deltas
    # stored as it completed
    assert client.responses.retrieve(done.id).output_text == deltas


def test_json_schema_format_validates(client, server):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    r = client.responses.create(
        model=server.model,
        input="Describe Bob, a 30-year-old teacher, as JSON.",
        text={"format": fmt},
        max_output_tokens=60,
        temperature=0,
    )
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema"
    obj = client.responses.create(
        model=server.model,
        input='Reply with a JSON object whose one key, "name", is "Tom".',
        text={"format": {"type": "json_object"}},
        max_output_tokens=60,
        temperature=0,
    )
    assert obj.status == "completed" and isinstance(json.loads(obj.output_text), dict)


def test_named_function_call_streamed_and_not(client, server):
    common = dict(
        model=server.model,
        input="What is the weather like in Paris today?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
        temperature=0,
    )
    r = client.responses.create(**common)
    assert r.status == "completed"
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert r.tools[0].name == "get_weather"

    with client.responses.stream(**common) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = collapsed([e.type for e in events])
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == call.arguments == final.output[0].arguments

    # the tool's answer goes back as a function_call_output item continuing the response
    after = client.responses.create(
        model=server.model,
        previous_response_id=r.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 21}'}],
        max_output_tokens=16,
        temperature=0,
    )
    # the same as chat completions over the conversation (tools are not carried over: they are per request)
    call_message = {
        "role": "assistant",
        "tool_calls": [
            {
                "id": call.call_id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
        ],
    }
    text, _ = chat_text(
        client,
        server.model,
        [
            {"role": "user", "content": common["input"]},
            call_message,
            {"role": "tool", "tool_call_id": call.call_id, "content": '{"temp_c": 21}'},
        ],
        16,
    )
    assert after.output_text == text and text


def test_previous_response_id_continues_the_conversation(client, server):
    first = client.responses.create(
        model=server.model,
        input="My name is Ada. Say hello to me.",
        instructions="Be brief.",
        max_output_tokens=12,
        temperature=0,
    )
    second = client.responses.create(
        model=server.model,
        input="What is my name?",
        previous_response_id=first.id,
        max_output_tokens=12,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    # the same as chat completions over the whole conversation (instructions are not carried over)
    text, _ = chat_text(
        client,
        server.model,
        [
            {"role": "user", "content": "My name is Ada. Say hello to me."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is my name?"},
        ],
        12,
    )
    assert second.output_text == text
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens - 8


# a think block and an answer forced by a regex constraint, each matched by its own part (words bounded:
# an unbounded [a-z]+ lets the small model run one word on to max_output_tokens)
THINK = r"[a-z]{1,10}( [a-z]{1,10}){1,5}"
ANSWER = r"[A-Z][a-z]{1,10}( [a-z]{1,10}){1,5}\."


def test_reasoning_item_from_the_reasoning_parser_streamed_and_not(client, server):
    ask = "Is the sky blue? Think first, then answer."
    forced = {"structured_outputs": {"regex": "<think>" + THINK + "</think>" + ANSWER}}
    common = dict(model=server.model, input=ask, max_output_tokens=80, temperature=0, extra_body=forced)
    r = client.responses.create(**common)
    assert r.status == "completed" and [item.type for item in r.output] == ["reasoning", "message"]
    reasoning = r.output[0].content[0].text
    assert re.fullmatch(THINK, reasoning) and re.fullmatch(ANSWER, r.output_text)
    chat = (
        client.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": ask}],
            max_tokens=80,
            temperature=0,
            extra_body=forced,
        )
        .choices[0]
        .message
    )
    assert (chat.model_extra["reasoning_content"], chat.content) == (reasoning, r.output_text)

    with client.responses.stream(**common) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert collapsed([e.type for e in events]) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        *MESSAGE_EVENTS[2:],
        "response.completed",
    ]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert final.output[0].content[0].text == reasoning and final.output_text == r.output_text


def test_stored_responses_get_and_delete(client, server):
    r = client.responses.create(model=server.model, input="Hi", max_output_tokens=4, metadata={"k": "v"})
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump() and got.metadata == {"k": "v"}
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    unstored = client.responses.create(model=server.model, input="Hi", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=server.model, input="Hi", previous_response_id=unstored.id)
    assert e.value.body["param"] == "previous_response_id"


def test_max_output_tokens_gives_incomplete(client, server):
    common = dict(model=server.model, input="Write a long story about a dragon.", max_output_tokens=3)
    r = client.responses.create(temperature=0, **common)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"
    events = list(client.responses.create(temperature=0, stream=True, **common))
    assert events[-1].type == "response.incomplete"
    assert "response.completed" not in [e.type for e in events]
    final = events[-1].response
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.output_text == r.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"tools": [{"type": "web_search"}]}, 400, "tools"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, 400, "tools"),
        ({"background": True}, 400, "background"),
        ({"include": ["message.output_text.logprobs"]}, 400, "include"),
        ({"truncation": "auto"}, 400, "truncation"),
        ({"previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input"),
        ({"input": [{"role": "robot", "content": "hi"}]}, 400, "input"),
        ({"input": [{"type": "function_call", "name": "f"}]}, 400, "input"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
            400,
            "text.format",
        ),
        ({"max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"temperature": -1}, 400, "temperature"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice"),
        ({"tool_choice": {"type": "web_search_preview"}}, 400, "tool_choice"),
        ({"tool_choice": "required"}, 400, "tool_choice"),
        ({"model": "no-such-model"}, 404, "model"),
    ],
)
def test_bad_inputs_get_openai_errors(server, body, status, param):
    request = {"model": server.model, "input": "Hi", "max_output_tokens": 2, **body}
    r = httpx.post(server.url("/v1/responses"), json=request, headers=server.headers, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"]


def test_bad_ids_and_the_server_serves_on(client, server):
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=server.model, input="Hi", tools=[{"type": "web_search"}])
    assert "web_search" in e.value.message
    r = client.responses.create(model=server.model, input="Hello", max_output_tokens=2, tool_choice="auto")
    assert r.status in ("completed", "incomplete") and r.usage.output_tokens >= 1


# ---------------------------------------------------------------------------------------------- no server


def stored(i: int, text: str = "") -> ResponseObject:
    return ResponseObject(id=f"resp_{i}", model="m", status="completed", instructions=text)


def test_store_is_lru_bounded_in_entries_and_bytes():
    store = ResponsesStore(max_entries=3, max_bytes=10_000)
    for i in range(3):
        store.put(stored(i), [{"role": "user", "content": "hi"}])
    assert store.get("resp_0") is not None  # now the most recently used
    store.put(stored(3), [])
    assert store.get("resp_1") is None and len(store) == 3
    assert [store.get(f"resp_{i}") is not None for i in (0, 2, 3)] == [True, True, True]
    store.put(stored(4, "x" * 9_900), [])  # over the bytes bound: the older ones go, the newest stays
    assert len(store) == 1 and store.get("resp_4") is not None
    store.put(stored(5, "y" * 20_000), [])  # alone over the bound, still kept: it is the one to continue
    assert len(store) == 1 and store.get("resp_5") is not None
    assert store.delete("resp_5") and not store.delete("resp_5") and len(store) == 0


def test_input_items_become_chat_messages():
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"x": 1}'},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
    ]  # fmt: skip
    assert input_messages(items) == [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "a\nb"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"x": 1}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
    ]
    assert input_messages("hello") == [{"role": "user", "content": "hello"}]
