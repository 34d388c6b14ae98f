"""Structured outputs in the engine (offline LLM, the real default model): every kind of constraint, and a
constraint together with every other feature (n > 1, seeds, logprobs, stop strings, prefix caching,
chunked prefill, preemption), plus the sampler's bitmask and the scheduler's wait for a grammar."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import Future

import jsonschema
import pytest
import torch
from model_helpers import exact_llm

from pagedllm import SamplingParams, StructuredOutputsParams
from pagedllm.errors import InputError
from pagedllm.sampling_params import closed_schema
from pagedllm.worker.sampler import SamplingBatch, apply_token_bitmask, sample

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


PROMPT = chat("Give me a JSON object for a person named Bob who is 30.")


@pytest.fixture(scope="module")
def llm():
    return exact_llm(num_kv_blocks=256)


def gen(llm, prompt, **kw):
    kw.setdefault("max_tokens", 64)
    kw.setdefault("temperature", 0)
    return llm.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0]


# ---------------------------------------------------------------------------------------------- the sampler


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """[R, V] bools -> llguidance's [R, ceil(V / 32)] int32 bitmask (bit t of word t // 32)."""
    R, V = allowed.shape
    W = (V + 31) // 32
    bits = torch.zeros(R, W * 32, dtype=torch.int64)
    bits[:, :V] = allowed.long()
    words = (bits.view(R, W, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_bitmask_masks_exactly_the_forbidden_tokens_of_constrained_rows():
    gen_ = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 100, generator=gen_)
    allowed = torch.rand(2, 100, generator=gen_) < 0.3
    out = apply_token_bitmask(logits, torch.tensor([1, 3]), _pack(allowed))
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])  # unconstrained rows untouched
    for row, mask in ((1, allowed[0]), (3, allowed[1])):
        assert torch.equal(out[row][mask], logits[row][mask])
        assert torch.isinf(out[row][~mask]).all()
    assert not torch.isinf(logits).any()  # the model's logits are not modified


def test_sampled_tokens_are_always_allowed_greedy_and_random():
    gen_ = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 64, generator=gen_)
    allowed = torch.zeros(3, 64, dtype=torch.bool)
    allowed[0, [5, 9]] = allowed[1, [63]] = allowed[2, :40:3] = True
    for temperature in (0.0, 1.0):
        rows = [(SamplingParams(temperature=temperature, max_tokens=4), [1], [], None)] * 3
        batch = SamplingBatch.from_rows(rows, 64, token_bitmask=([0, 1, 2], _pack(allowed)))
        for _ in range(20):
            out = sample(logits, batch)
            assert all(allowed[i, t] for i, t in enumerate(out.token_ids))


# ---------------------------------------------------------------------------------------------- each kind


def test_json_schema_output_validates(llm):
    out = gen(llm, PROMPT, structured_outputs=StructuredOutputsParams(json=PERSON)).outputs[0]
    jsonschema.validate(json.loads(out.text), PERSON)
    assert out.finish_reason == "stop"


def test_json_object_regex_choice_and_grammar(llm):
    out = gen(llm, PROMPT, max_tokens=200, structured_outputs=StructuredOutputsParams(json_object=True))
    if out.outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(out.outputs[0].text), dict)
    else:  # a model may write keys until max_tokens: what it wrote is still an object's beginning
        assert out.outputs[0].text.lstrip().startswith("{")
    regex = r"\(\d{3}\) \d{3}-\d{4}"
    text = gen(llm, "Call me at ", structured_outputs=StructuredOutputsParams(regex=regex)).outputs[0].text
    assert re.fullmatch(regex, text)
    choices = ["yes", "no", "maybe"]
    text = gen(llm, chat("Is the sky blue?"), structured_outputs=StructuredOutputsParams(choice=choices))
    assert text.outputs[0].text in choices
    gbnf = 'root ::= "count: " [1-9] ("," [1-9])*'
    text = gen(llm, chat("Count to three."), structured_outputs=StructuredOutputsParams(grammar=gbnf))
    assert re.fullmatch(r"count: [1-9](,[1-9])*", text.outputs[0].text)
    lark = 'start: "color: " ("red" | "green" | "blue")'
    text = gen(llm, chat("Name a color."), structured_outputs=StructuredOutputsParams(grammar=lark))
    assert text.outputs[0].text in ("color: red", "color: green", "color: blue")


