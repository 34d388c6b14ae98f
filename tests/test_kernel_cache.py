"""cpp_extension.py: the kernel cache's key and folder, and the flock that clears a killed build's `lock`.

The last test compiles one tiny extension into a temporary cache (tens of seconds on 2 cores) and checks
that the "compiling ... once" line is printed for the fresh build only.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pagedllm import cpp_extension, platform

SOURCE = """\
#include <torch/extension.h>
#include "x.h"

int64_t add_one(int64_t x) { return x + PAGEDLLM_TEST_ONE; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("add_one", &add_one); }
"""
HEADER = '#pragma once\n#include "y.h"\n#define PAGEDLLM_TEST_ONE 1\n'
NESTED = "#pragma once\n// nested header\n"


@pytest.fixture
def kernel_src(tmp_path: Path) -> Path:
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    (src_dir / "x.h").write_text(HEADER)
    (src_dir / "y.h").write_text(NESTED)
    source = src_dir / "k.cpp"
    source.write_text(SOURCE)
    return source


def flags_of(tier: str) -> list[str]:
    return [*cpp_extension.BASE_CFLAGS, *platform.cflags(tier)]


# ---- build_key ---------------------------------------------------------------------------------------


def test_local_headers_follow_nested_includes(kernel_src):
    names = [p.name for p in cpp_extension.local_headers(kernel_src)]
    assert names == ["x.h", "y.h"]  # <torch/extension.h> is not a project header


def test_build_key_is_stable(kernel_src):
    a = cpp_extension.build_key(kernel_src, flags_of("avx2"), "avx2")
    b = cpp_extension.build_key(kernel_src, flags_of("avx2"), "avx2")
    assert a == b
    assert len(a) == 12 and all(c in "0123456789abcdef" for c in a)
    # rewriting the same bytes (a new mtime) does not change it either
    kernel_src.write_text(SOURCE)
    (kernel_src.parent / "x.h").write_text(HEADER)
    assert cpp_extension.build_key(kernel_src, flags_of("avx2"), "avx2") == a


def test_build_key_changes_with_the_tier(kernel_src):
    flags = flags_of("avx2")
    keys = {cpp_extension.build_key(kernel_src, flags, tier) for tier in ("none", *platform.TIERS)}
    assert len(keys) == 1 + len(platform.TIERS)


def test_build_key_changes_with_the_flags(kernel_src):
    base = cpp_extension.build_key(kernel_src, flags_of("avx2"), "avx2")
    assert cpp_extension.build_key(kernel_src, flags_of("avx512"), "avx2") != base
    assert cpp_extension.build_key(kernel_src, [*flags_of("avx2"), "-DEXTRA"], "avx2") != base
    assert cpp_extension.build_key(kernel_src, flags_of("avx2")[:-1], "avx2") != base


@pytest.mark.parametrize("changed", ["k.cpp", "x.h", "y.h"])
def test_build_key_changes_with_the_source_or_any_included_header(kernel_src, changed):
    base = cpp_extension.build_key(kernel_src, flags_of("avx2"), "avx2")
    path = kernel_src.parent / changed
    path.write_bytes(path.read_bytes() + b"// one more byte\n")
    assert cpp_extension.build_key(kernel_src, flags_of("avx2"), "avx2") != base


def test_build_key_ignores_a_header_that_is_not_included(kernel_src):
    base = cpp_extension.build_key(kernel_src, flags_of("avx2"), "avx2")
    (kernel_src.parent / "unused.h").write_text("#define NOT_INCLUDED 1\n")
    assert cpp_extension.build_key(kernel_src, flags_of("avx2"), "avx2") == base


# ---- build_dir / is_built ----------------------------------------------------------------------------


@pytest.mark.parametrize("tier", ["none", *platform.TIERS])
def test_build_dir_names_tier_and_key_under_the_cache_root(monkeypatch, tmp_path, kernel_src, tier):
    root = tmp_path / "cache"
    monkeypatch.setenv("PAGEDLLM_KERNEL_CACHE", str(root))
    folder, module, flags = cpp_extension.build_dir("pagedllm_test", kernel_src, tier)
    key = cpp_extension.build_key(kernel_src, flags_of(tier), tier)
    assert flags == flags_of(tier)
    assert module == f"pagedllm_test_{tier}_{key}"
    assert module.isidentifier()  # torch makes it the Python module's name
    assert folder == root / module
    assert cpp_extension.cache_root() == root
    assert not cpp_extension.is_built("pagedllm_test", kernel_src, tier)
    folder.mkdir(parents=True)
    (folder / f"{module}.so").write_bytes(b"")
    assert cpp_extension.is_built("pagedllm_test", kernel_src, tier)


def test_build_dir_two_tiers_never_share_a_folder(monkeypatch, tmp_path, kernel_src):
    monkeypatch.setenv("PAGEDLLM_KERNEL_CACHE", str(tmp_path))
    folders = {cpp_extension.build_dir("k", kernel_src, t)[0] for t in platform.TIERS}
    assert len(folders) == len(platform.TIERS)


def test_cache_root_default_is_under_home(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_KERNEL_CACHE", raising=False)
    assert cpp_extension.cache_root() == Path.home() / ".cache" / "pagedllm" / "kernels"


# ---- _build_lock -------------------------------------------------------------------------------------


def test_build_lock_removes_a_stale_lock_file(tmp_path):
    (tmp_path / "lock").write_text("left by a killed build")
    with cpp_extension._build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
    # a second use with no lock file is fine too
    with cpp_extension._build_lock(tmp_path):
        pass


HOLDER = """\
import fcntl, sys
with open(sys.argv[1], "w") as handle:
    fcntl.flock(handle, fcntl.LOCK_EX)
    print("held", flush=True)
    sys.stdin.read()  # until the test closes our stdin
