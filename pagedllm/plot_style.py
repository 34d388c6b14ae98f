"""One look for every picture pagedllm draws: the PNGs (`bench --plot-dir`, `plan --plot`) and the live
/kv page of `pagedllm serve`, which takes the same colors as CSS variables (css_palette).

Every figure gets a title naming what was measured (model, dtype, quantization), where (CPU model and the
kernel tier from pagedllm/platform.py) and when; count axes get integer ticks; colors and fonts come from
here. matplotlib is imported inside the functions: nothing imports it until a plot is asked for.
"""

from __future__ import annotations

import datetime
from contextlib import contextmanager
from pathlib import Path

from pagedllm.errors import InputError
from pagedllm.platform import capabilities

OURS = "#3b6fb6"  # pagedllm
OURS_LIGHT = "#6a96d6"
PEER = "#8c8c8c"  # the tools people use today
SECOND = "#d9534f"  # a second measure beside the first (latency beside throughput)
# KV-cache slots and blocks, in `plan --plot` and on the /kv page
USED = "#4c9a2a"  # slots holding tokens; a block one request holds
WASTED = SECOND  # slots reserved and unused: a tail block's rest, a max_len reservation
IDLE = "#e8e8e8"  # a free block; memory nothing uses
OVERHEAD = "#f0ad4e"  # runtime overhead in the memory bar
CACHED = "#a9c1e6"  # a free block that still holds a cached prefix (a lighter OURS: prefix caching's)
COW = "#8e5bb5"  # a block a request got by copy-on-write
EVICTED = "#333333"  # a block whose cached prefix was just evicted for new contents
# a /kv cell's data-state -> its color (shared: the blocks prefix caching saves, pagedllm's own color)
KV_STATE_COLORS = {"free": IDLE, "cached": CACHED, "used": USED, "shared": OURS, "cow": COW, "evicted": EVICTED}
DPI = 100
RC = {
    "font.size": 9,
    "axes.titlesize": 9,
    "axes.labelsize": 9,
    "xtick.labelsize": 8,
    "ytick.labelsize": 8,
    "legend.fontsize": 8,
    "figure.titlesize": 10,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "grid.alpha": 0.3,
    "axes.axisbelow": True,
    "figure.constrained_layout.h_pad": 0.08,
    "figure.constrained_layout.w_pad": 0.08,
}
_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def css_palette() -> str:
    """These colors as CSS custom properties (`--kv-used`, `--ours`, ...), served to the /kv and chat pages
    as /static/palette.css, so that the page and the PNGs cannot drift apart."""
    named = {"ours": OURS, "ours-light": OURS_LIGHT, "peer": PEER, "wasted": WASTED}
    named |= {f"kv-{state}": color for state, color in KV_STATE_COLORS.items()}
    body = "".join(f"  --{name}: {color};\n" for name, color in named.items())
    return f"/* generated from pagedllm/plot_style.py */\n:root {{\n{body}}}\n"


def machine() -> str:
    """This CPU as the kernels see it: "AMD EPYC 7B13 (avx2)"."""
    caps = capabilities()
    return f"{caps.cpu_model} ({caps.tier})"


def dtype_name(dtype) -> str:
    """torch.float32, "float32" or "fp32" -> "fp32"."""
    name = str(dtype).removeprefix("torch.")
    return _DTYPES.get(name, name)


def header(
    title: str,
    *,
    model: str | None = None,
    dtype=None,
    quantization: str | None = None,
    cpu: str | bool = True,
    date: str | None = None,
) -> str:
    """The title every figure carries: its own line, then model / dtype / quantization, then CPU and date.

    Unknown fields (None) are left out. cpu=True: this machine; cpu=False: none (a plan is arithmetic,
    not a measurement of this machine); a string: that CPU (a report measured elsewhere).
    """
    what = [
        f"model {Path(model).name or model}" if model else None,
        f"dtype {dtype_name(dtype)}" if dtype is not None else None,
        f"quantization {quantization}" if quantization else None,
    ]
    where = [
        f"CPU {machine() if cpu is True else cpu}" if cpu else None,
        date or datetime.date.today().isoformat(),
    ]
    lines = [title, " · ".join(w for w in what if w), " · ".join(w for w in where if w)]
    return "\n".join(line for line in lines if line)


@contextmanager
def styled():
    """pyplot with this module's fonts and grid; the figures are for files only (Agg, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with plt.rc_context(RC):
        yield plt


def figure(plt, nrows: int = 1, ncols: int = 1, **kw):
    """(fig, axes) with constrained layout, so that no label touches another or the frame."""
    return plt.subplots(nrows, ncols, layout="constrained", **kw)


def integer_ticks(*axes) -> None:
    """Counts (requests, blocks, tokens) get whole-number ticks only."""
    from matplotlib.ticker import MaxNLocator

    for axis in axes:
        axis.set_major_locator(MaxNLocator(integer=True))


def save(fig, path: str | Path, make_dirs: bool = True, dpi: int = DPI) -> Path:
    """Write the PNG (its folder made first if make_dirs) and free the figure; an OSError is an InputError."""
    import matplotlib.pyplot as plt

    path = Path(path)
    try:
        if make_dirs:
            path.parent.mkdir(parents=True, exist_ok=True)
        with plt.rc_context(RC):
            fig.savefig(path, dpi=dpi)
    except OSError as e:
        raise InputError(f"cannot write plot {str(path)!r}: {e.strerror}", param="plot") from None
    finally:
        plt.close(fig)
    return path
