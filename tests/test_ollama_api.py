"""Ollama's API (/api/*) on the real server with the default model, through the official `ollama` client.

Chat and generate, streamed (Ollama's default) and not, must say the same under temperature 0; the
listing routes must carry what clients read (/api/tags' `model`, /api/show's `model_info`); format, tools
and options reach the chat path; bad input is a 4xx with Ollama's {"error": "..."} and the server serves on.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import ollama
import pytest
from test_server import REQUEST_TIMEOUT_S, ServerInfo, running_server

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "num_predict": 12}
COLORS = [{"role": "user", "content": "Name three colors."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "the city"}},
            "required": ["city"],
        },
    },
}
CALL_PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerInfo]:
    log = tmp_path_factory.mktemp("ollama") / "server.log"
    with running_server(
        log, "--num-kv-blocks", "512", "--max-num-seqs", "32", "--max-model-len", "2048"
    ) as info:
        yield info


@pytest.fixture(scope="module")
def client(server: ServerInfo) -> Iterator[ollama.Client]:
    c = ollama.Client(host=server.base_url, headers=server.headers, timeout=REQUEST_TIMEOUT_S)
    yield c
    c.close()


def post(server: ServerInfo, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url(path), json=body, headers=server.headers, timeout=REQUEST_TIMEOUT_S)


def assert_metrics(r: ollama.ChatResponse | ollama.GenerateResponse) -> None:
    """Ollama's timings are nanosecond integers that add up; the counts are tokens."""
    assert r.done and r.prompt_eval_count > 0 and r.eval_count > 0
    assert r.total_duration >= r.prompt_eval_duration + r.eval_duration > 0
    assert r.load_duration == 0


def assert_serves(client: ollama.Client) -> None:
    r = client.chat("default", messages=COLORS, options={"temperature": 0, "num_predict": 2})
    assert r.done and r.eval_count >= 1


def test_version_tags_show_ps(server: ServerInfo, client: ollama.Client) -> None:
    version = httpx.get(server.url("/api/version"), headers=server.headers, timeout=30).json()["version"]
    assert tuple(int(x) for x in version.split(".")) >= (0, 9, 0)

    tags = httpx.get(server.url("/api/tags"), headers=server.headers, timeout=30).json()["models"]
    assert [(m["name"], m["model"]) for m in tags] == [("default:latest", "default:latest")]
    assert {"modified_at", "size", "digest", "details"} <= set(tags[0])
    listed = client.list().models[0]
    assert listed.size > 50_000_000 and listed.details.format == "gguf"
    assert listed.details.family == "llama" and listed.details.quantization_level == "Q4_1"

    shown = client.show("default:latest")
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["llama.context_length"] == 8192  # the GGUF's, not the server's --max-model-len
    assert 130e6 < shown.modelinfo["general.parameter_count"] < 140e6  # SmolLM2-135M
    assert shown.details.parameter_size.endswith("M")
    assert "completion" in shown.capabilities and "tools" in shown.capabilities
    assert "thinking" not in shown.capabilities  # no --reasoning-parser
    assert "im_start" in shown.template

    (running,) = client.ps().models
    assert (
        running.model == "default:latest" and running.context_length == 2048 and running.size == listed.size
    )


