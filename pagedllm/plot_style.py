"""One look for every PNG pagedllm draws (`bench --plot-dir`, `plan --plot`).

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
