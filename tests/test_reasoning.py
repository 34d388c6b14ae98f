"""Reasoning parsers (--reasoning-parser qwen3 | deepseek_r1): the think block apart from the answer.

The parsers on crafted strings, whole and fed delta by delta with boundaries inside the tags; then the real
server with the default model, whose output a regex constraint forces into <think>...</think>answer
(--structured-outputs-config '{"enable_in_reasoning": true}' lets the constraint cover the think block),
through the `openai` client, streamed and not.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import threading
from collections.abc import Iterator

import openai
import pytest
import torch
import uvicorn
from test_server import API_KEY, REQUEST_TIMEOUT_S, ServerInfo, free_port, wait_healthy

from pagedllm.engine.async_engine import AsyncEngine
from pagedllm.entrypoints.openai.cli_args import add_arguments, make_engine, reasoning_options
from pagedllm.entrypoints.openai.server import build_app
from pagedllm.entrypoints.reasoning import REASONING_PARSERS, get_reasoning_parser
from pagedllm.errors import InputError
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.config import parse_structured_outputs_config
from pagedllm.structured_output.manager import StructuredOutputManager

# (text, state) -> (reasoning, answer), per parser; state: what the prompt left open (None: unknown)
CASES = {
    "qwen3": [
        ("<think>abc</think>xyz", None, ("abc", "xyz")),
        ("\n<think>\nabc\n</think>\n\nxyz", None, ("\nabc\n", "\n\nxyz")),
        ("abc</think>xyz", None, ("abc", "xyz")),  # the template opened the block
        ("abc", None, (None, "abc")),  # no block at all
        ("<think>abc", None, ("abc", "")),  # cut inside the block (max_tokens)
        ("<think></think>xyz", None, ("", "xyz")),
        ("<thi", None, (None, "<thi")),
        ("", None, (None, "")),
        ("abc</think>xyz", "reasoning", ("abc", "xyz")),
        ("abc", "reasoning", ("abc", "")),
        ("<think>abc</think>xyz", "reasoning", ("abc", "xyz")),
        ("<think>abc</think>xyz", "content", (None, "<think>abc</think>xyz")),  # thinking off
        ("a</think>b</think>c", None, ("a", "b</think>c")),
        ("abc</think>xyz", "start", (None, "abc</think>xyz")),  # the prompt did not open it: no block
        ("<think>abc</think>xyz", "start", ("abc", "xyz")),
    ],
    "deepseek_r1": [
        ("<think>abc</think>xyz", None, ("abc", "xyz")),
        ("abc</think>xyz", None, ("abc", "xyz")),
        ("abc", None, ("abc", "")),  # no </think>: all reasoning
        ("<think>abc", None, ("abc", "")),
        ("\nabc</think>", None, ("\nabc", "")),
        ("<thi", None, ("<thi", "")),
        ("abc", "content", (None, "abc")),
        ("abc</think>xyz", "start", ("abc", "xyz")),
        ("a</think>b</think>c", None, ("a", "b</think>c")),
    ],
}


@pytest.mark.parametrize(
    "name,text,state,expected",
    [(name, *case) for name, cases in CASES.items() for case in cases],
)
def test_split(name: str, text: str, state, expected) -> None:
    assert get_reasoning_parser(name).split(text, state) == expected


def streamed(name: str, deltas: list[str], state=None) -> tuple[str | None, str]:
    """A stream's deltas added up as a client does (reasoning None when no reasoning delta came)."""
    stream = get_reasoning_parser(name).stream(state)
    reasoning: list[str] = []
    answer = ""
    for r, c in [*(stream.feed(d) for d in deltas), stream.finish()]:
        assert r != "" and c != ""  # an empty delta is None
        if r is not None:
            reasoning.append(r)
        answer += c or ""
    return ("".join(reasoning) if reasoning else None), answer


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_stream_adds_up_to_split_at_every_boundary(name: str) -> None:
    """Every case cut into two and three deltas at every pair of places (inside the tags too) adds up to
    the split of the whole, but for the one case a stream cannot know in advance (the module docstring)."""
    for text, state, expected in CASES[name]:
        if (
            name == "qwen3"
            and state is None
            and not text.lstrip().startswith("<think>")
            and "</think>" in text
        ):
            # streamed as answer: a later </think> stays in it
            assert streamed(name, [text[:1], text[1:]], state) == (None, text)
            continue
        reasoning, answer = expected
        want = (reasoning or None, answer)  # a stream sends no empty reasoning delta
        for i in range(len(text) + 1):
            for j in range(i, len(text) + 1):
                got = streamed(name, [text[:i], text[i:j], text[j:]], state)
                assert got == want, (text, i, j)