def test_chat_streamed_equals_not(server: ServerInfo, client: ollama.Client) -> None:
    whole = client.chat("default", messages=COLORS, options=GREEDY)
    assert whole.message.role == "assistant" and whole.message.content
    assert_metrics(whole)
    chunks = list(client.chat("default", messages=COLORS, options=GREEDY, stream=True))
    assert [c.done for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert "".join(c.message.content for c in chunks) == whole.message.content
    last = chunks[-1]
    assert_metrics(last)
    assert (last.eval_count, last.done_reason) == (whole.eval_count, whole.done_reason)
    # the prompt is the chat template's rendering, counted as /tokenize counts it
    r = post(server, "/tokenize", {"messages": COLORS})
    assert whole.prompt_eval_count == last.prompt_eval_count == r.json()["count"]


def test_generate_streamed_raw_context_and_length(server: ServerInfo, client: ollama.Client) -> None:
    prompt = "The capital of France is"
    whole = client.generate("default", prompt=prompt, options={"temperature": 0, "num_predict": 8})
    assert_metrics(whole)
    assert whole.done_reason == "length" and whole.eval_count == 8
    chunks = list(
        client.generate("default", prompt=prompt, options={"temperature": 0, "num_predict": 8}, stream=True)
    )
    assert "".join(c.response for c in chunks) == whole.response
    assert chunks[-1].context == whole.context
    # the context is the templated prompt and the answer, as token ids: a next turn continues after it
    assert len(whole.context) >= whole.prompt_eval_count + 1
    after = client.generate(
        "default", prompt="And of Italy?", context=whole.context, options={"num_predict": 2}
    )
    assert after.prompt_eval_count > len(whole.context) and after.response
    # raw: the prompt as it is, no template (so fewer tokens than templated)
    raw = client.generate("default", prompt=prompt, raw=True, options={"temperature": 0, "num_predict": 4})
    assert raw.prompt_eval_count < whole.prompt_eval_count and raw.response
    # stop (an option) ends the answer before the string
    stopped = client.generate(
        "default", prompt=prompt, raw=True, options={"temperature": 0, "stop": ["."], "num_predict": 16}
    )
    assert "." not in stopped.response and stopped.done_reason == "stop"


def test_format_json_and_schema(client: ollama.Client) -> None:
    ask = [{"role": "user", "content": 'Reply with a JSON object {"answer": <number>}: what is 2+2?'}]
    r = client.chat("default", messages=ask, format="json", options={"temperature": 0, "num_predict": 40})
    assert r.done_reason == "stop" and isinstance(json.loads(r.message.content), dict)
    bob = [{"role": "user", "content": "Describe Bob, 30 years old, as JSON."}]
    for stream in (False, True):
        if stream:
            text = "".join(c.message.content for c in client.chat("default", messages=bob, format=PERSON,
                                                                     options={"temperature": 0}, stream=True))  # fmt: skip
        else:
            text = client.chat(
                "default", messages=bob, format=PERSON, options={"temperature": 0}
            ).message.content
        value = json.loads(text)
        jsonschema.validate(value, PERSON)
        assert set(value) == {"name", "age"}  # a schema's objects are closed, as in Ollama
    r = client.generate(
        "default", prompt="Describe Bob, 30 years old, as JSON.", format=PERSON, options={"temperature": 0}
    )
    jsonschema.validate(json.loads(r.response), PERSON)


def test_tool_call_and_tool_history(client: ollama.Client) -> None:
    # asked only to call the tool, the default model calls it or answers in prose at a near-tie that differs
    # between CPU tiers; asked to copy the call, its first token leads by a nat or more on every tier
    ask = [{"role": "user", "content": f"Reply with exactly this text:\n{CALL_PARIS}"}]
    r = client.chat("default", messages=ask, tools=[WEATHER], options={"temperature": 0, "num_predict": 60})
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(call.function.arguments, dict)
    streamed = [c for c in client.chat("default", messages=ask, tools=[WEATHER], stream=True,
                                       options={"temperature": 0, "num_predict": 60}) if c.message.tool_calls]  # fmt: skip
    assert [c.message.tool_calls for c in streamed] == [r.message.tool_calls]
    # the call and its result go back as Ollama sends them (arguments an object, the result by tool_name)
    history = ask + [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": '{"temperature": 21, "sky": "clear"}', "tool_name": "get_weather"},
    ]  # fmt: skip
    answer = client.chat("default", messages=history, tools=[WEATHER], options={"num_predict": 2})
    assert answer.done and answer.prompt_eval_count > r.prompt_eval_count


def test_options_load_and_num_ctx(server: ServerInfo, client: ollama.Client) -> None:
    # no messages / no prompt: Ollama's "load the model", answered at once
    assert client.chat("default", messages=[]).done_reason == "load"
    assert client.generate("default", prompt="").done_reason == "load"
    # options Ollama itself does not know any more are ignored, as Ollama ignores them
    r = client.chat(
        "default", messages=COLORS, options={**GREEDY, "mirostat": 1, "tfs_z": 1.0, "num_gpu": 99}
    )
    assert r.message.content == client.chat("default", messages=COLORS, options=GREEDY).message.content
    # num_ctx: the request's context; what the prompt leaves is the most that is generated
    n = r.prompt_eval_count
    capped = client.chat("default", messages=COLORS, options={"temperature": 0, "num_ctx": n + 3})
    assert (capped.eval_count, capped.done_reason) == (3, "length")
    with pytest.raises(ollama.ResponseError) as e:
        client.chat("default", messages=COLORS, options={"num_ctx": n})
    assert e.value.status_code == 400 and "options.num_ctx" in e.value.error
    # a seed makes sampling repeat
    seeded = [client.chat("default", messages=COLORS, options={"seed": 7, "num_predict": 6}).message.content
              for _ in range(2)]  # fmt: skip
    assert seeded[0] == seeded[1]


@pytest.mark.parametrize(
    "path,body,status,names",
    [
        ("/api/chat", {"model": "nope", "messages": COLORS}, 404, "nope"),
        ("/api/chat", {"model": "default", "messages": COLORS, "options": {"temperature": -1}}, 400,
         "options.temperature"),
        ("/api/chat", {"model": "default", "messages": COLORS, "options": {"top_k": "x"}}, 400, "top_k"),
        ("/api/chat", {"model": "default", "messages": COLORS, "options": {"typical_p": 0.5}}, 400, "typical_p"),
        ("/api/chat", {"model": "default", "messages": COLORS,
                       "options": {"repeat_penalty": 1.2, "repeat_last_n": 64}}, 400, "repeat_last_n"),
        ("/api/chat", {"model": "default", "messages": COLORS, "format": "xml"}, 400, "format"),
        ("/api/chat", {"model": "default", "messages": COLORS, "format": {"type": "nope"}}, 400, "format"),
        ("/api/chat", {"model": "default", "messages": [{"role": "robot", "content": "hi"}]}, 400, "role"),
        ("/api/chat", {"model": "default", "messages": COLORS, "think": True}, 400, "thinking"),
        ("/api/chat", {"model": "default", "messages": COLORS, "top_logprobs": 2}, 400, "top_logprobs"),
        ("/api/generate", {"model": "default", "prompt": "x", "logprobs": True, "top_logprobs": 21}, 400,
         "top_logprobs"),
        ("/api/chat", {"model": "default", "messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]},
         400, "images"),
        ("/api/chat", {"messages": COLORS}, 400, "model"),
        ("/api/generate", {"model": "default", "prompt": "x", "suffix": "y"}, 400, "suffix"),
        ("/api/generate", {"model": "default", "prompt": "x", "context": [10**9]}, 400, "context"),
        ("/api/generate", {"model": "default", "prompt": "x", "raw": True, "system": "s"}, 400, "system"),
        ("/api/show", {"model": "nope"}, 404, "nope"),
        ("/api/embed", {"model": "default", "input": "x"}, 400, "generative"),  # an LLM's server
    ],
)  # fmt: skip
def test_bad_input_is_an_ollama_error(
    server: ServerInfo, client: ollama.Client, path: str, body: dict, status: int, names: str
) -> None:
    r = post(server, path, {"stream": False, **body})
    assert r.status_code == status, r.text
    assert list(r.json()) == ["error"] and names in r.json()["error"], r.text


def test_errors_through_the_client_and_server_serves_on(server: ServerInfo, client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as e:
        client.chat("nope", messages=COLORS)
    assert e.value.status_code == 404 and e.value.error == 'model "nope" not found, try pulling it first'
    with pytest.raises(ollama.ResponseError) as e:  # streamed: the status comes before any line
        list(client.chat("default", messages=COLORS, options={"top_p": 0}, stream=True))
    assert e.value.status_code == 400 and "options.top_p" in e.value.error
    r = httpx.post(server.url("/api/chat"), content=b"{not json", headers=server.headers, timeout=30)
    assert r.status_code == 400 and "error" in r.json()
    # a body is JSON whatever its Content-Type, as Ollama reads it (its docs' `curl -d` sends a form's)
    form = {**server.headers, "Content-Type": "application/x-www-form-urlencoded"}
    body = json.dumps({"model": "default", "prompt": "Hi", "stream": False, "options": {"num_predict": 1}})
    r = httpx.post(server.url("/api/generate"), content=body, headers=form, timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 200 and r.json()["eval_count"] == 1
    assert_serves(client)


def test_logprobs_streamed_and_not(client: ollama.Client) -> None:
    opts = {"temperature": 0, "num_predict": 6}
    whole = client.chat("default", messages=COLORS, options=opts, logprobs=True, top_logprobs=3)
    assert len(whole.logprobs) == whole.eval_count
    assert "".join(lp.token for lp in whole.logprobs) == whole.message.content
    for lp in whole.logprobs:  # greedy: each token is its position's most likely one
        assert len(lp.top_logprobs) == 3 and lp.top_logprobs[0].token == lp.token
        assert lp.logprob == pytest.approx(lp.top_logprobs[0].logprob) and lp.logprob <= 0
    chunks = list(
        client.chat("default", messages=COLORS, options=opts, logprobs=True, top_logprobs=3, stream=True)
    )
    streamed = [lp for c in chunks for lp in c.logprobs or []]
    assert [(lp.token, round(lp.logprob, 4)) for lp in streamed] == [
        (lp.token, round(lp.logprob, 4)) for lp in whole.logprobs
    ]
    gen = client.generate("default", prompt="The capital of France is", raw=True, options=opts, logprobs=True)
    assert len(gen.logprobs) == gen.eval_count and "".join(lp.token for lp in gen.logprobs) == gen.response
    assert all(lp.top_logprobs is None for lp in gen.logprobs)
