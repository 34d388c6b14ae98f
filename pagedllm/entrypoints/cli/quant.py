"""`pagedllm quant explain`: quantize one value by hand, step by step, in exact decimals."""

from __future__ import annotations

import argparse
import json

from pagedllm.entrypoints.engine_args import print_help
from pagedllm.quantization.explain import Explanation, exact_str, explain, to_dict

_EXPLAIN_EPILOG = """\
examples:
  pagedllm quant explain --rmin -0.6 --rmax 0.9 --bits 4 --value 0.35
      s = 0.1, z = 6, q = 10, r_hat = 0.4: off by 0.05 = s/2, the worst an in-range value can be
  pagedllm quant explain --rmin -0.6 --rmax 0.9 --bits 4 --value 1.4
      1.4 lies beyond r_max: its code 20 saturates at 15 and it comes back as 0.9
  pagedllm quant explain --rmin -1 --rmax 1 --bits 8 --json
      the grid alone (no --value), as one JSON object

Numbers are read as exact decimals (0.35 is 7/20, not the nearest double), and round() is
round-half-up, so the results are the textbook ones to the last digit.
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "quant",
        help="explain and inspect weight quantization",
        description="Quantization tools. `pagedllm quant explain --help` shows the calculator.",
    )
    sub = parser.add_subparsers(dest="quant_command", metavar="QUANT_COMMAND")
    ex = sub.add_parser(
        "explain",
        help="quantize one value on a uniform grid, step by step, in exact decimals",
        description=(
            "Asymmetric uniform quantization of one value r on the range [r_min, r_max] with b bits:\n"
            "  s = (r_max - r_min) / (2^b - 1)       the step between neighbouring codes\n"
            "  z = round(-r_min / s)                 the code that stands for 0.0\n"
            "  q = clip(round(r / s) + z, 0, 2^b-1)  the stored code\n"
            "  r_hat = s * (q - z)                   what comes back"
        ),
        epilog=_EXPLAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ex.add_argument("--rmin", required=True, help="lowest real value of the range, e.g. -0.6")
    ex.add_argument("--rmax", required=True, help="highest real value of the range, e.g. 0.9")
    ex.add_argument("--bits", type=int, required=True, help="bits per code, 1..16 (4 gives codes 0..15)")
    ex.add_argument("--value", help="the real value r to quantize (optional: without it, just the grid)")
    ex.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    ex.set_defaults(run=run_explain)
    parser.set_defaults(run=lambda args: print_help(parser))
    return parser


def run_explain(args: argparse.Namespace) -> int:
    e = explain(args.rmin, args.rmax, args.bits, args.value)
    if args.json:
        print(json.dumps(to_dict(e)))
    else:
        print(format_explanation(e))
    return 0


def format_explanation(e: Explanation) -> str:
    x = exact_str
    lines = [
        f"range [{x(e.rmin)}, {x(e.rmax)}], {e.bits} bits: codes 0..{e.levels}, {e.levels} steps between them",
    ]
    if e.rmin == e.rmax:
        lines.append(
            f"constant range: no step to divide by, so s = {x(e.scale)} and z = {e.zero_point} "
            f"put {x(e.rmax)} exactly on code {e.zero_point + (1 if e.rmax > 0 else -1 if e.rmax < 0 else 0)}"
        )
    else:
        lines += [
            f"scale       s = (r_max - r_min) / (2^b - 1) = ({x(e.rmax)} - {x(e.rmin)}) / {e.levels} = {x(e.scale)}",
            f"zero point  z = round(-r_min / s) = round({x(-e.rmin / e.scale)}) = {e.zero_point}"
            f"  (code {e.zero_point} stands for 0.0)",
        ]
    if e.value is None:
        lines.append(
            f"in-range values come back within s/2 = {x(e.error_bound)} (~{float(e.error_bound):.3g})"
        )
        return "\n".join(lines)
    lines.append(
        f"code        q = clip(round(r / s) + z, 0, {e.levels}) = clip(round({x(e.value / e.scale)}) + {e.zero_point}, "
        f"0, {e.levels}) = clip({e.code_unclipped}, 0, {e.levels}) = {e.code}"
    )
    if e.clipped:
        side = "above r_max" if e.code_unclipped > e.levels else "below r_min"
        lines.append(f"            {x(e.value)} lies {side}: code {e.code_unclipped} saturates at {e.code}")
    lines += [
        f"back        r_hat = s * (q - z) = {x(e.scale)} * ({e.code} - {e.zero_point}) = {x(e.reconstructed)}",
        f"error       |r - r_hat| = |{x(e.value)} - {x(e.reconstructed)}| = {x(e.error)}"
        f"  (in-range bound s/2 = {x(e.error_bound)})",
    ]
    return "\n".join(lines)