def test_stream_holds_back_only_a_possible_tag() -> None:
    stream = get_reasoning_parser("qwen3").stream()
    assert stream.feed("<thi") == (None, None)  # could still be <think>
    assert stream.feed("nk>I think") == ("I think", None)
    assert stream.feed(" so</th") == (" so", None)  # "</th" could be the end tag
    assert stream.feed("ink>\n\nYes") == (None, "\n\nYes")
    assert stream.feed("</think>") == (None, "</think>")  # after the block everything is answer
    assert stream.finish() == (None, None)
    r1 = get_reasoning_parser("deepseek_r1").stream()
    assert r1.feed("Hmm") == ("Hmm", None)  # no <think> needed
    assert r1.feed(" <") == (" ", None)
    assert r1.finish() == ("<", None)  # the end: a partial tag is text


@pytest.mark.parametrize(
    "tail,state",
    [
        ("<|im_start|>assistant\n<think>\n", "reasoning"),  # Qwen3 thinking models open the block
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "content"),  # enable_thinking=False
        ("<|im_start|>assistant\n", "start"),
    ],
)
def test_prompt_state(tail: str, state) -> None:
    for name in REASONING_PARSERS:
        assert get_reasoning_parser(name).prompt_state(tail) == state


def test_unknown_parser_and_config() -> None:
    with pytest.raises(ValueError, match="known: deepseek_r1, qwen3"):
        get_reasoning_parser("nope")
    assert parse_structured_outputs_config('{"enable_in_reasoning": true}').enable_in_reasoning
    assert not parse_structured_outputs_config(None).enable_in_reasoning
    for bad, match in [
        ("{", "not JSON"),
        ("[]", "JSON object"),
        ('{"disable_any_whitespace": true}', "'disable_any_whitespace' is not supported"),
        ('{"backend": "xgrammar"}', "backend 'xgrammar'"),
        ('{"enable_in_reasoning": "yes"}', "true or false"),
    ]:
        with pytest.raises(InputError, match=match) as e:
            parse_structured_outputs_config(bad)
        assert e.value.param == "--structured-outputs-config"


# ---------------------------------------------------------------------------------------------- real server

# Forced shapes: each parser's think block and answer (bounded words: a greedy model may run one on).
THINK = r"[a-z]{1,10}( [a-z]{1,10}){1,5}"
ANSWER = r"[A-Z][a-z]{0,10}( [a-z]{1,10}){1,5}\."
ASK = [{"role": "user", "content": "Is the sky blue? Think first, then answer."}]
# No prefix caching: tests below ask the same prompt twice and compare greedy tokens, which holds only where
# both requests compute the prompt alike; at the amx tier a prefix-cache hit leaves the prompt's last few
# tokens to the int8 gemv where the whole prompt ran the bf16 AMX tiles (README: --batch-invariant).
ENGINE_ARGS = [
    "--num-kv-blocks",
    "256",
    "--max-num-seqs",
    "8",
    "--max-model-len",
    "1024",
    "--no-prefix-caching",
]


