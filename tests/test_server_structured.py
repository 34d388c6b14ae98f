"""Structured outputs and tool calls on the real server, through the official `openai` client and the
clients people point at a vLLM-compatible server (langchain-openai, litellm)."""

from __future__ import annotations

import json
import os
import re

import httpx
import jsonschema
import openai
import pytest
from test_server import client, server  # noqa: F401 - fixtures: the real server on loopback, its client

pytestmark = pytest.mark.slow

SCHEMAS = {
    "nested objects": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "address"],
    },
    "array with minItems": {
        "type": "object",
        "properties": {
            "hobbies": {
                "type": "array",
                "items": {"type": "string", "maxLength": 15},
                "minItems": 2,
                "maxItems": 4,
            }
        },
        "required": ["hobbies"],
    },  # fmt: skip
    "enum": {
        "type": "object",
        "properties": {"mood": {"enum": ["happy", "sad", "calm"]}},
        "required": ["mood"],
    },
    "integer range": {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 65}},
        "required": ["age"],
    },
    "string pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["code"],
    },
    "anyOf": {
        "type": "object",
        "properties": {
            "id": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "maxLength": 8}]}
        },
        "required": ["id"],
    },
    "required and optional": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 30},
            "year": {"type": "integer"},
            "rating": {"type": "number"},
        },
        "required": ["title", "year"],
    },  # fmt: skip
}
ASK = [{"role": "user", "content": "Describe Bob, a 30-year-old teacher from Paris, as JSON."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                       "required": ["zone"]},
    },
}  # fmt: skip
WEATHER_ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def streamed_text(stream) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    return texts


