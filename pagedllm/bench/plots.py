"""PNG plots of bench reports (matplotlib, Agg: no display needed). Small on purpose: docs/img keeps them."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# what each system in a throughput report is, for a reader
LABELS = {
    "pagedllm": "pagedllm",
    "hf": "HF transformers\n(static batch)",
    "llama.cpp": "llama.cpp\nllama-server",
    "openvino": "OpenVINO GenAI\n(continuous batching)",
    "llama-cpp-python": "llama-cpp-python\n(one at a time)",
    "llama-cpp-python-batch": "llama-cpp-python\n(batched)",
}
_FIGSIZE = (6.4, 3.4)
_DPI = 90


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def plot_offline(report: dict, path: str | Path, title: str = "offline output tokens/s") -> Path:
    """One bar per system (pagedllm and each peer) of output tokens/s."""
    names = [k for k, v in report.items() if isinstance(v, dict) and "output_tokens_per_second" in v]
    values = [report[k]["output_tokens_per_second"] for k in names]
    fig, ax = plt.subplots(figsize=_FIGSIZE)
    labels = [LABELS.get(n, n) for n in names]
    bars = ax.barh(labels, values, color=["tab:blue"] + ["tab:gray"] * (len(names) - 1))
    ax.bar_label(bars, fmt="%.0f", padding=3)
    ax.set_xlabel("output tokens/s (higher is better)")
    ax.set_title(title)
    ax.invert_yaxis()
    ax.set_xlim(0, max(values) * 1.2)
    return _save(fig, path)


def plot_concurrency(runs: list[dict], path: str | Path) -> Path:
    """Output throughput and median TPOT against max concurrency (bench serve sweep)."""
    runs = sorted(runs, key=lambda r: r["max_concurrency"] or 0)
    xs = [r["max_concurrency"] for r in runs]
    fig, ax = plt.subplots(figsize=_FIGSIZE)
    ax.plot(xs, [r["output_throughput"] for r in runs], "o-", color="tab:blue", label="output tok/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("max concurrency")
    ax.set_ylabel("output tokens/s", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(xs, [r["median_tpot_ms"] for r in runs], "s--", color="tab:red", label="median TPOT")
    ax2.set_ylabel("median TPOT (ms)", color="tab:red")
    ax.set_title("bench serve: throughput and per-token latency vs concurrency")
    return _save(fig, path)


def _cdf(ax, values: list[float], label: str) -> None:
    values = sorted(values)
    if values:
        ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=label)


def plot_latency(runs: list[dict], path: str | Path) -> Path:
    """TTFT and ITL distributions (CDFs) of bench serve runs, one line per max concurrency."""
    fig, (a, b) = plt.subplots(1, 2, figsize=_FIGSIZE)
    for run in runs:
        label = f"concurrency {run.get('max_concurrency')}"
        _cdf(a, [t * 1000 for t, e in zip(run["ttfts"], run["errors"]) if not e], label)
        _cdf(b, [x * 1000 for row in run["itls"] for x in row], label)
    a.set_xlabel("TTFT (ms)")
    a.set_title("time to first token")
    b.set_xlabel("ITL (ms)")
    b.set_title("inter-token latency")
    for ax in (a, b):
        ax.set_ylabel("fraction")
        ax.grid(alpha=0.3)
    a.legend(fontsize=7)
    return _save(fig, path)


def plot_memory(report: dict, path: str | Path) -> Path:
    """Requests that fit (paged vs naive) and blocks held (shared prefix with vs without caching)."""
    p = report["shared_prefix"]
    fig, (a, b) = plt.subplots(1, 2, figsize=_FIGSIZE)
    bars = a.bar(
        ["naive\n(max_model_len)", "paged"],
        [report["naive_fits"], report["paged_fits"]],
        color=["tab:gray", "tab:blue"],
    )
    a.bar_label(bars)
    a.set_ylabel("concurrent requests that fit")
    a.set_title(f"{report['num_blocks']} blocks x {report['block_size']}", fontsize=9)
    bars = b.bar(
        ["no prefix\ncaching", "prefix\ncaching"],
        [p["blocks_without_prefix_caching"], p["blocks_with_prefix_caching"]],
        color=["tab:gray", "tab:blue"],
    )
    b.bar_label(bars)
    b.set_ylabel("KV blocks held")
    b.set_title(f"{p['num_requests']} requests, shared {p['prefix_len']}-token prompt", fontsize=9)
    return _save(fig, path)