def server_args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([*ENGINE_ARGS, *extra])


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncEngine]:
    """One real engine (the default model) behind both parsers' apps: one model load for the module."""
    engine = AsyncEngine(make_engine(server_args()))
    yield engine
    asyncio.run(engine.shutdown(timeout=5))


@contextlib.contextmanager
def serve(engine: AsyncEngine, *flags: str) -> Iterator[ServerInfo]:
    """The server's app as `serve` builds it with these flags, over `engine`, on loopback in a thread."""
    reasoning_parser, enable_in_reasoning = reasoning_options(server_args(*flags))
    app = build_app(
        engine,
        served_model_names=["default"],
        api_key=API_KEY,
        reasoning_parser=reasoning_parser,
        enable_in_reasoning=enable_in_reasoning,
    )
    port = free_port()
    # lifespan off: the engine outlives this app (the other apps of the module serve it too)
    uv = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off", ws="none")
    )
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    info = ServerInfo(base_url=f"http://127.0.0.1:{port}", model="default")
    info.parser = reasoning_parser
    try:
        wait_healthy(info.base_url, 30, alive=thread.is_alive)
        yield info
    finally:
        uv.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module", params=sorted(REASONING_PARSERS))
def server(request: pytest.FixtureRequest, engine: AsyncEngine) -> Iterator[ServerInfo]:
    """A parser, and constraints over the whole output (think block included)."""
    with serve(
        engine,
        *("--reasoning-parser", request.param),
        *("--structured-outputs-config", '{"enable_in_reasoning": true}'),
    ) as info:
        yield info


@pytest.fixture(scope="module")
def gated_server(engine: AsyncEngine) -> Iterator[ServerInfo]:
    """deepseek_r1 with constraints on the answer only (vLLM's default)."""
    with serve(engine, "--reasoning-parser", "deepseek_r1") as info:
        yield info


def connect(info: ServerInfo) -> openai.OpenAI:
    return openai.OpenAI(base_url=info.url("/v1"), api_key=API_KEY, timeout=REQUEST_TIMEOUT_S, max_retries=0)


@pytest.fixture
def client(server: ServerInfo) -> Iterator[openai.OpenAI]:
    with connect(server) as c:
        yield c


def reasoning_of(delta) -> str:
    """A streamed delta's reasoning_content (an extra field to the `openai` client)."""
    return (delta.model_extra or {}).get("reasoning_content") or ""


def forced(client: openai.OpenAI, server: ServerInfo, regex: str, **kw):
    return client.chat.completions.create(
        model=server.model,
        messages=ASK,
        temperature=0,
        max_tokens=80,
        extra_body={"structured_outputs": {"regex": regex}},
        **kw,
    )


@pytest.mark.slow
@pytest.mark.parametrize("opened", [True, False], ids=["with <think>", "without <think>"])
def test_chat_splits_the_forced_think_block(client: openai.OpenAI, server: ServerInfo, opened: bool) -> None:
    """Non-streamed and streamed, the two parts come apart exactly: each matches its own part of the
    constraint, and streamed deltas add up to the same two texts."""
    regex = ("<think>" if opened else "") + THINK + "</think>" + ANSWER
    r = forced(client, server, regex)
    message = r.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    if not opened and server.parser == "qwen3":
        # neither this template (SmolLM2's) nor the output opened a block: no reasoning, all answer
        assert reasoning is None
        assert re.fullmatch(THINK + "</think>" + ANSWER, message.content), message.content
    else:
        assert re.fullmatch(THINK, reasoning), reasoning
        assert re.fullmatch(ANSWER, message.content), message.content
    assert r.choices[0].finish_reason == "stop"

    chunks = [c.choices[0].delta for c in forced(client, server, regex, stream=True) if c.choices]
    parts = [(reasoning_of(d), d.content or "") for d in chunks]
    assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == (reasoning or "", message.content)
    # all reasoning arrives before any answer text
    kinds = ["r" if r else "c" for r, c in parts if r or c]
    assert kinds == sorted(kinds, reverse=True) and kinds[-1] == "c"


