"""PNG plots of bench reports. Small on purpose: docs/img keeps them.

Each `plot_*` writes a PNG and returns its path; the `*_figure` function beside it returns the matplotlib
Figure (tests look at it). Every figure carries pagedllm/plot_style.py's title: model, dtype and
quantization (keyword arguments; else the report's own "model" / "dtype" / "quantization" keys, where it
has them), this CPU with its kernel tier, and the date.
"""

from __future__ import annotations

from pathlib import Path

from pagedllm import plot_style as style
from pagedllm.units import format_size

# what each system in a throughput report is, for a reader
LABELS = {
    "hf": "HF transformers\n(static batch)",
    "llama.cpp": "llama.cpp\nllama-server",
    "openvino": "OpenVINO GenAI\n(continuous batching)",
    "llama-cpp-python": "llama-cpp-python\n(one at a time)",
    "llama-cpp-python-batch": "llama-cpp-python\n(batched)",
}
# rows of ours besides "pagedllm" (the same run with something added)
OURS_SUFFIXES = {"+json": "JSON-schema constrained"}
# what --quantization means for the default GGUF model, as a panel title
MODES = {
    "none": "weights dequantized to the compute dtype",
    "gguf": "GGUF blocks served natively",
    "auto": "GGUF served natively where a kernel runs here",
}


def _meta(report: dict, model, dtype, quantization) -> dict:
    """The header's fields: the caller's, else the report's own."""
    return {
        "model": model or report.get("model"),
        "dtype": dtype or report.get("dtype"),
        "quantization": quantization or report.get("quantization"),
    }


# ---- bench throughput -----------------------------------------------------------------------------------
def systems(report: dict) -> list[str]:
    """Every system a throughput report measured, in its order (ours first, then each peer)."""
    return [k for k, v in report.items() if isinstance(v, dict) and "output_tokens_per_second" in v]


def _label(name: str, quantization: str | None) -> str:
    if not name.startswith("pagedllm"):
        return LABELS.get(name, name)
    suffix = name[len("pagedllm") :]
    label = f"pagedllm ({quantization})" if quantization else "pagedllm"
    return label + (f"\n{OURS_SUFFIXES.get(suffix, suffix)}" if suffix else "")


def offline_figure(
    report: dict,
    title: str = "offline output tokens/s",
    *,
    model: str | None = None,
    dtype=None,
    quantization: str | None = None,
    more_runs: dict[str, dict | None] | None = None,
):
    """One bar per system of output tokens/s: every row the report measured, none left out.

    more_runs: other runs of the same workload, by their --quantization (`{"gguf": w32_gguf}`; None: not
    run). Each run gets its own panel on a shared axis, since each run's ratios are its own.
    """
    meta = _meta(report, model, dtype, quantization)
    runs = [(meta["quantization"], report)] + [(q, r) for q, r in (more_runs or {}).items() if r]
    heights = [0.5 + 0.42 * len(systems(r)) for _, r in runs]
    most = max(r[s]["output_tokens_per_second"] for _, r in runs for s in systems(r))
    with style.styled() as plt:
        fig, axes = style.figure(
            plt,
            len(runs),
            1,
            figsize=(7.0, 0.9 + sum(heights)),
            sharex=True,
            height_ratios=heights,
            squeeze=False,
        )
        for ax, (q, r) in zip(axes[:, 0], runs):
            names = systems(r)
            colors = [
                style.OURS
                if n == "pagedllm"
                else style.OURS_LIGHT
                if n.startswith("pagedllm")
                else style.PEER
                for n in names
            ]
            bars = ax.barh(
                [_label(n, q) for n in names], [r[n]["output_tokens_per_second"] for n in names], color=colors
            )
            ax.bar_label(bars, fmt="%.0f", padding=3)
            ax.invert_yaxis()
            ax.grid(axis="x")
            if len(runs) > 1:
                ax.set_title(f"--quantization {q}: {MODES.get(q, q)}" if q else "run", loc="left")
        ax.set_xlim(0, most * 1.2)
        ax.set_xlabel("output tokens/s (higher is better)")
        modes = " and ".join(q for q, _ in runs if q) or None
        fig.suptitle(style.header(title, **{**meta, "quantization": modes}))
    return fig


def plot_offline(report: dict, path: str | Path, title: str = "offline output tokens/s", **kw) -> Path:
    """offline_figure (same keyword arguments) to a PNG."""
    return style.save(offline_figure(report, title, **kw), path)


# ---- bench serve ----------------------------------------------------------------------------------------
def _concurrency(run: dict) -> int:
    """max_concurrency; a run without a limit had every request in flight at once."""
    return run["max_concurrency"] or run["completed"] + run["failed"]


