"""Perplexity: the GPTQ protocol exactly (against HF transformers and plain torch CE), and the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from tiny_models import save_tiny_llama

from pagedllm.engine.llm_engine import resolve_dtype
from pagedllm.entrypoints.cli.main import main
from pagedllm.errors import InputError
from pagedllm.eval.perplexity import perplexity, perplexity_windows, read_text_ids
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.loader import load_checkpoint, resolve_model_path
from pagedllm.model.tokenizer import Tokenizer

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2"
CTX = 32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny_llama(tmp_path_factory.mktemp("tiny"))
    ckpt = load_checkpoint(path, show_progress=False)
    ours = LlamaForCausalLM.from_weights(ckpt.config, ckpt.weights, torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(3, ckpt.config.vocab_size, (5 * CTX + 7,), generator=torch.Generator().manual_seed(0))
    return path, ours, ref, ids.tolist()


def reference_ppl(ref, ids: list[int], ctx: int) -> float:
    """The protocol written out with HF's model and plain torch cross-entropy."""
    n = len(ids) // ctx  # the 7 leftover tokens are dropped
    losses = []
    with torch.no_grad():
        for i in range(n):
            window = torch.tensor(ids[i * ctx : (i + 1) * ctx])
            logits = ref(window[None]).logits[0]
            losses.append(F.cross_entropy(logits[:-1], window[1:], reduction="none"))
    return math.exp(torch.cat(losses).double().mean().item())


def test_matches_hf_and_plain_cross_entropy(tiny):
    _, ours, ref, ids = tiny
    res = perplexity(ours, ids, ctx=CTX, show_progress=False)
    assert (res.num_windows, res.num_tokens, res.ctx) == (5, 5 * (CTX - 1), CTX)
    assert res.ppl == pytest.approx(reference_ppl(ref, ids, CTX), rel=1e-4)
    assert res.ppl == pytest.approx(math.exp(res.nll))
    # batching windows together and prefilling them in chunks over the cache change nothing
    for kwargs in (dict(batch_size=3), dict(chunk_size=7), dict(batch_size=2, chunk_size=16)):
        assert perplexity(ours, ids, ctx=CTX, show_progress=False, **kwargs).ppl == pytest.approx(
            res.ppl, rel=1e-5
        )


def test_max_windows_takes_the_first(tiny):
    _, ours, ref, ids = tiny
    res = perplexity(ours, ids, ctx=CTX, max_windows=2, show_progress=False)
    assert res.num_windows == 2
    assert res.ppl == pytest.approx(reference_ppl(ref, ids[: 2 * CTX], CTX), rel=1e-4)


def test_windows_drop_the_tail():
    w = perplexity_windows(list(range(70)), ctx=32)
    assert w.shape == (2, 32) and w[1, -1] == 63


def test_bad_input(tiny):
    _, ours, _, ids = tiny
    with pytest.raises(InputError, match="fewer than one window") as e:
        perplexity(ours, ids[:20], ctx=CTX, show_progress=False)
    assert e.value.param == "ctx"
    with pytest.raises(InputError, match="max_position_embeddings 512"):
        perplexity(ours, ids, ctx=1024, show_progress=False)
    with pytest.raises(InputError, match="kv_cache_dtype") as e:
        perplexity(ours, ids, ctx=CTX, kv_cache_dtype="int3", show_progress=False)
    assert e.value.param == "kv_cache_dtype"


def test_kv_cache_dtype_is_used_when_chunked(tiny):
    _, ours, _, ids = tiny
    full = perplexity(ours, ids, ctx=CTX, show_progress=False).ppl
    bf16 = perplexity(ours, ids, ctx=CTX, kv_cache_dtype="bf16", chunk_size=8, show_progress=False).ppl
    assert bf16 != full and bf16 == pytest.approx(full, rel=2e-2)
    int8 = perplexity(ours, ids, ctx=CTX, kv_cache_dtype="int8", chunk_size=8, show_progress=False).ppl
    assert int8 != full and int8 == pytest.approx(full, rel=2e-2)


def test_default_model_on_wikitext2_test():
    path = resolve_model_path("default")
    ckpt = load_checkpoint(path, show_progress=False)
    # the engine's own dtype (bf16 where the CPU has bf16 matmuls): several times faster than fp32 there
    model = LlamaForCausalLM.from_weights(ckpt.config, ckpt.weights, resolve_dtype("auto"))
    ids = read_text_ids(DATA / "test.txt", Tokenizer.from_checkpoint(path))
    res = perplexity(model, ids, ctx=512, max_windows=4, show_progress=False)
    assert res.num_windows == 4 and res.num_tokens == 4 * 511
    assert 5 < res.ppl < 100, res


def test_cli_json_matches_api(tiny, tmp_path, capsys):
    path, ours, _, ids = tiny
    text = tmp_path / "t.txt"
    text.write_text(" ".join(["the cat sat on the mat and looked at the dog"] * 40))
    code = main(["eval", "perplexity", "--model", str(path), "--dtype", "fp32", "--text", str(text),
                 "--ctx", "32", "--max-windows", "3", "--json"])  # fmt: skip
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    expected = perplexity(ours, read_text_ids(text, Tokenizer.from_checkpoint(path)), ctx=32, max_windows=3,
                          show_progress=False)  # fmt: skip
    assert out["num_windows"] == 3 and out["ctx"] == 32
    assert out["ppl"] == pytest.approx(expected.ppl, rel=1e-6)


def test_cli_missing_text_is_one_line_exit_2(tmp_path, capsys):
    code = main(["eval", "perplexity", "--model", "default", "--text", str(tmp_path / "none.txt")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "none.txt does not exist" in err
