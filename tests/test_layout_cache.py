"""The packed-layout cache of a GGUF file (quantization/layout_cache.py): the second load reads the layouts
the first one built (no block decoded), bit for bit, with the same logits; a torn cache file is never read
(rebuilt and rewritten); the dtype is part of the key; small files are not cached unless told."""

import logging

import pytest
import torch
from model_helpers import paged_prefill_logits
from test_kquant_model import kquant_path  # noqa: F401  (a fixture: a small Q4_K / Q6_K file)

from pagedllm.model.build import load_model_for_inference
from pagedllm.quantization import gguf_native, layout_cache
from pagedllm.quantization.linear import QuantLinear


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(layout_cache.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(layout_cache, "MIN_FILE_BYTES", 0)  # the test file is tiny
    return tmp_path


def _layouts(model) -> dict[str, tuple[torch.Tensor, ...]]:
    return {n: m.layout for n, m in model.named_modules() if isinstance(m, QuantLinear) and m.layout}


def _load(path, dtype=torch.bfloat16):
    return load_model_for_inference(path, dtype, "gguf", show_progress=False)[0]


def _no_decoding(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a layer was decoded and packed: the cache was not read")

    monkeypatch.setattr(gguf_native, "packed_gguf_linear", refuse)


def test_second_load_reads_the_cached_layouts_bit_for_bit(kquant_path, cache_dir, monkeypatch):  # noqa: F811
    first = _load(kquant_path)
    files = list(cache_dir.glob("*.pt"))
    assert len(files) == 1 and files[0].name.startswith("kquant-")
    if not _layouts(first):
        pytest.skip("no quantized-linear kernel holds the weight at this tier: nothing is cached")
    with monkeypatch.context() as m:
        _no_decoding(m)
        second = _load(kquant_path)
    a, b = _layouts(first), _layouts(second)
    assert a.keys() == b.keys()
    for name in a:
        assert all(torch.equal(x, y) for x, y in zip(a[name], b[name], strict=True)), name
    ids = list(range(3, 40))
    assert torch.equal(paged_prefill_logits(first, ids), paged_prefill_logits(second, ids))


def test_a_torn_cache_file_is_rebuilt_not_read(kquant_path, cache_dir, caplog):  # noqa: F811
    want = paged_prefill_logits(_load(kquant_path), list(range(3, 30)))
    (path,) = cache_dir.glob("*.pt")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # a crash mid-write of an older format, a full disk...
    with caplog.at_level(logging.WARNING, logger=layout_cache.__name__):
        got = paged_prefill_logits(_load(kquant_path), list(range(3, 30)))
    assert "unreadable" in caplog.text
    assert torch.equal(got, want)
    assert path.stat().st_size == len(data)  # rewritten whole


def test_the_dtype_and_the_file_are_part_of_the_key(kquant_path, cache_dir, tmp_path_factory):  # noqa: F811
    _load(kquant_path, torch.bfloat16)
    _load(kquant_path, torch.float32)
    assert len(list(cache_dir.glob("*.pt"))) == 2
    copy = tmp_path_factory.mktemp("copy") / "kquant.gguf"
    copy.write_bytes(kquant_path.read_bytes())  # same bytes, another file: its own entry
    _load(copy, torch.bfloat16)
    assert len(list(cache_dir.glob("*.pt"))) == 3


def test_small_files_and_off_are_not_cached(kquant_path, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv(layout_cache.CACHE_ENV, str(tmp_path))
    _load(kquant_path)  # under MIN_FILE_BYTES
    assert not list(tmp_path.glob("*.pt"))
    monkeypatch.setattr(layout_cache, "MIN_FILE_BYTES", 0)
    monkeypatch.setenv(layout_cache.CACHE_ENV, "off")
    assert layout_cache.LayoutCache.for_file(kquant_path, torch.bfloat16) is None


def test_a_new_file_replaces_the_same_variants_older_sources(kquant_path, cache_dir):  # noqa: F811
    _load(kquant_path)
    (path,) = cache_dir.glob("*.pt")
    stem, variant, sources = path.stem.rsplit("-", 2)
    older = path.with_name(f"{stem}-{variant}-{'0' * len(sources)}.pt")
    path.rename(older)  # as if the packers had changed since it was written
    other = cache_dir / f"{stem}-{'1' * len(variant)}-{sources}.pt"  # another variant (dtype, tier...)
    other.write_bytes(b"")
    _load(kquant_path)
    assert sorted(cache_dir.glob("*.pt")) == sorted([path, other])
