"""StructuredOutputManager: compiles grammars off the engine step, and fills each step's token bitmask.

A grammar is compiled once per (kind, spec) text into an llguidance LLMatcher, in a background thread
(the constructor drops the GIL), and cached; every request gets its own cheap copy (deep_copy, ~10 us), so
n > 1 siblings and later requests with the same schema share the compile. A request whose grammar is not
ready yet simply waits in the scheduler; everything else keeps running.

The bitmask is one int32 row per constrained request, bit t of the row allowing token t (llguidance's
layout, 32 tokens a word); llguidance fills the rows of a whole step in parallel Rust threads, and the
sampler applies them to the batch in one tensor operation.

A constraint with start_after (a reasoning model's </think>) waits for that text: until the output has
contained it the request is "gated", its row allows every token and its matcher does not move (vLLM's
structured outputs wait for the reasoning end the same way). The text is looked for in the tokens' bytes,
so a tag that spans several tokens counts too; the grammar starts with the token after the one that
completed the tag (text that token has after the tag is not constrained). With start_after_budget, once
that many tokens have gone by gated, each row allows only the next token of the tag's rest (a reasoning
budget: the think block is closed for the model).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance
import llguidance.hf
import torch

from pagedllm.errors import InputError
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.grammar import grammar_text

logger = logging.getLogger("pagedllm")

MAX_CACHED_GRAMMARS = 256  # compiled matchers kept (a JSON schema's is tens of KB)


class StructuredOutputRequest:
    """One request's matcher: waits for its compiled grammar, then follows the tokens the request samples."""

    def __init__(
        self,
        compiled: Future,
        start_after: str | None = None,
        tokenizer: Callable[[], llguidance.LLTokenizer] | None = None,
        budget: int | None = None,
    ):
        self._compiled = compiled
        self.matcher: llguidance.LLMatcher | None = None
        self._gate = start_after.encode() if start_after else None  # None once passed (or never set)
        self._gate_tail = b""  # the output's last bytes while gated: a tag may span tokens
        self._tokenizer = tokenizer  # for the tokens' bytes; built by the compile the request waited for
        self._budget = budget  # tokens the gate stays open to the model; then the tag is forced
        self._num_gated = 0  # tokens taken while gated

    @property
    def gated(self) -> bool:
        """The grammar has not started yet: the output has not contained start_after."""
        return self._gate is not None

    def _scan_gate(self, tail: bytes, token_id: int) -> tuple[bool, bytes]:
        """(whether this token completes start_after, the bytes to keep looking in)."""
        assert self._gate is not None and self._tokenizer is not None
        tail += self._tokenizer().decode_bytes([token_id])
        if self._gate in tail:
            return True, b""
        return False, tail[max(0, len(tail) - len(self._gate) + 1) :]

    def gated_drafts(self, drafts: Sequence[int]) -> int:
        """How many leading drafts keep the request gated: a draft that would open the gate is not
        proposed, so that every row of a gated request's step is free."""
        tail = self._gate_tail
        if self._budget is not None:  # no row of the step may come after the budget is spent
            drafts = drafts[: max(0, self._budget - self._num_gated - 1)]
        for n, token_id in enumerate(drafts):
            opened, tail = self._scan_gate(tail, token_id)
            if opened:
                return n
        return len(drafts)

    def forced_token(self) -> int | None:
        """The token a gated request must take next because its budget is spent (the next token of the
        tag's rest, after the part the output already ends with); None when free."""
        if self._gate is None or self._budget is None or self._num_gated < self._budget:
            return None
        gate, tail = self._gate, self._gate_tail
        done = next((k for k in range(min(len(gate) - 1, len(tail)), 0, -1) if tail.endswith(gate[:k])), 0)
        assert self._tokenizer is not None
        return self._tokenizer().tokenize_bytes(gate[done:])[0]

    @property
    def is_ready(self) -> bool:
        """The grammar is compiled (or failed: see error); never blocks."""
        if self.matcher is None and self._compiled.done() and self._compiled.exception() is None:
            self.matcher = self._compiled.result().deep_copy()
        return self._compiled.done()

    @property
    def future(self) -> Future:
        return self._compiled

    @property
    def error(self) -> str | None:
        exc = self._compiled.exception() if self._compiled.done() else None
        if exc is not None:
            return str(exc)
        if self.matcher is not None and self.matcher.is_error():
            return self.matcher.get_error()
        return None

    def accept_token(self, token_id: int) -> bool:
        """Advance over a sampled token; False when the grammar did not allow it (the matcher then stays in
        an error state, and its mask allows only EOS)."""
        assert self.matcher is not None, "a request samples only once its grammar is ready"
        if self._gate is not None:
            self._num_gated += 1
            opened, self._gate_tail = self._scan_gate(self._gate_tail, token_id)
            if opened:
                self._gate = None
            return True
        return self.matcher.consume_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        """Forget the last num_tokens accepted (rejected speculative tokens; never while gated, whose
        drafts stop before the gate)."""
        assert self.matcher is not None and self._gate is None
        self.matcher.rollback(num_tokens)

    @property
    def is_terminated(self) -> bool:
        """The grammar has ended: its text is complete and nothing, not even more whitespace, may follow."""
        return self.matcher is not None and self.matcher.is_stopped()


