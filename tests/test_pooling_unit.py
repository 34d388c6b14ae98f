"""The pooling pieces without a server: the pooler's arithmetic, the sentence-transformers folder reader's
refusals, the token-budget batching, an XLM-R cross-encoder against CrossEncoder.predict, and the pooling
engine as an EngineClient (every member the server reads)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_engine_client import MEMBERS, _definition

from pagedllm.engine.async_pooling import AsyncPoolingEngine
from pagedllm.engine.pooling_engine import PoolingEngine, PoolingInput
from pagedllm.errors import InputError
from pagedllm.model.loader.sentence_transformers import pooling_spec
from pagedllm.model.pooling import Pooler, truncate_dimensions


@pytest.mark.parametrize("name", MEMBERS)
def test_the_pooling_engine_defines_every_engine_client_member(name: str) -> None:
    found, _ = _definition(AsyncPoolingEngine, name)
    assert found, f"AsyncPoolingEngine does not define {name}"


def test_pooler_types() -> None:
    torch.manual_seed(0)
    a, b = torch.randn(3, 4), torch.randn(5, 4)
    flat = torch.cat([a, b])
    lens = [3, 5]
    assert torch.equal(Pooler("cls", False)(flat, lens), torch.stack([a[0], b[0]]))
    assert torch.equal(Pooler("lasttoken", False)(flat, lens), torch.stack([a[-1], b[-1]]))
    assert torch.allclose(Pooler("mean", False)(flat, lens), torch.stack([a.mean(0), b.mean(0)]))
    assert torch.equal(Pooler("max", False)(flat, lens), torch.stack([a.amax(0), b.amax(0)]))
    normed = Pooler("mean", True)(flat, lens)
    assert torch.allclose(normed.norm(dim=-1), torch.ones(2))
    cut = truncate_dimensions(normed, 2, True)
    assert torch.allclose(cut, F.normalize(normed[:, :2], dim=-1))
    assert torch.equal(truncate_dimensions(normed, 2, False), normed[:, :2])


def _st_folder(tmp_path, pooling: dict, modules: list[str] | None = None):
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    types = modules or ["sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling"]
    paths = ["", "1_Pooling", "2_X", "3_Y"]
    entries = [{"idx": i, "name": str(i), "path": paths[i], "type": t} for i, t in enumerate(types)]
    (tmp_path / "modules.json").write_text(json.dumps(entries))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return tmp_path


def test_folder_layouts(tmp_path) -> None:
    hub = _st_folder(tmp_path / "a", {"pooling_mode_cls_token": True, "word_embedding_dimension": 8})
    assert pooling_spec(hub).pooling_type == "cls" and not pooling_spec(hub).normalize
    new = _st_folder(tmp_path / "b", {"pooling_mode": "lasttoken", "embedding_dimension": 8})
    assert pooling_spec(new).pooling_type == "lasttoken"
    assert pooling_spec(_st_folder(tmp_path / "c", {})).pooling_type == "mean"  # no key on: its default


@pytest.mark.parametrize(
    "pooling, modules, words",
    [
        ({"pooling_mode": "weightedmean"}, None, "weightedmean"),
        ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}, None, "pooling mode"),
        (
            {"pooling_mode": "mean"},
            [
                "sentence_transformers.models.Transformer",
                "sentence_transformers.models.Pooling",
                "sentence_transformers.models.Dense",
            ],
            "Dense",
        ),
    ],
)
def test_unsupported_folders_are_refused_by_name(tmp_path, pooling, modules, words) -> None:
    with pytest.raises(InputError, match=words):
        pooling_spec(_st_folder(tmp_path, pooling, modules))


def test_a_generative_folder_is_not_pooling_unless_forced(tmp_path) -> None:
    from tiny_models import save_tiny_qwen3

    path = save_tiny_qwen3(tmp_path / "q")
    assert pooling_spec(path) is None
    spec = pooling_spec(path, "pooling")
    assert spec.pooling_type == "lasttoken" and spec.normalize and not spec.encoder
    with pytest.raises(InputError, match="runner"):
        pooling_spec(path, "sideways")


def test_batches_follow_the_token_budget(tmp_path) -> None:
    engine = PoolingEngine.__new__(PoolingEngine)
    engine.max_num_batched_tokens, engine.max_num_seqs = 10, 3
    items = [PoolingInput([1] * n) for n in (6, 1, 4, 2, 2, 9)]
    groups = engine.batches(items)
    assert sorted(i for g in groups for i in g) == list(range(6))
    for g in groups:
        assert len(g) <= 3 and (len(g) == 1 or sum(len(items[i].token_ids) for i in g) <= 10)
    # sorted by length: similar lengths share a forward
    assert groups[0] == [1, 3, 4]


def test_xlmr_cross_encoder_matches_predict(tmp_path) -> None:
    from pooling_checkpoints import TEXTS, xlmr_cross_encoder
    from sentence_transformers import CrossEncoder

    from pagedllm import LLM

    path = xlmr_cross_encoder(tmp_path / "ce")
    ref = CrossEncoder(str(path), device="cpu").predict([(TEXTS[0], d) for d in TEXTS])
    ours = LLM(model=str(path), dtype="fp32").score(TEXTS[0], TEXTS)
    assert np.allclose(ours, ref, atol=2e-3)


def test_the_default_prompt_goes_before_each_text(tmp_path) -> None:
    from pooling_checkpoints import TEXTS, bert_mean_st
    from sentence_transformers import SentenceTransformer

    from pagedllm import LLM

    path = bert_mean_st(tmp_path / "st")
    file = path / "config_sentence_transformers.json"
    cfg = json.loads(file.read_text())
    cfg.update(prompts={"query": "what is ", "document": ""}, default_prompt_name="query")
    file.write_text(json.dumps(cfg))
    ref = SentenceTransformer(str(path), device="cpu").encode(TEXTS)
    ours = np.array(LLM(model=str(path), dtype="fp32").embed(TEXTS))
    assert F.cosine_similarity(torch.tensor(ours), torch.tensor(ref)).min() >= 0.9999
    assert np.abs(ours - ref).max() <= 2e-3


@pytest.mark.parametrize(
    "flags",
    [["--tensor-parallel-size", "2"], ["--data-parallel-size", "2"], ["--kv-cache-dtype", "int8"],
     ["--quantization", "int4"], ["--speculative-config", '{"method": "ngram"}']],
)  # fmt: skip
def test_generative_options_are_refused_for_a_pooling_model(tmp_path, flags) -> None:
    """A pooling model runs on one process without a KV cache: the generative engine's options are refused
    by name before anything loads, never ignored."""
    import argparse

    from pooling_checkpoints import bert_mean_st

    from pagedllm.entrypoints.openai.cli_args import add_arguments, make_pooling_engine

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    path = bert_mean_st(tmp_path / "st")
    with pytest.raises(InputError) as e:
        make_pooling_engine(parser.parse_args(["--model", str(path), *flags]))
    assert e.value.param == flags[0]
    assert make_pooling_engine(parser.parse_args(["--model", str(path)])) is not None  # the defaults load
