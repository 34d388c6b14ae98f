"""platform.py: the CPU tier from /proc/cpuinfo flags, the PAGEDLLM_CPU_ISA cap, and each tier's cflags.

Most tests run on flag sets and capability sets built by hand, so they check the same thing on every CPU;
the ones that read this machine's /proc/cpuinfo skip where the CPU has no avx2 (or is not x86).
"""

from __future__ import annotations

import platform as std_platform

import pytest

from pagedllm import platform
from pagedllm.errors import InputError

AVX2 = frozenset({"avx2", "fma", "f16c"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
AVX512_BF16 = AVX512 | {"avx512_bf16", "avx512_vnni"}
AMX = AVX512_BF16 | {"amx_tile", "amx_bf16"}
FLAGS_OF = {"avx2": AVX2, "avx512": AVX512, "avx512_bf16": AVX512_BF16, "amx": AMX}
COMMON = frozenset({"fpu", "sse", "sse2", "ssse3", "sse4_1", "sse4_2", "avx", "popcnt"})


@pytest.fixture
def fresh_caps():
    """capabilities() is cached per process: clear it around a test that changes what it reads."""
    platform.capabilities.cache_clear()
    yield platform.capabilities
    platform.capabilities.cache_clear()


def caps_for(tier: str, detected: str | None = None) -> platform.Capabilities:
    detected = detected or tier
    return platform.Capabilities(
        device="cpu",
        cpu_model="hand-built",
        flags=FLAGS_OF.get(detected, frozenset()),
        detected_tier=detected,
        tier=tier,
        capped_by_env=tier != detected,
    )


def this_cpu_tier() -> str:
    if std_platform.machine() not in ("x86_64", "AMD64"):
        return "none"
    return platform.tier_of(platform._read_cpuinfo()[1])


# ---- tier_of ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tier", platform.TIERS)
def test_tier_of_each_tier(tier):
    assert platform.tier_of(COMMON | FLAGS_OF[tier]) == tier


def test_tier_of_no_flags_is_none():
    assert platform.tier_of(frozenset()) == "none"
    assert platform.tier_of(COMMON) == "none"


@pytest.mark.parametrize("missing", sorted(AVX2))
def test_tier_of_missing_one_avx2_flag_is_none(missing):
    assert platform.tier_of(COMMON | (AVX2 - {missing})) == "none"


@pytest.mark.parametrize("missing", sorted(AVX2))
def test_higher_flags_do_not_count_without_avx2(missing):
    # AVX-512, bf16 and AMX flags are all there, but one avx2-tier flag is not: nothing is reached
    assert platform.tier_of(COMMON | (AMX - {missing})) == "none"


def test_tier_of_stops_at_the_first_incomplete_tier():
    assert platform.tier_of(AVX512 - {"avx512dq"}) == "avx2"
    # bf16 and AMX flags without the full AVX-512 set: avx2, not higher
    assert platform.tier_of(AMX - {"avx512vl"}) == "avx2"
    # AMX without avx512_bf16
    assert platform.tier_of(AMX - {"avx512_bf16"}) == "avx512"
    # bf16 without VNNI (no such CPU is known): the bf16 tier's kernels use VPDPBUSD, so not that tier
    assert platform.tier_of(AMX - {"avx512_vnni"}) == "avx512"
    # only one of the two AMX flags
    assert platform.tier_of(AMX - {"amx_bf16"}) == "avx512_bf16"


# ---- check_isa_cap ------------------------------------------------------------------------------------


@pytest.mark.parametrize("detected", platform.TIERS)
def test_check_isa_cap_accepts_every_tier_up_to_the_detected_one(detected):
    top = platform.TIERS.index(detected)
    for value in platform.TIERS[: top + 1]:
        assert platform.check_isa_cap(value, detected) == value
    for value in platform.TIERS[top + 1 :]:
        with pytest.raises(InputError, match=platform.ISA_ENV) as info:
            platform.check_isa_cap(value, detected)
        assert "above" in str(info.value) and detected in str(info.value)
        assert info.value.param == platform.ISA_ENV


@pytest.mark.parametrize("value", ["bogus", "AVX2", "avx-512", "native", "none", ""])
def test_check_isa_cap_rejects_unknown_values(value):
    with pytest.raises(InputError, match=platform.ISA_ENV) as info:
        platform.check_isa_cap(value, "amx")
    assert repr(value) in str(info.value)
    assert info.value.param == platform.ISA_ENV


def test_check_isa_cap_on_a_cpu_below_avx2_rejects_every_tier():
    for value in platform.TIERS:
        with pytest.raises(InputError, match=platform.ISA_ENV):
            platform.check_isa_cap(value, "none")


# ---- capabilities() -----------------------------------------------------------------------------------


def fake_cpu(monkeypatch, flags: frozenset[str], model: str = "Fake CPU") -> None:
    monkeypatch.setattr(platform, "_read_cpuinfo", lambda: (model, flags))
    monkeypatch.setattr(platform._platform, "machine", lambda: "x86_64")


@pytest.mark.parametrize("cap", platform.TIERS)
def test_capabilities_capped_on_an_amx_cpu(monkeypatch, fresh_caps, cap):
    fake_cpu(monkeypatch, COMMON | AMX)
    monkeypatch.setenv(platform.ISA_ENV, cap)
    caps = fresh_caps()
    assert caps.detected_tier == "amx"
    assert caps.tier == cap
    assert caps.capped_by_env is (cap != "amx")
    assert caps.native_bf16 is (cap in ("avx512_bf16", "amx"))
    assert caps.cpu_model == "Fake CPU"


def test_capabilities_without_cap_is_the_detected_tier(monkeypatch, fresh_caps):
    fake_cpu(monkeypatch, COMMON | AVX512_BF16)
    monkeypatch.delenv(platform.ISA_ENV, raising=False)
    caps = fresh_caps()
    assert (caps.tier, caps.detected_tier, caps.capped_by_env) == ("avx512_bf16", "avx512_bf16", False)
    assert caps.native_bf16


def test_capabilities_cap_above_the_cpu_raises(monkeypatch, fresh_caps):
    fake_cpu(monkeypatch, COMMON | AVX2)
    monkeypatch.setenv(platform.ISA_ENV, "avx512")
    with pytest.raises(InputError, match=platform.ISA_ENV):
        fresh_caps()


def test_capabilities_unknown_cap_raises(monkeypatch, fresh_caps):
    fake_cpu(monkeypatch, COMMON | AMX)
    monkeypatch.setenv(platform.ISA_ENV, "bogus")
    with pytest.raises(InputError, match=platform.ISA_ENV):
        fresh_caps()


def test_capabilities_not_x86_is_none(monkeypatch, fresh_caps):
    monkeypatch.setattr(platform, "_read_cpuinfo", lambda: ("aarch64", COMMON | AMX))
    monkeypatch.setattr(platform._platform, "machine", lambda: "aarch64")
    monkeypatch.delenv(platform.ISA_ENV, raising=False)
    caps = fresh_caps()
    assert caps.tier == caps.detected_tier == "none"
    assert not caps.native_bf16 and not caps.at_least("avx2")


def test_capabilities_is_cached(monkeypatch, fresh_caps):
    monkeypatch.delenv(platform.ISA_ENV, raising=False)
    assert fresh_caps() is fresh_caps()


def test_capabilities_of_this_cpu_capped_to_avx2(monkeypatch, fresh_caps):
    detected = this_cpu_tier()
    if detected == "none":
        pytest.skip("this machine is not x86 with avx2")
    monkeypatch.setenv(platform.ISA_ENV, "avx2")
    caps = fresh_caps()
    assert caps.tier == "avx2"
    assert caps.detected_tier == detected
    assert caps.capped_by_env is (detected != "avx2")
    assert caps.native_bf16 is False
    assert caps.at_least("avx2") and not caps.at_least("avx512")
    assert AVX2 <= caps.flags


# ---- cflags and at_least ------------------------------------------------------------------------------


def test_cflags_none_is_empty():
    assert platform.cflags("none") == []


def test_cflags_avx2():
    assert set(platform.cflags("avx2")) == {"-mavx2", "-mfma", "-mf16c"}


@pytest.mark.parametrize("tier", platform.TIERS)
def test_cflags_include_every_lower_tier_and_never_native(tier):
    flags = platform.cflags(tier)
    i = platform.TIERS.index(tier)
    for lower in platform.TIERS[:i]:
        assert set(platform.cflags(lower)) < set(flags), (lower, tier)
    for higher in platform.TIERS[i + 1 :]:
        assert not set(platform.cflags(higher)) <= set(flags), (higher, tier)
    assert all("native" not in f for f in flags)
    assert all(f.startswith("-m") for f in flags)
    assert len(flags) == len(set(flags))


def test_cflags_of_the_top_tiers():
    assert "-mavx512bf16" in platform.cflags("avx512_bf16")
    assert "-mavx512vnni" in platform.cflags("avx512_bf16")
    assert "-mavx512vnni" not in platform.cflags("avx512")
    assert {"-mamx-tile", "-mamx-bf16"} <= set(platform.cflags("amx"))
    assert "-mavx512bf16" not in platform.cflags("avx512")


@pytest.mark.parametrize("tier", platform.TIERS)
def test_at_least(tier):
    caps = caps_for(tier)
    i = platform.TIERS.index(tier)
    for other in platform.TIERS:
        assert caps.at_least(other) is (platform.TIERS.index(other) <= i), (tier, other)
    assert caps.native_bf16 is (i >= platform.TIERS.index("avx512_bf16"))


def test_at_least_none_includes_nothing():
    caps = caps_for("none", detected="none")
    assert not any(caps.at_least(t) for t in platform.TIERS)
    assert not caps.native_bf16


def test_capped_caps_answer_for_the_cap_not_the_cpu():
    caps = caps_for("avx2", detected="amx")
    assert caps.at_least("avx2") and not caps.at_least("avx512") and not caps.native_bf16
