"""Tools and tool calls into the conversation the chat template renders.

A template that takes tools (it reads a `tools` variable, as Qwen2.5/3, Llama 3.1, Hermes and Mistral's
do) gets them as it expects: `tools=[...]` beside the messages, assistant messages with `tool_calls`
(arguments as a dict) and `tool` messages. Any other template gets the documented fallback, Hermes'
convention in plain messages: a system block listing the tools as JSON schemas and asking for
<tool_call>{"name": ..., "arguments": ...}</tool_call>, earlier calls written back as such blocks in the
assistant's text, and tool results as <tool_response> blocks in a user message.
"""

from __future__ import annotations

import json
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers import TOOL_CALL_END, TOOL_CALL_START

FALLBACK_TOOL_PROMPT = (
    "You may call one or more functions to help with the user's request. The functions you can call are "
    "described, as JSON schemas, inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, write a JSON object with its name and arguments inside <tool_call></tool_call> tags:\n"
    f'{TOOL_CALL_START}\n{{"name": <function-name>, "arguments": <arguments-json-object>}}\n{TOOL_CALL_END}'
)


def template_takes_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def conversation(
    messages: list[Any], tools: list[dict[str, Any]] | None, native: bool
) -> list[dict[str, Any]]:
    """The messages as the template's dicts. tools: OpenAI tool definitions to offer (None: none offered);
    native: the template takes tools itself (else the fallback above)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        text = m.text()
        # "developer" is OpenAI's newer name for "system"; chat templates know only the older one
        role = "system" if m.role == "developer" else m.role
        if native:
            d: dict[str, Any] = {"role": role, "content": text}
            if m.tool_calls:
                d["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
                    }
                    for c in m.tool_calls
                ]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                d["name"] = m.name
            out.append(d)
        elif m.role == "tool":
            block = f"<tool_response>\n{text}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block  # several results answer one turn
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            calls = [
                f'{TOOL_CALL_START}\n{{"name": {json.dumps(c.function.name)}, "arguments": '
                f"{c.function.arguments or '{}'}}}\n{TOOL_CALL_END}"
                for c in m.tool_calls or []
            ]
            out.append({"role": role, "content": "\n".join(x for x in [text, *calls] if x)})
    for d in out:
        d.pop("_tool_results", None)
    if tools and not native:
        listing = "\n".join(json.dumps(t["function"]) for t in tools)
        block = FALLBACK_TOOL_PROMPT.replace("{tools}", listing)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{block}"
        else:
            out.insert(0, {"role": "system", "content": block})
    return out
