"""Hugging Face folders: tiny random models, shards, config.json variants, refused and broken folders."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file
from tiny_models import hf_state_dict, save_tiny_llama, save_tiny_qwen2

from pagedllm.errors import InputError
from pagedllm.model.loader import load_checkpoint, read_model_config


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("llama"))


def _assert_same(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert set(ours) == set(ref)
    for name, w in ours.items():
        assert w.dtype == torch.float32
        assert torch.equal(w, ref[name]), name


def test_tiny_llama_equals_transformers_state_dict(tiny_llama):
    ckpt = load_checkpoint(tiny_llama, show_progress=False)
    assert ckpt.format == "safetensors" and ckpt.path == tiny_llama and ckpt.gguf_tensors is None
    _assert_same(ckpt.weights, hf_state_dict(tiny_llama))
    c = ckpt.config
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (64, 4, 4, 2, 16)
    assert c.architecture == "llama" and not c.tie_word_embeddings and not c.attention_bias
    assert c.vocab_size == 49152 and c.eos_token_ids == [2] and c.bos_token_id == 1
    assert read_model_config(tiny_llama) == c


def test_tiny_qwen2_has_bias_and_tied_embeddings(tmp_path):
    path = save_tiny_qwen2(tmp_path / "qwen2")
    ckpt = load_checkpoint(path, show_progress=False)
    ref = hf_state_dict(path)
    ref.pop("lm_head.weight")  # tied: the model reads embed_tokens
    _assert_same(ckpt.weights, ref)
    c = ckpt.config
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (96, 3, 3, 1, 32)
    assert c.architecture == "qwen2" and c.tie_word_embeddings and c.attention_bias
    assert ckpt.weights["model.layers.0.self_attn.q_proj.bias"].abs().sum() > 0  # randomized, not zero


def test_llama_with_attention_bias_keeps_o_proj_bias(tmp_path):
    path = save_tiny_llama(tmp_path / "b", attention_bias=True, num_hidden_layers=1)
    ckpt = load_checkpoint(path, show_progress=False)
    assert ckpt.config.attention_bias
    assert "model.layers.0.self_attn.o_proj.bias" in ckpt.weights
    _assert_same(ckpt.weights, hf_state_dict(path))


def test_sharded_folder_loads(tmp_path):
    path = save_tiny_llama(tmp_path / "sharded", max_shard_size="2MB")
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(shards) > 1 and (path / "model.safetensors.index.json").is_file()
    _assert_same(load_checkpoint(path, show_progress=False).weights, hf_state_dict(path))


def test_missing_shard_is_named(tmp_path):
    path = save_tiny_llama(tmp_path / "sharded", max_shard_size="2MB")
    victim = sorted(path.glob("*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(InputError, match=victim.name):
        load_checkpoint(path, show_progress=False)


def test_pickled_only_folder_is_refused(tmp_path, tiny_llama):
    folder = tmp_path / "pickled"
    folder.mkdir()
    torch.save({"x": torch.zeros(2)}, folder / "pytorch_model.bin")
    for with_config in (False, True):
        if with_config:
            shutil.copy(tiny_llama / "config.json", folder / "config.json")
        with pytest.raises(InputError, match="pickled weights are refused; convert to safetensors"):
            load_checkpoint(folder, show_progress=False)
        with pytest.raises(InputError, match="pickled weights are refused"):
            read_model_config(folder)
    pt = tmp_path / "model.pt"
    torch.save({"x": torch.zeros(2)}, pt)
    with pytest.raises(InputError, match="pickled weights are refused"):
        load_checkpoint(pt, show_progress=False)


def test_empty_folder_and_folder_without_config(tmp_path, tiny_llama):
    with pytest.raises(InputError, match="no \\*.safetensors"):
        load_checkpoint(tmp_path, show_progress=False)
    shutil.copy(tiny_llama / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(InputError, match="no config.json"):
        read_model_config(tmp_path)


def test_missing_tensor_is_named(tmp_path, tiny_llama):
    folder = tmp_path / "partial"
    folder.mkdir()
    shutil.copy(tiny_llama / "config.json", folder)
    weights = hf_state_dict(tiny_llama)
    del weights["model.layers.2.mlp.up_proj.weight"]
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(InputError, match=r"model\.layers\.2\.mlp\.up_proj\.weight"):
        load_checkpoint(folder, show_progress=False)


def test_corrupt_safetensors_is_refused(tmp_path, tiny_llama):
    folder = tmp_path / "corrupt"
    folder.mkdir()
    shutil.copy(tiny_llama / "config.json", folder)
    (folder / "model.safetensors").write_bytes((tiny_llama / "model.safetensors").read_bytes()[:1000])
    with pytest.raises(InputError, match="corrupt safetensors file"):
        load_checkpoint(folder, show_progress=False)


def _config_folder(tmp_path, cfg: dict):
    """A folder with just config.json and a placeholder weight file: enough for read_model_config."""
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes(b"")
    return tmp_path


BASE = dict(
    vocab_size=100,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=4096,
)


def test_config_transformers4_llama3_rope_and_eos_list(tmp_path):
    cfg = dict(
        BASE,
        architectures=["LlamaForCausalLM"],
        num_key_value_heads=2,
        head_dim=32,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        eos_token_id=[128001, 128008, 128009],
        bos_token_id=128000,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    )
    c = read_model_config(_config_folder(tmp_path, cfg))
    assert c.rope_theta == 500000.0 and c.head_dim == 32 and c.num_kv_heads == 2
    assert c.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert c.eos_token_ids == [128001, 128008, 128009] and c.bos_token_id == 128000
    assert c.tie_word_embeddings and c.rms_norm_eps == 1e-5


def test_config_transformers5_rope_parameters_and_defaults(tmp_path):
    cfg = dict(BASE, model_type="llama", rope_parameters={"rope_theta": 12345.0, "rope_type": "default"})
    c = read_model_config(_config_folder(tmp_path, cfg))
    assert c.rope_theta == 12345.0 and c.rope_scaling is None
    assert c.num_kv_heads == 4 and c.head_dim == 16 and c.eos_token_ids == []


def test_config_old_rope_scaling_type_spelling(tmp_path):
    cfg = dict(BASE, architectures=["LlamaForCausalLM"], rope_scaling={"type": "linear", "factor": 2.0})
    assert read_model_config(_config_folder(tmp_path, cfg)).rope_scaling == {
        "rope_type": "linear",
        "factor": 2.0,
    }


def test_config_qwen2_and_mistral(tmp_path):
    q = read_model_config(
        _config_folder(tmp_path, dict(BASE, architectures=["Qwen2ForCausalLM"], sliding_window=1024))
    )
    assert (
        q.architecture == "qwen2" and q.attention_bias and q.max_position_embeddings == 4096
    )  # window unused
    m = read_model_config(
        _config_folder(tmp_path, dict(BASE, architectures=["MistralForCausalLM"], sliding_window=1024))
    )
    assert m.architecture == "mistral" and not m.attention_bias
    # every Mistral layer attends over the window; the context stays whole
    assert m.max_position_embeddings == 4096 and m.sliding_window == 1024 and m.all_layers_sliding


@pytest.mark.parametrize(
    "cfg, message",
    [
        (dict(BASE, architectures=["GPT2LMHeadModel"]), "unsupported architecture 'GPT2LMHeadModel'"),
        (dict(BASE, model_type="mamba"), "unsupported architecture 'mamba'"),
        (dict(BASE, architectures=["LlamaForCausalLM"], hidden_act="gelu"), "hidden_act 'gelu'"),
        ({"architectures": ["LlamaForCausalLM"], "vocab_size": 10}, "missing field 'hidden_size'"),
    ],
)
def test_config_errors_name_the_problem(tmp_path, cfg, message):
    with pytest.raises(InputError, match=message):
        read_model_config(_config_folder(tmp_path, cfg))


def test_config_not_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(InputError, match="config.json is not valid JSON"):
        read_model_config(tmp_path)
