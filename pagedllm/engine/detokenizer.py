"""Incremental detokenization and stop strings for one sequence.

Decoding token by token is not the same as decoding each token alone: byte-level BPE splits one UTF-8
character over several tokens, and SentencePiece-style decoders drop a leading space without context. So we
decode with some prompt tokens as context and hold back a tail that ends in an incomplete character (U+FFFD)
until the next token completes it. tokenizers' DecodeStream does exactly that in Rust; without it we use
vLLM's prefix/read offsets method in Python (same results, more decode calls).

Stop strings: update() searches only the newly added text (plus an overlap of one stop string), cuts the
stop string and everything after it, and reports which one matched. get_next_output_text() holds back the
last (longest stop - 1) characters while running, so a streamed text never shows a partial stop string that
would later be cut: the text only ever grows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None

REPLACEMENT_CHAR = "\ufffd"  # what decoding an incomplete UTF-8 sequence ends with
_INVALID_PREFIX_ERR = "Invalid prefix encountered"
# How many prompt tokens to prime the decoder with (vLLM: 4 to 24, the first suffix that decodes cleanly).
_MIN_CONTEXT, _MAX_CONTEXT = 4, 24


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ):
        """tokenizer: a transformers tokenizer (fast or slow) or a tokenizers.Tokenizer.
        min_tokens: stop strings ending within the first min_tokens tokens do not count (vLLM semantics)."""
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        # Nothing to hold back when a matched stop string stays in the text anyway.
        self.stop_buffer_length = (
            max(map(len, self.stop)) - 1 if self.stop and not include_stop_str_in_output else 0
        )
        self.token_ids: list[int] = []  # output tokens seen so far (kept whole even after a stop string)
        self.output_text = ""
        self.stop_reason: str | None = None  # the stop string that matched, once one did
        self._last_output_text_offset = 0

        backend = _backend(tokenizer)
        context = _prompt_context(backend or tokenizer, prompt_token_ids)
        if backend is not None and DecodeStream is not None:
            self._stream: _FastStream | _OffsetStream = _FastStream(backend, context, skip_special_tokens)
        else:
            self._stream = _OffsetStream(tokenizer, context, skip_special_tokens)

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Append new tokens; return the stop string that matched (text cut already), or None."""
        if self.stop_reason is not None:  # already stopped: the engine finishes the request
            return self.stop_reason
        stop_check_offset = len(self.output_text)
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            self.output_text += self._stream.step(token_id) or ""
            if len(self.token_ids) <= self.min_tokens:
                stop_check_offset = len(self.output_text)
        if not self.stop:
            return None
        match = find_stop_string(
            self.output_text,
            len(self.output_text) - stop_check_offset,
            self.stop,
            self.include_stop_str_in_output,
        )
        if match is None:
            return None
        self.stop_reason, cut = match
        self.output_text = self.output_text[:cut]
        return self.stop_reason

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The full text (delta=False) or what is new since the last delta call (delta=True), minus the
        held-back tail while not finished."""
        buffer_length = 0 if finished else self.stop_buffer_length
        length = len(self.output_text) - buffer_length
        if not delta:
            return self.output_text[: max(length, 0)]
        last = self._last_output_text_offset
        if last < length:
            self._last_output_text_offset = length
            return self.output_text[last:length]
        return ""


def find_stop_string(
    text: str, new_char_count: int, stop: Sequence[str], include_in_output: bool
) -> tuple[str, int] | None:
    """Earliest stop string that ends within the last new_char_count characters of text.
    Returns (stop string, where to cut text) or None."""
    if not new_char_count or not stop:
        return None
    best: tuple[int, str] | None = None
    for s in stop:
        # Earliest start at which s would still end inside the new text.
        start = max(len(text) - new_char_count - len(s) + 1, 0)
        i = text.find(s, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    if best is None:
        return None
    i, s = best
    return s, i + len(s) if include_in_output else i


class _FastStream:
    """tokenizers.decoders.DecodeStream: step(id) -> the new text, or None while a character is incomplete."""

    def __init__(self, backend: Any, context: list[int], skip_special_tokens: bool):
        self._backend = backend
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        for token_id in context:  # prime; the prompt's text is not ours to return
            self.step(token_id)

    def step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._backend, token_id)
        except Exception as e:
            # Some tokenizers decode non-monotonically on invalid UTF-8, which breaks DecodeStream's
            # state (vllm-project/vllm#17448): start a fresh stream rather than failing the request.
            if not str(e).startswith(_INVALID_PREFIX_ERR):
                raise
            self._stream = DecodeStream(skip_special_tokens=self._skip)
            return self._stream.step(self._backend, token_id)


class _OffsetStream:
    """vLLM's prefix/read offsets method: decode ids[prefix:] and ids[prefix:read], emit the difference
    once it does not end in an incomplete character."""

    def __init__(self, tokenizer: Any, context: list[int], skip_special_tokens: bool):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(context)
        self._prefix_offset = max(len(context) - 5, 0)
        self._read_offset = len(context)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def step(self, token_id: int) -> str | None:
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return None
        # Drop what no future decode looks at, so _ids stays short.
        del self._ids[: self._prefix_offset]
        self._prefix_offset, self._read_offset = self._read_offset - self._prefix_offset, len(self._ids)
        return new_text[len(prefix_text) :]


def _backend(tokenizer: Any) -> Any:
    """The tokenizers.Tokenizer under a fast transformers tokenizer (or the tokenizer itself), else None."""
    if type(tokenizer).__module__.startswith("tokenizers"):
        return tokenizer
    return getattr(tokenizer, "backend_tokenizer", None)


def _prompt_context(tokenizer: Any, prompt_token_ids: Sequence[int]) -> list[int]:
    """A short prompt suffix to decode the first output tokens in context: the shortest one of at least
    _MIN_CONTEXT tokens that decodes without a broken character (else the longest tried)."""
    prompt = list(prompt_token_ids)
    if len(prompt) <= _MIN_CONTEXT:
        return prompt
    suffix = prompt[-_MIN_CONTEXT:]
    for n in range(_MIN_CONTEXT, min(len(prompt), _MAX_CONTEXT) + 1):
        suffix = prompt[-n:]
        if REPLACEMENT_CHAR not in tokenizer.decode(suffix, skip_special_tokens=False):
            break
    return suffix