def streamed_calls(stream) -> tuple[list[dict], str | None]:
    """Reassemble tool-call deltas as a client does: by index, id and name first, then argument text."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for d in choice.delta.tool_calls or []:
            if d.index not in calls:
                assert d.id and d.type == "function" and d.function.name, "a call's first delta names it"
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            calls[d.index]["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_validate_greedy_sampled_streamed(client, server, name):
    schema = SCHEMAS[name]
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    common = dict(model=server.model, messages=ASK, max_tokens=200, response_format=rf)
    texts = []
    greedy = client.chat.completions.create(temperature=0, **common)
    texts.append(greedy.choices[0].message.content)
    assert greedy.choices[0].finish_reason == "stop"
    sampled = client.chat.completions.create(temperature=1.0, seed=3, n=2, **common)
    texts += [c.message.content for c in sampled.choices]
    stream = client.chat.completions.create(temperature=0, stream=True, **common)
    streamed = streamed_text(stream)[0]
    assert streamed == texts[0]  # the stream adds up to the same greedy output
    texts.append(streamed)
    for text in texts:
        jsonschema.validate(json.loads(text), schema)


def test_completions_json_object_choice_regex_and_grammar(client, server):
    out = client.completions.create(
        model=server.model, prompt="Cities: ", max_tokens=20, temperature=0,
        extra_body={"guided_choice": ["Paris", "Rome", "Berlin"]},
    ).choices[0].text  # fmt: skip
    assert out in ("Paris", "Rome", "Berlin")
    regex = r"[0-9]{3}-[0-9]{4}"
    for body in ({"guided_regex": regex}, {"structured_outputs": {"regex": regex}}):
        r = client.completions.create(model=server.model, prompt="My number is ", max_tokens=20, temperature=0.7,
                                      seed=1, extra_body=body)  # fmt: skip
        assert re.fullmatch(regex, r.choices[0].text)
    stream = client.completions.create(model=server.model, prompt="My number is ", max_tokens=20, temperature=0,
                                       stream=True, extra_body={"guided_regex": regex})  # fmt: skip
    assert re.fullmatch(regex, "".join(c.choices[0].text for c in stream))
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'
    r = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=20,
                                       extra_body={"guided_grammar": grammar})  # fmt: skip
    assert r.choices[0].message.content in ("The answer is yes.", "The answer is no.")
    r = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=300, temperature=0,
                                       response_format={"type": "json_object"})  # fmt: skip
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.lstrip().startswith("{")


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_forced_tool_calls_are_well_formed_and_stream_the_same(client, server, tool_choice):
    common = dict(model=server.model, messages=WEATHER_ASK, tools=[WEATHER, TIME], tool_choice=tool_choice,
                  parallel_tool_calls=False, max_tokens=120)  # fmt: skip
    for temperature, seed in ((0, None), (1.0, 5), (1.0, 6)):
        r = client.chat.completions.create(temperature=temperature, seed=seed, **common)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        if isinstance(tool_choice, dict):
            assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    greedy = client.chat.completions.create(temperature=0, **common).choices[0].message.tool_calls
    calls, finish = streamed_calls(client.chat.completions.create(temperature=0, stream=True, **common))
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (g.function.name, g.function.arguments) for g in greedy
    ]


def test_tool_history_is_rendered_and_auto_parses_hermes_calls(client, server):
    history = WEATHER_ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call-1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": '{"temperature": 21, "sky": "clear"}'},
    ]  # fmt: skip
    r = client.chat.completions.create(model=server.model, messages=history, tools=[WEATHER], max_tokens=40,
                                       temperature=0)  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    if choice.finish_reason != "tool_calls":
        assert choice.message.content and not choice.message.tool_calls
    # the prompt carried the tools, the earlier call and its result
    tokens = httpx.post(
        server.url("/tokenize"), json={"messages": history}, headers=server.headers, timeout=30
    ).json()["tokens"]
    rendered = httpx.post(
        server.url("/detokenize"), json={"tokens": tokens}, headers=server.headers, timeout=30
    ).json()["prompt"]
    assert '"get_weather"' in rendered and "<tool_response>" in rendered and '"temperature": 21' in rendered
    # tool_choice none: plain text, even with tools
    r = client.chat.completions.create(model=server.model, messages=WEATHER_ASK, tools=[WEATHER], tool_choice="none",
                                       max_tokens=10)  # fmt: skip
    assert not r.choices[0].message.tool_calls


def test_bad_constraints_and_unsupported_fields_are_400s_naming_the_field(client, server):
    bad = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"structured_outputs": {"grammar": "root ::= undefined"}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"best_of": 3}, "best_of"),
        ({"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"functions": [WEATHER["function"]]}, "functions"),
        ({"store": True}, "store"),
        ({"echo": True}, "echo"),
    ]  # fmt: skip
    for body, param in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=server.model, messages=ASK, max_tokens=5, extra_body=body)
        assert e.value.body.get("param") == param, (body, e.value.body)
    # harmless values of those fields, and fields nobody knows, are accepted
    r = client.chat.completions.create(model=server.model, messages=ASK, max_tokens=5,
                                       extra_body={"best_of": 1, "store": False, "made_up_field": 1})  # fmt: skip
    assert r.choices[0].message.content is not None


def test_langchain_structured_output_and_bind_tools(server):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=20)
        age: int = Field(ge=0, le=120)

    llm = ChatOpenAI(model=server.model, base_url=server.url("/v1"), api_key=server.api_key, temperature=0,
                     max_tokens=100, max_retries=0, timeout=120)  # fmt: skip
    for kwargs in ({}, {"method": "json_schema"}, {"method": "function_calling"}):
        person = llm.with_structured_output(Person, **kwargs).invoke("Describe Bob, who is 30 years old.")
        assert isinstance(person, Person), kwargs

    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return "sunny"

    for choice in ("get_weather", "any"):
        message = llm.bind_tools([get_weather], tool_choice=choice, parallel_tool_calls=False).invoke(
            "What is the weather in Paris?"
        )
        (call,) = message.tool_calls
        assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)


def test_litellm_with_tools(server, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of a price list from the internet
    os.environ.setdefault("LITELLM_LOG", "ERROR")
    import litellm

    r = litellm.completion(
        model=f"openai/{server.model}", api_base=server.url("/v1"), api_key=server.api_key, messages=WEATHER_ASK,
        tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=80, temperature=0,
    )  # fmt: skip
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
