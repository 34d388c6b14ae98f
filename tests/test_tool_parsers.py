"""Tool-call parsers and the fallback tool prompt: whole outputs, and every prefix of one as it streams."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedllm.entrypoints.openai.protocol import ChatMessageParam
from pagedllm.entrypoints.openai.tool_parsers import HermesToolParser, JsonToolParser
from pagedllm.entrypoints.openai.tool_prompt import conversation, template_takes_tools

HERMES = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2],'
    ' "note": "a \\"quoted\\" } brace"}}\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}'
    "</tool_call>"
)
JSON_LIST = '[{"name": "a", "arguments": {"x": {"y": [1, {"z": "}"}]}}}, {"name": "b", "arguments": {}}]'


def test_hermes_whole_output():
    parsed = HermesToolParser().parse(HERMES)
    assert parsed.content.strip() == "Let me look."
    calls = parsed.valid_calls()
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "days": [1, 2], "note": 'a "quoted" } brace'}
    assert calls[1].arguments == "{}"


def test_json_whole_output_object_and_list():
    calls = JsonToolParser().parse(JSON_LIST).valid_calls()
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("a", {"x": {"y": [1, {"z": "}"}]}}),
        ("b", {}),
    ]
    one = JsonToolParser().parse(' {"name": "f", "parameters": {"q": 1}}').valid_calls()
    assert [(c.name, c.arguments) for c in one] == [("f", '{"q": 1}')]
    assert JsonToolParser().parse("plain words").content == "plain words"


def test_text_without_calls_is_content_and_broken_calls_are_not_valid():
    assert HermesToolParser().parse("Hello there").calls == []
    assert HermesToolParser().parse("Hello there").content == "Hello there"
    broken = HermesToolParser().parse('<tool_call>{"name": "f", "arguments": {"a": </tool_call>')
    assert broken.valid_calls() == []


@pytest.mark.parametrize("parser, text", [(HermesToolParser(), HERMES), (JsonToolParser(), JSON_LIST)])
def test_every_prefix_streams_a_prefix_of_the_final_calls(parser, text):
    final = parser.parse(text)
    for cut in range(len(text) + 1):
        partial = parser.parse(text[:cut])
        assert final.content.startswith(partial.content), cut
        assert len(partial.calls) <= len(final.calls), cut
        for p, f in zip(partial.calls, final.calls):
            assert p.name in (None, f.name), cut  # a name appears only whole
            assert f.arguments.startswith(p.arguments), (cut, p.arguments, f.arguments)


@given(st.dictionaries(st.text(max_size=5), st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8), max_size=4), st.sampled_from([None, 2]))  # fmt: skip
def test_any_arguments_round_trip_through_the_stream(arguments, indent):
    call = {"name": "f", "arguments": arguments}
    text = f"<tool_call>{json.dumps(call, indent=indent)}</tool_call>"
    parser = HermesToolParser()
    (final,) = parser.parse(text).valid_calls()
    assert json.loads(final.arguments) == arguments
    sent = ""
    for cut in range(0, len(text) + 1, 3):
        calls = parser.parse(text[:cut]).calls
        if calls:
            assert calls[0].arguments.startswith(sent)
            sent = calls[0].arguments
    assert final.arguments.startswith(sent)


def test_fallback_prompt_lists_tools_and_renders_history_back():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [
        ChatMessageParam(role="system", content="Be brief."),
        ChatMessageParam(role="user", content="Weather?"),
        ChatMessageParam.model_validate({
            "role": "assistant", "content": None,
            "tool_calls": [{"id": "c1", "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
        }),
        ChatMessageParam(role="tool", content="sunny", tool_call_id="c1"),
    ]  # fmt: skip
    out = conversation(messages, tools, native=False)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.") and '"name": "get_weather"' in out[0]["content"]
    (call,) = HermesToolParser().parse(out[2]["content"]).valid_calls()
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert out[3]["content"] == "<tool_response>\nsunny\n</tool_response>"
    native = conversation(messages, tools, native=True)
    assert native[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert native[3] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    assert template_takes_tools("{% if tools %}...{% endif %}") and not template_takes_tools(None)
