"""A tiny deterministic stand-in for LLMEngine, with the same interface (docs/architecture.md, "Engine").

It tokenizes one character per token and "generates" by echoing the prompt back, one character per step
and choice (choice i starts i characters further in), then emits EOS. That is enough to exercise the
server: streaming, n > 1, stop strings, max_tokens, logprobs, aborts and KV-block accounting.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace

from pagedllm.engine.protocol import EngineClient
from pagedllm.errors import InputError
from pagedllm.sampling_params import SamplingParams

EOS, BOS = 0, 1
_OFFSET = 2  # token id = ord(char) + _OFFSET


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (None for EOS)


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0  # the real RequestOutput's (usage.prompt_tokens_details.cached_tokens)
    prompt_logprobs: list | None = None  # the real one's; the fake computes none (a response says null)


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    num_blocks_total: int = 0
    num_free_blocks: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0


class FakeTokenizer:
    eos_token_id = EOS
    bos_token_id = BOS

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([BOS] if add_special_tokens else []) + [ord(c) + _OFFSET for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        special = {EOS: "</s>", BOS: "<s>"}
        return "".join(
            ("" if skip_special_tokens else special[i]) if i in special else chr(i - _OFFSET) for i in ids
        )

    chat_template = "<role>content"  # takes no tools: the server renders them with its fallback prompt

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools=None, **kwargs
    ) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@dataclass
class _Choice:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)


@dataclass
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    choices: list[_Choice]
    running: bool = False

    @property
    def finished(self) -> bool:
        return all(c.finish_reason for c in self.choices)


class FakeEngine:
    """Same methods and attributes as LLMEngine; `step_delay` slows steps down for disconnect tests."""

    def __init__(
        self,
        model: str = "fake",
        *,
        max_model_len: int | None = None,
        num_kv_blocks: int | None = None,
        block_size: int = 4,
        max_num_seqs: int = 8,
        step_delay: float = 0.0,
        **_ignored: object,
    ):
        self.tokenizer = FakeTokenizer()
        self.max_model_len = max_model_len or 512
        # vocab_size: every id FakeTokenizer can decode (a character each), so the server refuses larger ones
        # with a 400 as it does for a real model, instead of the fake failing inside decode
        self.model_config = SimpleNamespace(
            max_position_embeddings=self.max_model_len, architecture="fake", vocab_size=0x110000 + _OFFSET
        )
        self.block_size = block_size
        self.num_blocks = num_kv_blocks or 256
        self.max_num_seqs = max_num_seqs
        self.step_delay = step_delay
        self.requests: dict[str, _Request] = {}
        self.num_preemptions = 0
        self._owner: threading.Thread | None = None  # LLMEngine is not thread-safe: catch misuse

    def _check_thread(self) -> None:
        me = threading.current_thread()
        if self._owner is None:
            self._owner = me
        assert self._owner is me, "FakeEngine used from two threads"

    # ------------------------------------------------------------------ LLMEngine interface
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        self._check_thread()
        if priority != 0:  # as LLMEngine's default fcfs policy
            raise InputError("priority needs --scheduling-policy priority", param="priority")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InputError("prompt must not be empty", param="prompt")
        if len(ids) >= self.max_model_len:
            raise InputError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}", "prompt")
        if "__crash__" in self.tokenizer.decode(ids):  # a bug outside any handled error: a 500
            raise RuntimeError("crash: the fake engine's add_request failed on purpose")
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id}")
        choices = [_Choice(index=i) for i in range(params.n)]
        self.requests[request_id] = _Request(request_id, ids, params, arrival_time or time.time(), choices)

    def abort_request(self, request_ids: str | list[str]) -> None:
        self._check_thread()
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        self._check_thread()
        return bool(self.requests)

    def _blocks_of(self, req: _Request) -> int:
        return sum(
            math.ceil((len(req.prompt_token_ids) + len(c.token_ids)) / self.block_size) for c in req.choices
        )

    def _used_blocks(self) -> int:
        return sum(self._blocks_of(r) for r in self.requests.values() if r.running)

    def step(self) -> list[RequestOutput]:
        self._check_thread()
        if self.step_delay:
            time.sleep(self.step_delay)
        # admit waiting requests, oldest first
        running = [r for r in self.requests.values() if r.running]
        for req in self.requests.values():
            if not req.running and len(running) < self.max_num_seqs:
                if self._used_blocks() + self._blocks_of(req) <= self.num_blocks:
                    req.running = True
                    running.append(req)
        outputs = []
        for req in running:
            if "__boom__" in self.tokenizer.decode(req.prompt_token_ids):  # to test engine errors
                raise RuntimeError("boom: the fake engine failed on purpose")
            for choice in req.choices:
                if not choice.finish_reason:
                    self._generate_one(req, choice)
            out = self._output(req)
            outputs.append(out)
            if out.finished:
                del self.requests[req.request_id]
        return outputs

    def _generate_one(self, req: _Request, choice: _Choice) -> None:
        p = req.params
        body = [t for t in req.prompt_token_ids if t not in (BOS, EOS)] or [ord("x") + _OFFSET]
        pos = len(choice.token_ids) + choice.index
        token = EOS if pos >= len(body) and not p.ignore_eos else body[pos % len(body)]
        if len(choice.token_ids) < p.min_tokens and token == EOS:
            token = body[pos % len(body)]
        choice.token_ids.append(token)
        if p.logprobs is not None:
            alts = {token: Logprob(-0.25, 1, self.tokenizer.decode([token], skip_special_tokens=False))}
            for k in range(p.logprobs):
                alt = _OFFSET + ord("a") + (token + k) % 26
                if alt not in alts:
                    alts[alt] = Logprob(-1.0 - k, k + 2, self.tokenizer.decode([alt]))
            choice.logprobs.append(alts)
        if token == EOS or token in p.stop_token_ids:
            choice.finish_reason = "stop"
            choice.stop_reason = None if token == EOS else token
        else:
            choice.text += self.tokenizer.decode([token], skip_special_tokens=p.skip_special_tokens)
            for s in p.stop:
                if s in choice.text:
                    cut = choice.text.index(s) + (len(s) if p.include_stop_str_in_output else 0)
                    choice.text = choice.text[:cut]
                    choice.finish_reason, choice.stop_reason = "stop", s
                    break
        if not choice.finish_reason:
            total = len(req.prompt_token_ids) + len(choice.token_ids)
            if (
                p.max_tokens is not None and len(choice.token_ids) >= p.max_tokens
            ) or total >= self.max_model_len:
                choice.finish_reason = "length"

    def _output(self, req: _Request) -> RequestOutput:
        outs = [
            CompletionOutput(
                index=c.index,
                text=c.text,
                token_ids=list(c.token_ids),  # copies: outputs cross threads
                finish_reason=c.finish_reason,
                logprobs=list(c.logprobs) if req.params.logprobs is not None else None,
                stop_reason=c.stop_reason,
            )
            for c in req.choices
        ]
        now = time.time()
        metrics = RequestMetrics(req.arrival_time, now, now if req.finished else None)
        return RequestOutput(req.request_id, list(req.prompt_token_ids), outs, req.finished, metrics)

    def shutdown(self) -> None:
        """LLMEngine's stops its tensor-parallel workers; a fake has none."""

    def get_stats(self) -> EngineStats:
        self._check_thread()
        used = min(self._used_blocks(), self.num_blocks)
        running = sum(1 for r in self.requests.values() if r.running)
        return EngineStats(
            num_running=running,
            num_waiting=len(self.requests) - running,
            num_blocks_total=self.num_blocks,
            num_free_blocks=self.num_blocks - used,
            kv_cache_usage=used / self.num_blocks,
            num_preemptions=self.num_preemptions,
        )


@contextmanager
def serve_in_thread(
    engine: EngineClient, api_key: str | None = None
) -> Iterator[tuple[str, threading.Thread]]:
    """The real OpenAI server app over `engine` (an EngineClient: an AsyncEngine over a FakeEngine) on a free
    loopback port, in a thread: yields (base_url, thread) once /health answers; stops the server on exit."""
    import uvicorn
    from test_server import wait_healthy

    from pagedllm.entrypoints.openai.server import build_app

    app = build_app(engine, served_model_names=["fake"], api_key=api_key, shutdown_timeout=5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", ws="none"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base_url, 30, alive=thread.is_alive)
        yield base_url, thread
    finally:
        uv.should_exit = True
        thread.join(timeout=30)
