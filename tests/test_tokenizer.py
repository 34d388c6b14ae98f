"""Tokenizer: the default GGUF's vocabulary rebuilt from metadata, HF folders, and metadata flags."""

from __future__ import annotations

import pytest
from tiny_models import save_tiny_llama

from pagedllm.errors import InputError
from pagedllm.model.loader import resolve_model_path
from pagedllm.model.tokenizer import Tokenizer, hf_tokenizer_from_gguf_metadata

TEXTS = [
    "Hello world",
    "  leading spaces,\ttabs\n\nand newlines \n",
    "héllo wörld — 日本語のテキスト 🙂👍🏽 emoji",
    "year 2024: π ≈ 3.14159, 1,000,000 items",
    "don't you're I'LL WE'VE",
    "<|im_start|>user\nhi<|im_end|>\n",
    "def f(x):\n    return x**2  # code",
]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_checkpoint("default")


@pytest.fixture(scope="module")
def transformers_tok():
    """transformers' own GGUF tokenizer conversion, the reference."""
    from transformers import AutoTokenizer

    path = resolve_model_path("default")
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_hello_world_known_ids(tok):
    assert tok.encode("Hello world") == [19556, 905]  # no BOS: tokenizer.ggml.add_bos_token is False


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers_gguf_tokenizer(tok, transformers_tok, text):
    assert tok.encode(text) == transformers_tok.encode(text)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_multibyte_characters_split_across_tokens_round_trip(tok):
    text = "日本語 🙂👍🏽"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # byte-level pieces, not whole characters
    assert tok.decode(ids) == text


def test_special_tokens(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2  # matched whole, never split into pieces
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.encode("hi", add_special_tokens=False) == tok.encode("hi")


def test_properties(tok):
    assert tok.eos_token_id == 2 and tok.bos_token_id == 1
    assert tok.vocab_size == 49152
    assert {0, 1, 2} <= set(tok.all_special_ids)
    assert tok.hf.convert_ids_to_tokens(2) == "<|im_end|>"


def test_chat_template(tok):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    prompt = tok.apply_chat_template(messages)
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>\n" in prompt
    assert prompt.startswith("<|im_start|>system\n")  # the template's default system prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    assert not tok.apply_chat_template(messages, add_generation_prompt=False).endswith("assistant\n")


def test_hf_folder_tokenizer_matches_default(tmp_path, tok):
    folder_tok = Tokenizer.from_checkpoint(save_tiny_llama(tmp_path / "tiny", num_hidden_layers=1))
    for text in TEXTS:
        assert folder_tok.encode(text) == tok.encode(text)
    assert folder_tok.eos_token_id == 2
    assert "<|im_start|>user" in folder_tok.apply_chat_template([{"role": "user", "content": "x"}])


def _byte_level_meta(**extra):
    """A minimal GPT-2 style vocabulary: the 256 byte symbols, one merge and two control tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    tokens = ["<s>", "</s>", *symbols, "hi"]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": ["h i"],
        "tokenizer.ggml.token_type": [3, 3] + [1] * (len(tokens) - 2),
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
    }
    meta.update(extra)
    return meta


def test_add_bos_follows_metadata(tmp_path):
    with_bos = Tokenizer(
        hf_tokenizer_from_gguf_metadata(_byte_level_meta(**{"tokenizer.ggml.add_bos_token": True}), tmp_path)
    )
    without = Tokenizer(hf_tokenizer_from_gguf_metadata(_byte_level_meta(), tmp_path))
    hi = with_bos.hf.convert_tokens_to_ids("hi")
    assert with_bos.encode("hi") == [0, hi]
    assert with_bos.encode("hi", add_special_tokens=False) == [hi]
    assert without.encode("hi") == [hi]
    assert with_bos.decode(with_bos.encode("hi")) == "hi"


def test_no_chat_template_is_an_input_error(tmp_path):
    t = Tokenizer(hf_tokenizer_from_gguf_metadata(_byte_level_meta(), tmp_path))
    with pytest.raises(InputError, match="no chat template"):
        t.apply_chat_template([{"role": "user", "content": "x"}])


def test_bad_paths(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        Tokenizer.from_checkpoint(tmp_path / "missing")
    text = tmp_path / "x.txt"
    text.write_text("hello")
    with pytest.raises(InputError, match="neither a GGUF file"):
        Tokenizer.from_checkpoint(text)