@pytest.mark.slow
def test_no_think_block(client: openai.OpenAI, server: ServerInfo) -> None:
    """qwen3: an answer with no think block is all content; deepseek_r1 reads it all as reasoning."""
    r = forced(client, server, ANSWER)
    message = r.choices[0].message
    if server.parser == "qwen3":
        assert message.model_extra["reasoning_content"] is None
        assert re.fullmatch(ANSWER, message.content)
    else:
        assert re.fullmatch(ANSWER, message.model_extra["reasoning_content"])
        assert message.content is None


def test_config_flags() -> None:
    assert reasoning_options(server_args()) == (None, False)
    assert reasoning_options(server_args("--structured-outputs-config", '{"reasoning_parser": "qwen3"}')) == (
        "qwen3",
        False,
    )
    with pytest.raises(InputError, match="names reasoning_parser 'qwen3', --reasoning-parser 'deepseek_r1'"):
        reasoning_options(
            server_args(
                *("--reasoning-parser", "deepseek_r1"),
                *("--structured-outputs-config", '{"reasoning_parser": "qwen3"}'),
            )
        )
    with pytest.raises(InputError, match="unknown reasoning_parser 'nope'"):
        reasoning_options(server_args("--structured-outputs-config", '{"reasoning_parser": "nope"}'))


# ---------------------------------------------------------------------------------------------- the gate


@pytest.mark.slow
def test_constraint_starts_after_the_think_block(engine: AsyncEngine) -> None:
    """start_after="</think>" (a tag of three tokens for this vocabulary): every token is free until the
    output has contained it, drafts stop before the token that completes it, then the grammar applies."""
    tok = engine.tokenizer
    manager = StructuredOutputManager(tok.hf, engine.model_config.vocab_size, [tok.hf.eos_token_id])
    digits = [tok.encode(d, add_special_tokens=False)[0] for d in "123"]
    think = tok.encode("I see </think>", add_special_tokens=False)
    assert len(think) > 3  # the tag spans tokens

    class Req:
        structured_output = manager.request(StructuredOutputsParams(regex="[0-9]{3}", start_after="</think>"))

    so = Req.structured_output
    so.future.result(timeout=60)
    assert so.is_ready and so.gated
    for i, t in enumerate(think):
        assert (manager.grammar_bitmask([Req]) == -1).all()  # free: no grammar yet
        assert manager.validate_drafts(Req, think[i:] + digits) == think[i:-1]  # up to the tag's last token
        assert so.accept_token(t)
    assert not so.gated
    allowed = allowed_tokens(manager.grammar_bitmask([Req])[0], engine.model_config.vocab_size)
    assert allowed and all(re.fullmatch("[0-9]", tok.decode([t])) for t in allowed)
    for t in digits:
        assert so.accept_token(t)
    assert so.is_terminated

    class Plain:  # the same constraint without start_after applies from the first token
        structured_output = manager.request(StructuredOutputsParams(regex="[0-9]{3}"))

    Plain.structured_output.future.result(timeout=60)
    assert Plain.structured_output.is_ready and not Plain.structured_output.gated
    assert allowed_tokens(manager.grammar_bitmask([Plain])[0], engine.model_config.vocab_size) == allowed
    manager.shutdown()


def allowed_tokens(row: torch.Tensor, vocab_size: int) -> list[int]:
    """The token ids a bitmask row allows (bit t % 32 of word t // 32)."""
    bits = (row.long().unsqueeze(-1) >> torch.arange(32)) & 1
    return bits.flatten()[:vocab_size].nonzero().flatten().tolist()


