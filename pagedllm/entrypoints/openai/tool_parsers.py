"""Tool calls out of a model's text (`--tool-call-parser`), whole or as it streams.

    hermes   <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks (Hermes, Qwen2.5/3, and the
             fallback prompt of tool_prompt.py); the text outside them is the content
    json     the whole output is one {"name": ..., "arguments": {...}} object or a list of them (also what
             tool_choice="required" makes the model write, under a grammar)

Both read text that may still be growing: parse(text) returns the content and the calls found so far,
each call's arguments the raw text of its "arguments" value up to where it has been written. The raw text
(never a re-serialised dict) is what a client gets, so the argument fragments of a stream add up to
exactly the arguments of the same output parsed whole.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
_ARGUMENT_KEYS = ("arguments", "parameters")  # some models write "parameters"


@dataclass
class ParsedCall:
    name: str | None  # None until the name string is complete
    arguments: str  # raw JSON text of the arguments written so far ("{}" for a call without any)
    complete: bool  # the call's object is closed


@dataclass
class ParsedOutput:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)

    def valid_calls(self) -> list[ParsedCall]:
        """The complete calls whose name is a string and whose arguments are a JSON object."""
        out = []
        for call in self.calls:
            if not call.complete or not call.name:
                continue
            try:
                if isinstance(json.loads(call.arguments), dict):
                    out.append(call)
            except ValueError:
                continue
        return out


def _scan_object(text: str, start: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """The members of the JSON object whose '{' is text[start]: {key: (value_start, value_end)}, value_end
    None while the value is still being written; and the index just past the closing '}' (None if open).
    Tolerant of text cut anywhere: it never raises."""
    members: dict[str, tuple[int, int | None]] = {}
    depth, in_string, escaped = 0, False, False
    key_start = value_start = None
    key: str | None = None
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                if depth == 1 and key_start is not None and key is None and value_start is None:
                    try:
                        key = json.loads(text[key_start : i + 1])
                    except ValueError:
                        key = ""
            continue
        if c == '"':
            in_string = True
            if depth == 1 and key is None and value_start is None:
                key_start = i
            elif depth == 1 and value_start is None and key is not None:
                value_start = i
            continue
        if depth == 1 and key is not None and value_start is None and c not in " \t\r\n:":
            value_start = i
        if c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                if key is not None and value_start is not None:
                    members[key] = (value_start, i)
                return members, i + 1
        elif c == "," and depth == 1:
            if key is not None and value_start is not None:
                members[key] = (value_start, i)
            key = key_start = value_start = None
    if key is not None and value_start is not None:
        members[key] = (value_start, None)
    return members, None


def _call_at(text: str, start: int) -> tuple[ParsedCall | None, int | None]:
    """The call object starting at text[start] == '{', and the index past it (None while open)."""
    members, end = _scan_object(text, start)
    name = None
    if "name" in members and members["name"][1] is not None:
        s, e = members["name"]
        try:
            value = json.loads(text[s:e])
            name = value if isinstance(value, str) else None
        except ValueError:
            name = None
    arguments = ""
    for key in _ARGUMENT_KEYS:
        if key in members:
            s, e = members[key]
            arguments = text[s : len(text) if e is None else e].rstrip()
            break
    else:
        if end is not None:
            arguments = "{}"
    return ParsedCall(name, arguments, end is not None), end


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag (held back while streaming)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class HermesToolParser:
    name = "hermes"

    def parse(self, text: str) -> ParsedOutput:
        first = text.find(TOOL_CALL_START)
        if first < 0:
            return ParsedOutput(text[: len(text) - _partial_tag(text, TOOL_CALL_START)])
        content = [text[:first]]
        calls = []
        pos = first
        while pos >= 0:
            body = pos + len(TOOL_CALL_START)
            close = text.find(TOOL_CALL_END, body)
            brace = text.find("{", body, close if close >= 0 else len(text))
            if brace >= 0:
                call, _ = _call_at(text[: close if close >= 0 else len(text)], brace)
                if call is not None:
                    call.complete = call.complete and close >= 0
                    calls.append(call)
            if close < 0:
                break
            after = close + len(TOOL_CALL_END)
            pos = text.find(TOOL_CALL_START, after)
            tail = text[after : pos if pos >= 0 else len(text)]
            content.append(tail if pos >= 0 else tail[: len(tail) - _partial_tag(tail, TOOL_CALL_START)])
        return ParsedOutput("".join(content), calls)


class JsonToolParser:
    name = "json"

    def parse(self, text: str) -> ParsedOutput:
        stripped = text.lstrip()
        if not stripped:
            return ParsedOutput("")
        offset = len(text) - len(stripped)
        if stripped[0] == "{":
            call, _ = _call_at(text, offset)
            return ParsedOutput("", [call] if call is not None else [])
        if stripped[0] != "[":
            return ParsedOutput(text)
        calls = []
        i = offset + 1
        while True:
            brace = text.find("{", i)
            if brace < 0:
                break
            call, end = _call_at(text, brace)
            if call is not None:
                calls.append(call)
            if end is None:
                break
            i = end
        return ParsedOutput("", calls)


TOOL_PARSERS = {p.name: p for p in (HermesToolParser, JsonToolParser)}


def get_tool_parser(name: str) -> HermesToolParser | JsonToolParser:
    return TOOL_PARSERS[name]()