def concurrency_figure(runs: list[dict], *, model=None, dtype=None, quantization=None):
    """Output throughput above, median TPOT below, against max concurrency: two panels, one x axis."""
    runs = sorted(runs, key=_concurrency)
    xs = [_concurrency(r) for r in runs]
    with style.styled() as plt:
        from matplotlib.ticker import NullLocator

        fig, (top, bottom) = style.figure(plt, 2, 1, figsize=(6.4, 4.8), sharex=True)
        top.plot(xs, [r["output_throughput"] for r in runs], "o-", color=style.OURS)
        top.set_ylabel("output tokens/s")
        top.set_title("throughput (higher is better)", loc="left")
        bottom.plot(xs, [r["median_tpot_ms"] for r in runs], "s-", color=style.SECOND)
        bottom.set_ylabel("median TPOT (ms)")
        bottom.set_title("time per output token (lower is better)", loc="left")
        for ax in (top, bottom):
            ax.set_ylim(bottom=0)
            ax.margins(y=0.15)
            ax.grid()
        bottom.set_xscale("log", base=2)
        bottom.set_xticks(xs, [str(x) for x in xs])
        bottom.xaxis.set_minor_locator(NullLocator())
        bottom.set_xlabel("max concurrency (requests in flight)")
        fig.suptitle(
            style.header("bench serve: concurrency sweep", **_meta(runs[0], model, dtype, quantization))
        )
    return fig


def plot_concurrency(runs: list[dict], path: str | Path, **kw) -> Path:
    return style.save(concurrency_figure(runs, **kw), path)


def _cdf(ax, values: list[float], label: str, color) -> None:
    values = sorted(values)
    if values:
        ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=label, color=color)


def latency_figure(runs: list[dict], *, model=None, dtype=None, quantization=None):
    """TTFT and ITL distributions (CDFs) of bench serve runs, one line per max concurrency."""
    with style.styled() as plt:
        fig, (a, b) = style.figure(plt, 1, 2, figsize=(7.0, 3.6), sharey=True)
        cmap = plt.get_cmap("viridis")
        for i, run in enumerate(sorted(runs, key=_concurrency)):
            color = cmap(i / max(1, len(runs) - 1) * 0.85)
            label = f"concurrency {_concurrency(run)}"
            _cdf(a, [t * 1000 for t, e in zip(run["ttfts"], run["errors"]) if not e], label, color)
            _cdf(b, [x * 1000 for row in run["itls"] for x in row], label, color)
        a.set_xlabel("TTFT (ms)")
        a.set_title("time to first token", loc="left")
        b.set_xlabel("ITL (ms)")
        b.set_title("inter-token latency", loc="left")
        a.set_ylabel("fraction of requests / gaps")
        for ax in (a, b):
            ax.grid()
        a.legend(loc="lower right")
        fig.suptitle(style.header("bench serve: latency", **_meta(runs[0], model, dtype, quantization)))
    return fig


def plot_latency(runs: list[dict], path: str | Path, **kw) -> Path:
    return style.save(latency_figure(runs, **kw), path)


# ---- bench memory ---------------------------------------------------------------------------------------
def memory_figure(report: dict, *, model=None, dtype=None, quantization=None):
    """Requests that fit (paged vs naive) and blocks held (shared prefix with vs without caching)."""
    p = report["shared_prefix"]
    kv_bytes = report.get("kv_cache_bytes") or (
        report["num_blocks"] * report["block_size"] * report["kv_bytes_per_token"]
    )
    with style.styled() as plt:
        fig, (a, b) = style.figure(plt, 1, 2, figsize=(6.4, 3.8))
        bars = a.bar(
            ["naive\n(max_model_len each)", "paged"],
            [report["naive_fits"], report["paged_fits"]],
            color=[style.PEER, style.OURS],
        )
        a.bar_label(bars, padding=2)
        a.set_ylabel("concurrent requests that fit")
        a.set_title(
            f"{report['num_blocks']} blocks x {report['block_size']} tokens\n"
            f"= {format_size(kv_bytes, digits=1)} KV cache ({report.get('kv_cache_dtype', '?')})"
        )
        bars = b.bar(
            ["no prefix\ncaching", "prefix\ncaching"],
            [p["blocks_without_prefix_caching"], p["blocks_with_prefix_caching"]],
            color=[style.PEER, style.OURS],
        )
        b.bar_label(bars, padding=2)
        b.set_ylabel("KV blocks held")
        b.set_title(f"{p['num_requests']} requests sharing\na {p['prefix_len']}-token prompt")
        for ax in (a, b):
            style.integer_ticks(ax.yaxis)
            ax.margins(x=0.15, y=0.15)
            ax.grid(axis="y")
        fig.suptitle(
            style.header("bench memory: paged KV blocks", **_meta(report, model, dtype, quantization))
        )
    return fig


def plot_memory(report: dict, path: str | Path, **kw) -> Path:
    return style.save(memory_figure(report, **kw), path)
