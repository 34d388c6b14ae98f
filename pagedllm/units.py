"""Byte sizes as people write them ("80GiB", "40GB") and back.

Binary units (KiB, MiB, GiB, TiB) are powers of 1024; decimal units (KB, MB, GB, TB) are powers of
1000. They are never mixed: a power of 1024 is always printed as "GiB", never "GB".
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

from pagedllm.errors import InputError

BINARY_UNITS = {"KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4}
DECIMAL_UNITS = {"KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4}
# Lookup is case-insensitive ("gib" == "GiB"); "B" or no unit means bytes.
_MULTIPLIER = {name.lower(): mult for name, mult in {**BINARY_UNITS, **DECIMAL_UNITS, "B": 1}.items()}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


def parse_size(text: str | int, param: str = "size") -> int:
    """ "80GiB" -> 85899345920, "40GB" -> 40000000000, "12345" -> 12345 (bytes, an int).

    Decimals are computed exactly ("1.5GiB" -> 1610612736); a fraction of a byte is dropped.
    """
    if isinstance(text, bool):  # bool is an int subclass; True is not a size
        raise InputError(f"{param} {text!r} is not a size; write e.g. 80GiB, 40GB or 12345", param=param)
    if isinstance(text, int):
        if text < 0:
            raise InputError(f"{param} {text} is negative; sizes must be >= 0 bytes", param=param)
        return text
    raw = str(text)
    cleaned = raw.replace("_", "").replace(",", "")  # allow "3,355,443,200" and "3_355_443_200"
    if cleaned.strip().startswith("-"):
        raise InputError(f"{param} {raw!r} is negative; sizes must be >= 0 bytes", param=param)
    m = _SIZE_RE.match(cleaned)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in ("", *_MULTIPLIER):
        raise InputError(
            f"{param} {raw!r} is not a size; write a number with an optional unit: "
            "B, KiB/MiB/GiB/TiB (powers of 1024) or KB/MB/GB/TB (powers of 1000), e.g. 80GiB",
            param=param,
        )
    mult = _MULTIPLIER.get(unit, 1)
    return math.floor(Fraction(m.group(1)) * mult)


def format_size(num_bytes: int, binary: bool = True, unit: str | None = None, digits: int = 3) -> str:
    """85899345920 -> "80 GiB"; binary=False -> "85.899 GB"; unit="MiB" forces that unit.

    The number is rounded to `digits` decimals and trailing zeros are dropped ("3.125 GiB", "1.5 MiB").
    """
    units = BINARY_UNITS if binary else DECIMAL_UNITS
    if unit is not None:
        if unit == "B":
            return f"{num_bytes} B"
        if unit not in units:
            raise InputError(f"unit {unit!r} is not one of B, {', '.join(units)}", param="unit")
        mult = units[unit]
    else:
        unit, mult = "B", 1
        for name, m in units.items():
            if abs(num_bytes) >= m:
                unit, mult = name, m
    if mult == 1:
        return f"{num_bytes} B"
    value = Fraction(num_bytes) / mult
    text = f"{float(value):.{digits}f}".rstrip("0").rstrip(".")
    return f"{text} {unit}"