@pytest.mark.slow
def test_chat_constraint_applies_after_the_think_block(engine: AsyncEngine, gated_server: ServerInfo) -> None:
    """Without enable_in_reasoning the regex constrains only the answer: the model writes a free think
    block (closed by max_reasoning_tokens; min_tokens keeps it from ending there), and then only the regex's
    digits; with enable_in_reasoning (the `server` apps) the same request gives digits from the start.
    (Not logit_bias on the tag's tokens: how soon the default model then closes the block is a near-tie that
    differs between CPU tiers.)"""
    regex = {"structured_outputs": {"regex": "[0-9]{3}"}}
    ask = [{"role": "user", "content": "Repeat exactly: </think>123"}]
    with connect(gated_server) as client:
        r = client.chat.completions.create(
            model="default",
            messages=ask,
            temperature=0,
            max_tokens=30,
            extra_body={**regex, "max_reasoning_tokens": 6, "min_tokens": 6},
        )
    message = r.choices[0].message
    assert re.fullmatch("[0-9]{3}", message.content), message.content
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and not re.fullmatch("[0-9]*", reasoning)  # the think block was not constrained
    assert r.choices[0].finish_reason == "stop"
    with serve(
        engine,
        "--reasoning-parser",
        "deepseek_r1",
        "--structured-outputs-config",
        '{"enable_in_reasoning": true}',
    ) as whole:
        with connect(whole) as client:
            r = client.chat.completions.create(
                model="default", messages=ask, temperature=0, max_tokens=30, extra_body=regex
            )
    assert re.fullmatch("[0-9]{3}", r.choices[0].message.model_extra["reasoning_content"])
    assert r.choices[0].message.content is None


@pytest.mark.slow
def test_budget_forces_the_tag(engine: AsyncEngine) -> None:
    """start_after_budget=2: two free tokens, then each row allows only the next token of </think> (after
    the part the output already ends with), and no draft reaches past the budget."""
    tok = engine.tokenizer
    manager = StructuredOutputManager(tok.hf, engine.model_config.vocab_size, [tok.hf.eos_token_id])
    vocab = engine.model_config.vocab_size
    params = StructuredOutputsParams(regex="[0-9]{3}", start_after="</think>", start_after_budget=2)

    class Req:
        structured_output = manager.request(params)

    so = Req.structured_output
    so.future.result(timeout=60)
    assert so.is_ready
    hello, lt = (
        tok.encode("Hello", add_special_tokens=False)[0],
        tok.encode(" <", add_special_tokens=False)[0],
    )
    assert manager.validate_drafts(Req, [hello, hello, hello]) == [hello]  # rows 0 and 1 are within budget
    for t in (hello, lt):  # " <": the output now ends with the tag's first byte
        assert (manager.grammar_bitmask([Req]) == -1).all()
        assert so.accept_token(t)
    assert manager.validate_drafts(Req, [hello]) == []
    forced = []
    while so.gated:
        allowed = allowed_tokens(manager.grammar_bitmask([Req])[0], vocab)
        assert len(allowed) == 1
        forced += allowed
        assert so.accept_token(allowed[0])
    assert tok.decode(forced) == "/think>"  # the rest of the tag, "<" already written
    digits = allowed_tokens(manager.grammar_bitmask([Req])[0], vocab)
    assert digits and all(re.fullmatch("[0-9]", tok.decode([t])) for t in digits)
    manager.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_max_reasoning_tokens(engine: AsyncEngine, gated_server: ServerInfo, stream: bool) -> None:
    """deepseek_r1 on a model that never closes the block by itself: max_reasoning_tokens=6 closes it after
    six tokens, and an answer follows; without the budget all of it is reasoning."""
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    with connect(gated_server) as client:

        def reply(**body):
            r = client.chat.completions.create(
                model="default", messages=ask, temperature=0, max_tokens=24, extra_body=body, stream=stream
            )
            if not stream:
                m = r.choices[0].message
                return m.model_extra["reasoning_content"], m.content
            deltas = [c.choices[0].delta for c in r if c.choices]
            return "".join(reasoning_of(d) for d in deltas), "".join(d.content or "" for d in deltas) or None

        # min_tokens: after the forced </think> the model may end at once (it does on the amx tier)
        reasoning, content = reply(max_reasoning_tokens=6, min_tokens=14)
        assert len(engine.tokenizer.encode(reasoning, add_special_tokens=False)) <= 6
        assert reasoning and content  # the block was closed, and an answer followed
        free, none = reply()
        assert none is None and free.startswith(reasoning)  # greedy: the same first tokens, never closed
        with pytest.raises(openai.BadRequestError, match="max_reasoning_tokens"):
            reply(max_reasoning_tokens=-1)