class StructuredOutputManager:
    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]):
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None  # ~0.5 s to build: on the first grammar
        self._lock = threading.Lock()
        self._compiled: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._compile_thread: ThreadPoolExecutor | None = None
        self._fill_executor: llguidance.LLExecutor | None = None

    @property
    def bitmask_width(self) -> int:
        return (self.vocab_size + 31) // 32

    # ------------------------------------------------------------------ compile (any thread)

    def validate(self, params: StructuredOutputsParams) -> None:
        """InputError naming the field when the constraint is malformed; a few ms, cached."""
        grammar_text(params)

    def request(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        """Validate now (InputError), compile in the background (or take the cached compile)."""
        grammar = grammar_text(params)
        key = (params.kind, params.spec)
        with self._lock:
            future = self._compiled.get(key)
            if future is None or (future.done() and future.exception() is not None):
                if self._compile_thread is None:
                    self._compile_thread = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-grammar")
                future = self._compile_thread.submit(self._compile, grammar)
                self._compiled[key] = future
                while len(self._compiled) > MAX_CACHED_GRAMMARS:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(key)
        return StructuredOutputRequest(
            future, params.start_after, self.ll_tokenizer, params.start_after_budget
        )

    def _compile(self, grammar: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.ll_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise InputError(f"structured_outputs cannot be compiled: {matcher.get_error()}")
        return matcher

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's index of the vocabulary, built once (~0.5 s) on the first grammar."""
        if self._tokenizer is None:
            try:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos_token_ids or None
                )
            except Exception as e:  # a slow (Python) tokenizer, or a vocabulary llguidance cannot read
                raise InputError(f"structured outputs need a fast tokenizer this model lacks: {e}") from e
        return self._tokenizer

    # ------------------------------------------------------------------ each step (engine thread)

    def grammar_bitmask(
        self, requests: Sequence[Any], drafts: Sequence[Sequence[int]] | None = None
    ) -> torch.Tensor:
        """[rows, bitmask_width] int32: row i the tokens requests[i].structured_output allows next; with
        drafts (speculative decoding), 1 + len(drafts[i]) rows for request i in a row, the j-th once the
        matcher has taken drafts[i][:j] (llguidance advances and rolls back). Drafts must be valid for the
        grammar (validate_drafts)."""
        num_rows = len(requests) + (sum(len(d) for d in drafts) if drafts else 0)
        bitmask = torch.full((num_rows, self.bitmask_width), -1, dtype=torch.int32)
        if self._fill_executor is None:
            self._fill_executor = llguidance.LLExecutor()
        # a gated request's rows stay all ones: its grammar has not started
        if not drafts or not any(drafts):
            matchers = [
                (r.structured_output.matcher, i)
                for i, r in enumerate(requests)
                if not r.structured_output.gated
            ]
            if matchers:
                self._fill_executor.unsafe_compute_mask_ptr(
                    matchers, bitmask.data_ptr(), self.bitmask_width * 4, num_rows
                )
            self._force_rows(bitmask, requests, range(len(requests)))
            return bitmask
        items, at, starts = [], 0, []
        for r, d in zip(requests, drafts):
            if not r.structured_output.gated:
                items.append((r.structured_output.matcher, at, list(d)))
            starts.append(at)
            at += 1 + len(d)
        if items:
            self._fill_executor.unsafe_compute_mask_ptr_with_draft_token(
                items, bitmask.data_ptr(), self.bitmask_width * 4, num_rows
            )
        self._force_rows(bitmask, requests, starts)
        return bitmask

    @staticmethod
    def _force_rows(bitmask: torch.Tensor, requests: Sequence[Any], rows: Sequence[int]) -> None:
        """A gated request whose budget is spent may take only its forced token (its drafts stop before)."""
        for r, row in zip(requests, rows):
            token_id = r.structured_output.forced_token()
            if token_id is not None:
                bitmask[row] = 0
                # bit 31 of an int32 word is its sign: set it through the word's int64 value
                word = int(bitmask[row, token_id // 32]) | (1 << (token_id % 32))
                bitmask[row, token_id // 32] = word - (1 << 32) if word >= 1 << 31 else word

    @staticmethod
    def validate_drafts(request: Any, drafts: list[int]) -> list[int]:
        """The leading drafts the request's grammar allows (a draft past them could never be accepted); while
        gated, those before the one that would start the grammar."""
        so = request.structured_output
        if so.gated:
            return drafts[: so.gated_drafts(drafts)]
        return drafts[: so.matcher.validate_tokens(drafts)]

    def shutdown(self) -> None:
        if self._compile_thread is not None:
            self._compile_thread.shutdown(wait=False, cancel_futures=True)
