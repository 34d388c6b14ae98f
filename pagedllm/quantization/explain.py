"""The quantizer's arithmetic for one value, in exact decimals.

A double cannot hold 0.35 / 0.1 = 3.5 (it gives 3.4999999999999996, which rounds the wrong way), so the
inputs are read as decimal strings into Fractions and every step is exact. The formulas and the constant
range rule are those of quantization/uniform.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from pagedllm.errors import InputError

MAX_BITS = 16
MAX_MAGNITUDE = Fraction(10) ** 300


def to_fraction(value: str | int | float | Fraction, name: str = "value") -> Fraction:
    """ "0.35" -> 7/20 exactly. A float is taken as the shortest decimal that prints it (0.1 -> 1/10)."""
    if isinstance(value, Fraction):
        return value
    text = repr(value) if isinstance(value, float) else str(value).strip()
    try:
        x = Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise InputError(f"{name} {value!r} is not a finite decimal number", param=name) from None
    if abs(x) > MAX_MAGNITUDE:  # results are also reported as floats
        raise InputError(f"{name} {value!r} is too large; limit is 1e300 in magnitude", param=name)
    return x


def round_half_up(x: Fraction) -> int:
    """Ties go to the larger integer: 3.5 -> 4, -2.5 -> -2."""
    return math.floor(x + Fraction(1, 2))


def check_bits(bits: int) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= MAX_BITS:
        raise InputError(f"bits must be between 1 and {MAX_BITS}, got {bits!r}", param="bits")
    return bits


def scale(rmin, rmax, bits: int) -> Fraction:
    """s = (r_max - r_min) / (2^b - 1): the step between neighbouring codes."""
    return grid(rmin, rmax, bits)[0]


def grid(rmin, rmax, bits: int) -> tuple[Fraction, int]:
    """(s, z) for the range; a constant range gets the exact grid of uniform.py (s = |v| or 1)."""
    lo, hi = to_fraction(rmin, "rmin"), to_fraction(rmax, "rmax")
    check_bits(bits)
    if lo > hi:
        raise InputError(
            f"rmin {exact_str(lo)} is larger than rmax {exact_str(hi)}; the range must have rmin <= rmax",
            "rmin",
        )
    if lo == hi:  # constant: no step to divide by; put the value on code 1 (or 0) exactly
        if hi == 0:
            return Fraction(1), 0
        return abs(hi), (1 if hi < 0 else 0)
    s = (hi - lo) / (2**bits - 1)
    return s, round_half_up(-lo / s)


@dataclass
class Explanation:
    rmin: Fraction
    rmax: Fraction
    bits: int
    levels: int  # 2^b - 1 steps between the 2^b codes
    scale: Fraction
    zero_point: int
    error_bound: Fraction  # s / 2: the most an in-range value can be off (0 for a constant range)
    value: Fraction | None = None
    code_unclipped: int | None = None  # round(r / s) + z before clipping
    code: int | None = None  # clipped to 0..2^b-1
    clipped: bool | None = None
    reconstructed: Fraction | None = None  # s * (q - z)
    error: Fraction | None = None  # |r - r_hat|


def explain(rmin, rmax, bits: int, value=None) -> Explanation:
    """Every quantity of quantizing `value` on the grid [rmin, rmax] with `bits` bits, exactly."""
    lo, hi = to_fraction(rmin, "rmin"), to_fraction(rmax, "rmax")
    s, z = grid(lo, hi, bits)
    levels = 2**bits - 1
    out = Explanation(lo, hi, bits, levels, s, z, s / 2 if lo != hi else Fraction(0))
    if value is None:
        return out
    r = to_fraction(value, "value")
    unclipped = round_half_up(r / s) + z
    q = min(max(unclipped, 0), levels)
    r_hat = s * (q - z)
    out.value, out.code_unclipped, out.code, out.clipped = r, unclipped, q, q != unclipped
    out.reconstructed, out.error = r_hat, abs(r - r_hat)
    return out


def exact_str(x: Fraction | int) -> str:
    """Exact text: a terminating decimal when there is one ("0.05"), else "p/q" ("2/15")."""
    x = Fraction(x)
    den = x.denominator
    twos = fives = 0
    while den % 2 == 0:
        den //= 2
        twos += 1
    while den % 5 == 0:
        den //= 5
        fives += 1
    if den != 1:
        return f"{x.numerator}/{x.denominator}"
    digits = max(twos, fives)
    if digits == 0:
        return str(x.numerator)
    scaled = abs(x.numerator) * 10**digits // x.denominator
    sign = "-" if x < 0 else ""
    whole, frac = divmod(scaled, 10**digits)
    return f"{sign}{whole}.{frac:0{digits}d}".rstrip("0").rstrip(".")


def to_dict(e: Explanation) -> dict:
    """JSON-ready: numbers as floats, and the same numbers as exact strings under "exact"."""
    fields = {
        "rmin": e.rmin,
        "rmax": e.rmax,
        "scale": e.scale,
        "error_bound": e.error_bound,
    }
    if e.value is not None:
        fields.update(value=e.value, reconstructed=e.reconstructed, error=e.error)
    out: dict = {"bits": e.bits, "levels": e.levels, "zero_point": e.zero_point}
    out.update({k: float(v) for k, v in fields.items()})
    if e.value is not None:
        out.update(code_unclipped=e.code_unclipped, code=e.code, clipped=e.clipped)
    out["exact"] = {k: exact_str(v) for k, v in fields.items()}
    return out