def test_eos_only_where_the_grammar_can_end_and_max_tokens_still_ends_it(llm):
    # a choice the model would never stop inside: it ends exactly when the choice is complete
    so = StructuredOutputsParams(choice=["supercalifragilistic"])
    out = gen(llm, chat("Say a word."), structured_outputs=so, ignore_eos=True).outputs[0]
    assert out.text == "supercalifragilistic" and out.finish_reason == "stop"
    out = gen(llm, PROMPT, max_tokens=3, structured_outputs=StructuredOutputsParams(json=PERSON)).outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_malformed_constraints_are_input_errors_naming_the_field(llm):
    cases = [
        (StructuredOutputsParams(json={"type": "no-such-type"}), "structured_outputs.json"),
        (StructuredOutputsParams(regex="(unclosed"), "structured_outputs.regex"),
        (StructuredOutputsParams(grammar="start: undefined_rule"), "structured_outputs.grammar"),
    ]
    for so, param in cases:
        with pytest.raises(InputError) as e:
            gen(llm, PROMPT, structured_outputs=so)
        assert e.value.param == param
    with pytest.raises(InputError, match="exactly one"):
        StructuredOutputsParams(json=PERSON, regex="a")
    with pytest.raises(InputError, match="exactly one"):
        StructuredOutputsParams()
    assert not llm.llm_engine.has_unfinished_requests()
    gen(llm, PROMPT, max_tokens=4)  # and the engine goes on


def test_closed_schema_closes_objects_that_do_not_say():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}}},
              "additionalProperties": True}  # fmt: skip
    closed = closed_schema(schema)
    assert closed["additionalProperties"] is True  # said otherwise: kept
    assert closed["properties"]["a"]["additionalProperties"] is False


# ---------------------------------------------------------------------------------------------- with other features


def test_n_seeds_logprobs_and_stop_strings(llm):
    so = StructuredOutputsParams(json=PERSON)
    params = dict(temperature=1.0, seed=7, n=3, max_tokens=64, logprobs=2, structured_outputs=so)
    first = llm.generate([PROMPT], SamplingParams(**params), use_tqdm=False)[0]
    again = llm.generate([PROMPT], SamplingParams(**params), use_tqdm=False)[0]
    for a, b in zip(first.outputs, again.outputs):
        assert a.token_ids == b.token_ids  # seeded: reproducible, grammar or not
        if a.finish_reason == "stop":
            jsonschema.validate(json.loads(a.text), PERSON)
        assert len(a.logprobs) == len(a.token_ids)
        assert all(lp[t].logprob <= 0.0 for lp, t in zip(a.logprobs, a.token_ids))
    out = gen(llm, PROMPT, structured_outputs=so, stop=['"age"']).outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == '"age"' and '"age"' not in out.text
    assert out.text.startswith('{\n  "name": "Bob",')


def test_same_output_with_prefix_cache_chunked_prefill_and_preemption():
    so = StructuredOutputsParams(json=PERSON)
    prompts = [chat(f"Give me a JSON object for a person named {n} who is {a}.") for n, a in
               (("Bob", 30), ("Alice", 41), ("Carol", 25), ("Dan", 60))]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=so)

    def run(**kw):
        llm = exact_llm(**kw)
        outs = llm.generate(prompts, params, use_tqdm=False)
        outs += llm.generate(prompts[:1], params, use_tqdm=False)  # prefix cache hit
        engine = llm.llm_engine
        return [o.outputs[0].token_ids for o in outs], engine.get_stats(), engine

    reference, _, _ = run(num_kv_blocks=256)
    chunked, _, _ = run(num_kv_blocks=256, max_num_batched_tokens=16)
    assert chunked == reference
    tight, stats, engine = run(num_kv_blocks=8, max_num_seqs=4)
    assert stats.num_preemptions > 0, "the test needs the pool to run short"
    assert tight == reference
    assert reference[0] == reference[-1]
    for ids in reference[:-1]:
        text = engine.tokenizer.decode(ids)
        jsonschema.validate(json.loads(text), PERSON)


def test_a_request_waits_for_its_grammar_while_others_run(llm):
    engine = llm.llm_engine
    pending: Future = Future()

    class Waiting:
        future = pending
        is_ready = False
        error = None

    engine.add_request("plain", "The capital of France is", SamplingParams(temperature=0, max_tokens=3))
    engine.add_request("waits", "Hello", SamplingParams(temperature=0, max_tokens=3))
    waiting = engine.scheduler.get_request("waits")
    waiting.structured_output = Waiting()
    finished = set()
    for _ in range(10):
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == {"plain"}
    assert waiting.num_computed_tokens == 0  # never scheduled
    waiting.structured_output = None  # "compiled": it runs now
    while engine.has_unfinished_requests():
        engine.step()


def test_grammars_compile_once_and_off_the_caller():
    from pagedllm.structured_output.manager import StructuredOutputManager

    class Tok:  # a manager whose compile never runs (no tokenizer needed): the request only waits
        pass

    calls, release = [], threading.Event()

    def compile_fails(grammar):
        calls.append(grammar)
        release.wait(30)
        raise InputError("no")

    manager = StructuredOutputManager(Tok(), 64, [0])
    manager._compile = compile_fails
    so = StructuredOutputsParams(json=PERSON)
    a, b = manager.request(so), manager.request(StructuredOutputsParams(json=dict(PERSON)))
    assert a.future is b.future  # same text, one compile
    assert not a.is_ready  # the caller did not wait for it
    release.set()
    a.future.exception(timeout=30)
    assert a.is_ready and a.error == "no" and len(calls) == 1  # reported, not raised into the step
    manager.shutdown()