"""


def test_build_lock_waits_for_a_live_builder(tmp_path):
    """While another process holds the flock (a live build), `lock` is its own: it stays, and we wait."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path / ".pagedllm-build.lock")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    entered = threading.Event()
    try:
        assert holder.stdout.readline().strip() == "held"
        (tmp_path / "lock").write_text("the live builder's")

        def enter() -> None:
            with cpp_extension._build_lock(tmp_path):
                entered.set()

        waiter = threading.Thread(target=enter, daemon=True)
        waiter.start()
        assert not entered.wait(1.0), "entered the build folder while another process held its flock"
        assert (tmp_path / "lock").exists(), "removed a live builder's lock file"
        holder.stdin.close()  # the holder exits, and its flock with it
        assert entered.wait(60), "never got the flock after the holder exited"
        waiter.join(60)
        assert not (tmp_path / "lock").exists()
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait(30)


# ---- a real build ------------------------------------------------------------------------------------


def test_fresh_build_says_compiling_once(monkeypatch, tmp_path, kernel_src, capfd):
    from torch.utils.cpp_extension import is_ninja_available

    if shutil.which("c++") is None or not is_ninja_available():
        pytest.skip("no C++ compiler or ninja here")
    monkeypatch.setenv("PAGEDLLM_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("PAGEDLLM_NO_CPU_KERNEL", raising=False)
    tier = "avx2" if platform.tier_of(platform._read_cpuinfo()[1]) != "none" else "none"
    folder, module, _ = cpp_extension.build_dir("pagedllm_cache_test", kernel_src, tier)
    folder.mkdir(parents=True)
    (folder / "lock").write_text("left by a killed build")  # would make torch wait forever

    ext = cpp_extension.load_cpp_extension("pagedllm_cache_test", kernel_src, tier=tier)
    first = capfd.readouterr().err
    assert ext is not None, first
    assert ext.add_one(41) == 42
    assert first.count("pagedllm: compiling CPU kernels pagedllm_cache_test") == 1
    assert f"for {tier}" in first and str(folder) in first
    assert (folder / f"{module}.so").is_file()
    assert cpp_extension.is_built("pagedllm_cache_test", kernel_src, tier)

    again = cpp_extension.load_cpp_extension("pagedllm_cache_test", kernel_src, tier=tier)
    assert again is not None and again.add_one(1) == 2
    assert "compiling" not in capfd.readouterr().err


def test_no_cpu_kernel_env_gives_none(monkeypatch, tmp_path, kernel_src):
    monkeypatch.setenv("PAGEDLLM_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PAGEDLLM_NO_CPU_KERNEL", "1")
    assert cpp_extension.load_cpp_extension("pagedllm_cache_test", kernel_src, tier="none") is None
    assert not (tmp_path / "cache").exists()
