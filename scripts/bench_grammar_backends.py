"""llguidance against xgrammar on this CPU, with the default model's tokenizer: the measurement behind
pagedllm's choice of grammar library (pagedllm/structured_output/grammar.py). Not a test.

    .venv/bin/pip install xgrammar   # optional: pulls triton (~1 GB) and is not a pagedllm dependency
    .venv/bin/python scripts/bench_grammar_backends.py

Prints, per library: tokenizer indexing (once per engine), compile of a typical nested schema (once per
schema), and the token mask along one valid 48-token output (median and worst, every step of a request).
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from pagedllm.bench.structured import BUILTIN_SCHEMA
from pagedllm.model.loader import resolve_model_path
from pagedllm.model.tokenizer import Tokenizer

SCHEMA = BUILTIN_SCHEMA["items"]
TEXT = json.dumps({"name": "Bob Smith", "age": 30, "role": "teacher", "email": "bob@school.org",
                   "address": {"city": "Paris", "zip": "75001"}, "tags": ["x", "yy"]})  # fmt: skip


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def report(name: str, index_s: float, compile_s: float, masks: list[float]) -> None:
    print(
        f"{name:>10}: tokenizer {index_s * 1e3:6.0f} ms, compile {compile_s * 1e3:6.2f} ms, mask median "
        f"{statistics.median(masks) * 1e6:6.1f} us, worst {max(masks) * 1e6:8.1f} us ({len(masks)} tokens)"
    )


def main() -> None:
    hf = Tokenizer.from_checkpoint(resolve_model_path("default")).hf
    vocab = 49152
    ids = hf.encode(TEXT, add_special_tokens=False)

    import llguidance
    import llguidance.hf

    tok, index_s = timed(lambda: llguidance.hf.from_tokenizer(hf, n_vocab=vocab))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    matcher, compile_s = timed(lambda: llguidance.LLMatcher(tok, grammar))
    mask = torch.full(((vocab + 31) // 32,), -1, dtype=torch.int32)
    masks = []
    for t in ids:
        _, s = timed(lambda: matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4))
        masks.append(s)
        assert matcher.consume_token(t), matcher.get_error()
    report("llguidance", index_s, compile_s, masks)

    try:
        import xgrammar as xgr
    except ImportError:
        print("   xgrammar: not installed (pip install xgrammar)")
        return
    info, index_s = timed(lambda: xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab))
    compiler = xgr.GrammarCompiler(info, max_threads=2)
    compiled, compile_s = timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA)))
    m = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    masks = []
    for t in ids:
        _, s = timed(lambda: m.fill_next_token_bitmask(bitmask, 0))
        masks.append(s)
        assert m.accept_token(t)
    report("xgrammar", index_s, compile_s, masks)


if __name__ == "__main__":
    main()
