"""The offline API, the vLLM way: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import closing
from dataclasses import replace

from tqdm.auto import tqdm

from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.pooling_engine import PoolingEngine, PoolingInput, is_pooling_model
from pagedllm.errors import InputError
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int]
Message = dict[str, str]


class LLM:
    """Loads a model once and generates for many prompts in continuous batches.

    >>> llm = LLM(model="default")
    >>> out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    >>> out[0].outputs[0].text
    """

    def __init__(self, model: str = "default", runner: str = "auto", **engine_kwargs):
        """runner: "auto" serves an embedding / cross-encoder folder with the pooling engine (embed, score)
        and anything else with the generative one; "pooling" pools a decoder, "generate" never pools."""
        self.pooling_engine: PoolingEngine | None = None
        if is_pooling_model(model, runner):
            self.pooling_engine = PoolingEngine(model, runner=runner, **_pooling_kwargs(engine_kwargs))
        else:
            self.llm_engine = LLMEngine(model=model, **engine_kwargs)
        self._ids = itertools.count()

    def embed(
        self, texts: str | list[str] | list[int] | list[list[int]], truncate_prompt_tokens: int | None = None
    ) -> list[list[float]]:
        """One embedding per text (or token-id list), as the pooling model pools (and normalizes) it;
        truncate_prompt_tokens keeps at most that many tokens of each (else a longer input is refused)."""
        engine = self._pooling("embed")
        if isinstance(texts, str) or (texts and isinstance(texts[0], int)):
            texts = [texts]
        items = [
            engine.tokenize(t, truncate_prompt_tokens, "texts")
            if isinstance(t, str)
            else engine.check(PoolingInput(list(t)), truncate_prompt_tokens, "texts")
            for t in texts
        ]
        return engine.embed(items).tolist()

    def score(
        self, query: str | list[str], documents: str | list[str], truncate_prompt_tokens: int | None = None
    ) -> list[float]:
        """vLLM's LLM.score: one score per document against the query (or per (query, document) pair when
        both are lists of the same length): a cross-encoder's, or an embedder's cosine similarity."""
        engine = self._pooling("embed", "score")
        docs = [documents] if isinstance(documents, str) else list(documents)
        queries = [query] * len(docs) if isinstance(query, str) else list(query)
        if len(queries) != len(docs):
            raise InputError(f"{len(queries)} queries for {len(docs)} documents", param="documents")
        scores, _ = engine.score_pairs(list(zip(queries, docs)), truncate_prompt_tokens, "documents")
        return scores.tolist()

    def _pooling(self, *tasks: str) -> PoolingEngine:
        if self.pooling_engine is None:
            raise InputError("this LLM holds a generative model; load an embedding or scoring one", "model")
        if self.pooling_engine.task not in tasks:
            raise InputError("this LLM holds a cross-encoder: use LLM.score", param="model")
        return self.pooling_engine

    def reset_prefix_cache(self) -> bool:
        """Drop all cached prefixes (vLLM's LLM.reset_prefix_cache); False while requests are running."""
        return self.llm_engine.reset_prefix_cache()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt; returns their outputs in input order. A prompt is text, token ids, or
        vLLM's prompt dicts ({"prompt": text} or {"prompt_token_ids": ids}). priority: one per prompt, lower
        first, for an LLM made with scheduling_policy="priority" (fcfs takes only 0s). lora_request: the
        adapter of every prompt, or one per prompt (None: the base model), for an LLM made with
        enable_lora=True."""
        if self.pooling_engine is not None:
            raise InputError("this LLM holds an embedding or scoring model: use embed or score", "model")
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = [_prompt(p) for p in prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise InputError(
                    f"got {len(params)} sampling_params for {len(prompts)} prompts", param="sampling_params"
                )
        else:
            params = [params] * len(prompts)
        # The loop below reads only finished outputs, so the engine need not build the others (vLLM's LLM
        # does the same). The caller's objects are left as they are.
        final_only = {id(p): replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params}
        params = [final_only[id(p)] for p in params]
        if priority is None:
            priority = [0] * len(prompts)
        elif len(priority) != len(prompts):
            raise InputError(f"got {len(priority)} priorities for {len(prompts)} prompts", param="priority")
        if isinstance(lora_request, list):
            if len(lora_request) != len(prompts):
                raise InputError(
                    f"got {len(lora_request)} lora_requests for {len(prompts)} prompts", param="lora_request"
                )
            loras = lora_request
        else:
            loras = [lora_request] * len(prompts)
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        engine = self.llm_engine
        added: list[str] = []
        try:
            for rid, prompt, p, rank, lora in zip(ids, prompts, params, priority, loras):
                engine.add_request(rid, prompt, p, priority=rank, lora_request=lora)
                added.append(rid)
        except BaseException:  # a refused prompt: none of this call's requests stays in the engine
            engine.abort_request(added)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to one conversation or a list of them, then generates. Each
        output's prompt is the rendered template text (as vLLM's)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        rendered = [self._chat_prompt(c) for c in conversations]
        outputs = self.generate([ids for _, ids in rendered], sampling_params, use_tqdm)
        for out, (text, _) in zip(outputs, rendered):
            out.prompt = text  # the engine got token ids (the template's own special tokens), so no text
        return outputs

    def stream(
        self, prompt: Prompt | dict, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Generates for one prompt and yields as it goes: each RequestOutput holds only what is new since
        the previous one (vLLM's DELTA outputs: each CompletionOutput's text and token_ids are the new part;
        the last one has finished=True). The text comes from the engine's incremental detokenizer, which
        holds back an incomplete UTF-8 character or a possible stop string until it is settled, so a piece
        never splits a character. Closing the generator early (break, an exception, Ctrl-C) aborts the
        request; use contextlib.closing() to close it at once rather than when it is garbage-collected."""
        prompt = _prompt(prompt)
        # CUMULATIVE, cut into deltas here: the engine's outputs are cumulative, and its text only grows.
        params = replace(sampling_params or SamplingParams(), output_kind=RequestOutputKind.CUMULATIVE)
        rid = f"stream-{next(self._ids)}"
        engine = self.llm_engine
        engine.add_request(rid, prompt, params)
        seen: dict[int, tuple[int, int, bool]] = {}  # sample index -> (chars, tokens, finished) yielded
        finished = False
        try:
            while not finished:
                for out in engine.step():
                    if out.request_id != rid:
                        continue
                    finished = out.finished
                    deltas = []
                    for c in out.outputs:
                        chars, tokens, done = seen.get(c.index, (0, 0, False))
                        seen[c.index] = (len(c.text), len(c.token_ids), c.finish_reason is not None)
                        if c.text[chars:] or c.token_ids[tokens:] or (c.finish_reason and not done):
                            deltas.append(replace(c, text=c.text[chars:], token_ids=c.token_ids[tokens:]))
                    if deltas or finished:
                        yield replace(out, outputs=deltas)
        finally:
            if not finished:
                engine.abort_request(rid)

    def stream_chat(
        self, messages: list[Message], sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """stream() for one conversation, through the chat template; prompt is the rendered text."""
        text, ids = self._chat_prompt(messages)
        with closing(self.stream(ids, sampling_params)) as outputs:  # closing this closes (aborts) that
            for out in outputs:
                out.prompt = text
                yield out

    def _chat_prompt(self, conversation: list[Message]) -> tuple[str, list[int]]:
        """The conversation through the chat template: its text and token ids. The text already holds the
        template's special tokens, so encoding adds none."""
        tok = self.llm_engine.tokenizer
        text = tok.apply_chat_template(conversation, add_generation_prompt=True)
        return text, tok.encode(text, add_special_tokens=False)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        pending = set(ids)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm)
        try:
            while pending:
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        finished[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
        except BaseException:
            engine.abort_request(list(pending))
            raise
        finally:
            bar.close()
        return [finished[i] for i in ids]


def _pooling_kwargs(kwargs: dict) -> dict:
    """The LLM keywords a pooling engine takes; a generation-only one (a KV cache size, ...) is refused."""
    taken = {"dtype", "max_num_batched_tokens", "max_num_seqs", "max_model_len"}
    ignored = {"show_progress", "seed"}
    refused = sorted(set(kwargs) - taken - ignored)
    if refused:
        raise InputError(f"{refused[0]} does not apply to a pooling model", param=refused[0])
    return {k: v for k, v in kwargs.items() if k in taken}


def _prompt(prompt: Prompt | dict) -> Prompt:
    """vLLM's TextPrompt / TokensPrompt dicts as the text or ids they hold; anything else as it is."""
    if not isinstance(prompt, dict):
        return prompt
    extra = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
    if extra:
        raise InputError(f"prompt dict field {extra[0]!r} is not supported", param="prompts")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise InputError(
            'a prompt dict holds exactly one of "prompt" and "prompt_token_ids"', param="prompts"
        )
    return prompt["prompt"] if "prompt" in prompt else list(prompt["prompt_token_ids"])
