"""Reasoning parsers (`--reasoning-parser`): a reasoning model's think block apart from its answer.

    qwen3        <think>reasoning</think>answer. The chat template may open the block itself (Qwen3 thinking
                 models end the prompt with <think>), so text before a </think> is reasoning even without
                 <think>; text with neither tag is all answer, and a <think> never closed (max_tokens) all
                 reasoning.
    deepseek_r1  the same tags, but R1 templates always open the block: everything before </think> is
                 reasoning, with or without <think>, and text without </think> is all reasoning.

As vLLM's parsers of the same names, on text rather than token ids: here the tags may span several tokens
(the default model has no think tokens), so a stream holds back a tail that could still become a tag.
Whether the prompt already opened or closed the block (Qwen3's enable_thinking=False renders an empty
<think></think> into it) is read from the prompt's end (`prompt_state`); a closed block leaves all output
answer. `split` takes a whole text, `stream` the same text delta by delta; given the prompt's state, the
deltas of a stream add up to the split of their sum. Without it (state None) `split` also reads qwen3 text
before a lone </think> as reasoning, on the guess that a template opened the block; a stream cannot guess
that in advance, and streams such output as answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# Where the output starts: inside the think block (the prompt opened it), after it (the prompt closed it),
# at the start of its own text (the prompt did neither: the output's first tag decides), or unknown (None).
ThinkState = Literal["reasoning", "content", "start"] | None


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of text that is a proper prefix of tag (it may still become the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    # text before the end tag is reasoning even when the output did not open the block
    opened_by_default: bool
    start: str = "<think>"
    end: str = "</think>"

    def prompt_state(self, prompt_tail: str) -> ThinkState:
        """Where the output starts, from the end of the rendered prompt (a few tokens' text is enough):
        templates open (<think>) or close (<think></think>) the block at the very end of the prompt."""
        tail = prompt_tail.rstrip()
        if tail.endswith(self.start):
            return "reasoning"
        if tail.endswith(self.end):
            return "content"
        return "start"

    def stream(self, state: ThinkState = None) -> ReasoningStream:
        return ReasoningStream(self, state)

    def split(self, text: str, state: ThinkState = None) -> tuple[str | None, str]:
        """(reasoning, answer) of a whole output; reasoning is None when the output has no think block."""
        stream = self.stream(state)
        reasoning, content = [], []
        for r, c in (stream.feed(text), stream.finish()):
            reasoning.append(r or "")
            content.append(c or "")
        answer = "".join(content)
        if stream.entered:
            return "".join(reasoning), answer
        if state is None and self.end in answer:  # qwen3: the template opened the block, unseen
            before, _, after = answer.partition(self.end)
            return before, after
        return None, answer


class ReasoningStream:
    """One output's split as it grows: feed(delta) -> (reasoning delta, answer delta), either None when
    empty; finish() gives back what was held (a tail that could still have become a tag)."""

    def __init__(self, parser: ReasoningParser, state: ThinkState = None):
        self.parser = parser
        # start: a leading <think> (even after the prompt opened the block) is not part of the reasoning;
        # an unknown state (None) streams as "start"
        self.phase = "content" if state == "content" else "start"
        self.opened = parser.opened_by_default or state == "reasoning"
        self.entered = state == "reasoning"  # the output is (or was) inside a think block
        self._held = ""

    def feed(self, delta: str) -> tuple[str | None, str | None]:
        self._held += delta
        return self._drain(final=False)

    def finish(self) -> tuple[str | None, str | None]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str | None, str | None]:
        p = self.parser
        reasoning = ""
        if self.phase == "start":
            stripped = self._held.lstrip()
            if stripped.startswith(p.start):
                self._held = stripped[len(p.start) :]
                self.phase = "reasoning"
            elif p.start.startswith(stripped) and not final:  # nothing yet, or part of <think>: wait
                return None, None
            else:
                self.phase = "reasoning" if self.opened else "content"
            self.entered = self.phase == "reasoning"
        if self.phase == "reasoning":
            at = self._held.find(p.end)
            if at >= 0:
                reasoning = self._held[:at]
                self._held = self._held[at + len(p.end) :]
                self.phase = "content"
            else:
                keep = 0 if final else _partial_suffix(self._held, p.end)
                cut = len(self._held) - keep
                reasoning, self._held = self._held[:cut], self._held[cut:]
        content = ""
        if self.phase == "content":
            content, self._held = self._held, ""
        return reasoning or None, content or None


REASONING_PARSERS = {
    p.name: p
    for p in (
        ReasoningParser("qwen3", opened_by_default=False),
        ReasoningParser("deepseek_r1", opened_by_default=True),
    )
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser of that name; ValueError naming the known ones otherwise."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}"
        ) from None
