"""Text <-> token ids for a checkpoint: the HF folder's tokenizer, or one rebuilt from GGUF metadata.

For GGUF byte-level BPE vocabularies ("gpt2" tokenizer model) we build the `tokenizers` BPE ourselves
from tokenizer.ggml.tokens/merges: it takes ~0.3 s instead of ~3.5 s through transformers' gguf_file
path, and it honours tokenizer.ggml.pre (e.g. SmolLM/StarCoder split every digit, which transformers'
GGUF converter drops). Other GGUF tokenizer models (SentencePiece "llama", ...) go through transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as RawTokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pagedllm.errors import InputError
from pagedllm.model.loader.default import detect_format, resolve_model_path
from pagedllm.model.loader.gguf import read_gguf_header

# llama.cpp's pre-tokenizer names (tokenizer.ggml.pre) grouped by the regex they use.
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"}
_LLAMA3_RE = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2_RE = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_SPLIT_PRE = {"llama-bpe": _LLAMA3_RE, "llama3": _LLAMA3_RE, "qwen2": _QWEN2_RE}

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in _SPLIT_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_PRE[pre]), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level  # "default", "gpt2" and unknown names: GPT-2's regex


def _token(meta: dict[str, Any], key: str, tokens: list[str]) -> str | None:
    idx = meta.get(f"tokenizer.ggml.{key}_token_id")
    return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None


def hf_tokenizer_from_gguf_metadata(meta: dict[str, Any], path: Path) -> PreTrainedTokenizerFast:
    """A transformers fast tokenizer for a GGUF byte-level BPE vocabulary."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise InputError(f"GGUF file {path}: tokenizer.ggml.tokens has duplicate entries", param="model")
    # Llama-3 style vocabularies are trained with ignore_merges (whole words in the vocab win).
    bpe = models.BPE(vocab, merges, ignore_merges=pre in _SPLIT_PRE, fuse_unk=False, byte_fallback=False)
    raw = RawTokenizer(bpe)
    raw.pre_tokenizer = _pre_tokenizer(pre)
    raw.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type")
    if types is not None:
        # Control tokens (<|im_start|>, ...) must match as a whole and be skippable on decode.
        added = [
            AddedToken(tokens[i], special=int(t) == _CONTROL, normalized=False)
            for i, t in enumerate(types)
            if int(t) in (_CONTROL, _USER_DEFINED)
        ]
        raw.add_tokens(added)
    return PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token=_token(meta, "bos", tokens),
        eos_token=_token(meta, "eos", tokens),
        unk_token=_token(meta, "unknown", tokens),
        pad_token=_token(meta, "padding", tokens),
        # llama.cpp's defaults for BPE vocabularies when the flags are absent: no BOS, no EOS.
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=meta.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )


def _load_hf(path: Path) -> Any:
    if detect_format(path) == "safetensors":
        try:
            return AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise InputError(
                f"cannot load the tokenizer of model folder {path}: {e}", param="model"
            ) from None
    meta = read_gguf_header(path, with_tensors=False).metadata
    if "tokenizer.ggml.tokens" not in meta:
        raise InputError(f"GGUF file {path} has no tokenizer (tokenizer.ggml.tokens)", param="model")
    if meta.get("tokenizer.ggml.model") == "gpt2":
        return hf_tokenizer_from_gguf_metadata(meta, path)
    # SentencePiece-style vocabularies: transformers' own GGUF converter handles byte fallback etc.
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)


class Tokenizer:
    """Thin wrapper so the engine depends on five methods, not on transformers' whole tokenizer API."""

    def __init__(self, hf: Any):
        self.hf = hf

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> Tokenizer:
        return cls(_load_hf(resolve_model_path(str(path))))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The conversation as the prompt text; tools and template_kwargs (continue_final_message, and any
        variable the template reads) are passed through to the template."""
        if not self.hf.chat_template:
            raise InputError("this model has no chat template; send a plain prompt instead", param="messages")
        return self.hf.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            tokenize=False,
            **template_kwargs,
        )

    @property
    def chat_template(self) -> str | None:
        return self.hf.chat_template

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def all_special_ids(self) -> list[int]:
        return list(self.hf.all_special_ids)