@pytest.mark.slow
def test_budget_refusals_and_no_parser(
    engine: AsyncEngine, client: openai.OpenAI, server: ServerInfo
) -> None:
    """A budget with a constraint over the think block (enable_in_reasoning) is refused by name, and so is
    a budget without a parser; without a parser the think block stays in the content, streamed or not."""
    body = {"structured_outputs": {"regex": "<think>" + THINK + "</think>" + ANSWER}}
    with pytest.raises(openai.BadRequestError, match="max_reasoning_tokens cannot be combined") as e:
        client.chat.completions.create(
            model="default", messages=ASK, max_tokens=8, extra_body={**body, "max_reasoning_tokens": 4}
        )
    assert e.value.body["param"] == "max_reasoning_tokens"
    with (
        serve(engine) as plain,
        connect(plain) as c,
    ):
        with pytest.raises(openai.BadRequestError, match="needs a server started with --reasoning-parser"):
            c.chat.completions.create(model="default", messages=ASK, extra_body={"max_reasoning_tokens": 4})
        r = c.chat.completions.create(
            model="default", messages=ASK, temperature=0, max_tokens=80, extra_body=body
        )
        assert r.choices[0].message.model_extra["reasoning_content"] is None
        assert r.choices[0].message.content.startswith("<think>")
        deltas = [ch.choices[0].delta for ch in c.chat.completions.create(
            model="default", messages=ASK, temperature=0, max_tokens=80, extra_body=body, stream=True
        ) if ch.choices]  # fmt: skip
        assert not any(reasoning_of(d) for d in deltas)
        assert "".join(d.content or "" for d in deltas) == r.choices[0].message.content


def prefilled(client: openai.OpenAI, prefill: str, regex: str):
    """A reply that continues an assistant message: its end is where the prompt leaves the think block
    (a Qwen3 template renders "<think>\\n" for thinking models, "<think>\\n\\n</think>\\n\\n" with
    enable_thinking=False)."""
    messages = [*ASK, {"role": "assistant", "content": prefill}]
    body = {
        "structured_outputs": {"regex": regex},
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    r = client.chat.completions.create(
        model="default", messages=messages, temperature=0, max_tokens=60, extra_body=body
    )
    return r.choices[0].message.model_extra["reasoning_content"], r.choices[0].message.content


@pytest.mark.slow
def test_prompt_opened_the_block(client: openai.OpenAI, server: ServerInfo) -> None:
    """A prompt ending in <think>: the output is reasoning up to </think> without writing <think>."""
    reasoning, content = prefilled(client, "<think>\n", THINK + "</think>" + ANSWER)
    assert re.fullmatch(THINK, reasoning) and re.fullmatch(ANSWER, content), (reasoning, content)


@pytest.mark.slow
def test_prompt_closed_the_block(gated_server: ServerInfo) -> None:
    """A prompt whose think block is already closed (thinking off): deepseek_r1 reads the output as all
    answer, and the constraint applies from its first token (no gate waits for a </think>)."""
    with connect(gated_server) as client:
        reasoning, content = prefilled(client, "<think>\n\n</think>\n\n", "[0-9]{3}")
    assert reasoning is None and re.fullmatch("[0-9]{3}", content), (reasoning, content)
