"""Prompt logprobs (SamplingParams.prompt_logprobs) against a transformers forward pass on the same weights,
in fp32: every prompt length around a block edge, chunked or not, with a cached prefix present, n > 1;
and the same numbers over HTTP (completions echo + logprobs) through the official `openai` client."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
import transformers
from model_helpers import exact_llm
from test_server import client, server  # noqa: F401 - fixtures: the real server on loopback, its client

from pagedllm import LLM, SamplingParams
from pagedllm.errors import InputError
from pagedllm.model.loader import resolve_model_path

LENGTHS = [1, 15, 16, 17, 300]
TOP = 3
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def hf():
    path = resolve_model_path("default")
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


def reference(hf, ids: list[int]) -> torch.Tensor:
    """[len, vocab] log-softmax of the next-token logits at every position."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 49152, (length,), generator=g).tolist()


def check(prompt_logprobs, ids: list[int], ref: torch.Tensor) -> None:
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for i in range(1, len(ids)):
        entry = prompt_logprobs[i]
        assert abs(entry[ids[i]].logprob - ref[i - 1, ids[i]].item()) <= TOLERANCE, i
        top = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank <= TOP)
        expected = ref[i - 1].topk(TOP)
        assert [t for _, t in top] == expected.indices.tolist() or _tied(ref[i - 1]), i
        for t, value in zip(expected.indices.tolist(), expected.values.tolist()):
            if t in entry:
                assert abs(entry[t].logprob - value) <= TOLERANCE


def _tied(row: torch.Tensor) -> bool:
    """Two alternatives closer than the tolerance may come in either order."""
    values = row.topk(TOP + 1).values
    return bool((values[:-1] - values[1:]).min() <= TOLERANCE)


@pytest.mark.parametrize("chunk", [None, 16], ids=["whole", "chunked"])
def test_prompt_logprobs_equal_transformers(hf, chunk):
    kw = {} if chunk is None else {"max_num_batched_tokens": chunk}
    llm = exact_llm(num_kv_blocks=256, **kw)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP)
    for length in LENGTHS:
        ids = prompt(length, length)
        ref = reference(hf, ids)
        (out,) = llm.generate([ids], params, use_tqdm=False)
        check(out.prompt_logprobs, ids, ref)
        # again with the prompt's blocks in the prefix cache: no shortcut skips positions
        (again,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        check(again.prompt_logprobs, ids, ref)
    ids = prompt(40, 99)
    (out,) = llm.generate([ids], SamplingParams(temperature=0.8, seed=1, n=3, max_tokens=4, prompt_logprobs=TOP),
                          use_tqdm=False)  # fmt: skip
    check(out.prompt_logprobs, ids, reference(hf, ids))
    assert len(out.outputs) == 3


def test_without_prompt_logprobs_nothing_is_computed():
    llm = LLM(model="default", show_progress=False)
    (out,) = llm.generate(["Hello there"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert out.prompt_logprobs is None
    with pytest.raises(InputError, match="prompt dict"):
        llm.generate([{"prompt": "a", "multi_modal_data": {}}], SamplingParams(max_tokens=1), use_tqdm=False)


def test_echo_logprobs_over_http_match(client, server, hf):
    text = "The capital of France is Paris, and the capital of Italy is Rome."
    r = client.completions.create(
        model=server.model, prompt=text, echo=True, logprobs=2, max_tokens=1, temperature=0
    )
    lp = r.choices[0].logprobs
    ids = httpx.post(
        server.url("/tokenize"), json={"prompt": text}, headers=server.headers, timeout=30
    ).json()["tokens"]
    assert r.choices[0].text.startswith(text)
    n = len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.token_logprobs) == n + 1 and all(v is not None for v in lp.token_logprobs[1:])
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])]
    # the server runs the GGUF natively (int8 activations): the numbers are those of its own forward pass,
    # so compare with the offline engine in the server's own configuration
    llm = LLM(model="default", show_progress=False)
    (out,) = llm.generate(
        [ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2), use_tqdm=False
    )
    for i in range(1, n):
        assert abs(lp.token_logprobs[i] - out.prompt_logprobs[i][ids[i]].logprob) <= 1e-4
    # and close to transformers in fp32 (what a quantized server changes)
    ref = reference(hf, ids)
    assert max(abs(lp.token_logprobs[i] - ref[i - 1, ids[i]].item()) for i in range(1, n)) < 0.5
    # max_tokens=0 with echo scores without generating; without echo it is a 400
    scored = client.completions.create(model=server.model, prompt=text, echo=True, logprobs=0, max_tokens=0)
    choice = scored.choices[0]
    assert (
        choice.text == text
        and len(choice.logprobs.token_logprobs) == n
        and scored.usage.completion_tokens == 0
    )
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:n], abs=1e-5)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=server.model, prompt=text, max_tokens=0)
    # vLLM's prompt_logprobs field
    raw = client.completions.create(
        model=server.model, prompt=text, max_tokens=1, extra_body={"prompt_logprobs": 1}
    )
    field = raw.choices[0].model_extra["prompt_logprobs"]
    assert field[0] is None and len(field) == n
    assert field[1][str(ids[1])]["logprob"] == pytest.approx(lp.token_logprobs[1], abs=1e-5)
    # the model card and the tokenizer's description
    assert client.models.retrieve(server.model).id == server.model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    info = httpx.get(server.url("/tokenizer_info"), headers=server.headers, timeout=30).json()
    assert info["eos_token"] == "<|im_end|>" and info["chat_template"]
