"""The offline API, the vLLM way: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from dataclasses import replace

from tqdm.auto import tqdm

from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.errors import InputError
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

    def __init__(self, model: str = "default", **engine_kwargs):
        self.llm_engine = LLMEngine(model=model, **engine_kwargs)
        self._ids = itertools.count()

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
    ) -> list[RequestOutput]:
        """Generates for every prompt; returns their outputs in input order. A prompt is text, token ids, or
        vLLM's prompt dicts ({"prompt": text} or {"prompt_token_ids": ids})."""
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
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        engine = self.llm_engine
        for rid, prompt, p in zip(ids, prompts, params):
            engine.add_request(rid, prompt, p)
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to one conversation or a list of them, then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.llm_engine.tokenizer
        prompts = [
            tok.encode(tok.apply_chat_template(c, add_generation_prompt=True), add_special_tokens=False)
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

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
