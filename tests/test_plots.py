"""The bench and plan plots, looked at through their matplotlib Figures (no model, no server).

Reports are built by the functions that build the real ones (serve.summarize, throughput.summarize,
memory.run_memory on a stand-in engine, planner.build_plan), in the shapes the CLI writes.
"""

from __future__ import annotations

import datetime
from types import SimpleNamespace

import pytest
import torch

from pagedllm import planner
from pagedllm.bench import plots, serve, throughput
from pagedllm.bench.memory import run_memory
from pagedllm.config import CacheConfig
from pagedllm.planner.plot import plan_figure, plot_plan
from pagedllm.platform import capabilities
from pagedllm.units import format_size

META = {"model": "tiny-Q4_1.gguf", "dtype": torch.float32, "quantization": "gguf"}


def serve_runs() -> list[dict]:
    """A bench serve sweep at concurrency 1, 2, 8, as run_serve reports each run."""
    runs = []
    for conc in (8, 1, 2):  # out of order: the plots sort them
        results = [
            serve.RequestResult(
                True, 16, 8, 0.05 * conc + 0.01 * i, [0.02 + 0.001 * j for j in range(7)], 0.3
            )
            for i in range(4)
        ]
        r = serve.summarize(results, duration=1.0 / conc)
        r.update(request_rate=float("inf"), max_concurrency=conc, endpoint="/v1/completions", model="served")
        runs.append(r)
    return runs


def throughput_report(systems: dict[str, float]) -> dict:
    """{system: output tok/s} as `bench throughput` writes it: ours flat at the top, every row, the ratios."""
    rows = {
        name: throughput.summarize(
            {"elapsed_time": 128 / tps, "num_requests": 4, "prompt_tokens": 40, "output_tokens": 128}
        )
        for name, tps in systems.items()
    }
    ratios = {f"ratio_vs_{n}": systems["pagedllm"] / v for n, v in systems.items() if n != "pagedllm"}
    return {**rows["pagedllm"], **rows, **ratios}


def memory_report() -> dict:
    """run_memory on a stand-in engine (only its configuration is read): a cache of 24 blocks, so that the
    counts are small (1 and 3 requests) and an unguarded axis would get ticks at 0.5."""
    engine = SimpleNamespace(
        cache_config=CacheConfig(block_size=16, num_blocks=24),
        model_config=SimpleNamespace(num_layers=2, kv_width=8),
        max_model_len=256,
        dtype=torch.float32,
    )
    return run_memory(
        engine, num_requests=8, min_len=50, max_len=120, prefix_requests=2, prefix_len=16, use_tqdm=False
    )


def drawn(fig):
    fig.canvas.draw()  # constrained layout places the axes, and the ticks exist, at draw time
    return fig


def visible_ticks(axis) -> list[float]:
    lo, hi = sorted(axis.get_view_interval())
    return [t for t in axis.get_ticklocs() if lo <= t <= hi]


def title(fig) -> str:
    return fig._suptitle.get_text()


def test_concurrency_is_two_panels_on_one_x_axis():
    fig = drawn(plots.concurrency_figure(serve_runs()))
    top, bottom = fig.axes  # two axes, no twin
    positions = {tuple(round(v, 4) for v in ax.get_position().bounds) for ax in fig.axes}
    assert len(positions) == 2, "two axes drawn at one position (twinx)"
    assert top.get_position().y0 > bottom.get_position().y1  # stacked, not overlapping
    assert top.get_shared_x_axes().joined(top, bottom)
    assert [len(ax.get_lines()) for ax in (top, bottom)] == [1, 1]
    assert list(top.get_lines()[0].get_xdata()) == [1, 2, 8]
    assert visible_ticks(bottom.xaxis) == [1, 2, 8]  # the concurrencies measured, whole numbers


def test_memory_counts_get_integer_ticks_and_the_cache_is_named_in_bytes():
    report = memory_report()
    assert (report["naive_fits"], report["paged_fits"]) == (1, 3)  # a range where 0.5 ticks would come
    fig = drawn(plots.memory_figure(report))
    for ax in fig.axes:
        ticks = visible_ticks(ax.yaxis)
        assert len(ticks) >= 2 and all(t == int(t) for t in ticks), ticks
        top = ax.get_window_extent().y1
        assert all(t.get_window_extent().y1 <= top for t in ax.texts)  # bar labels inside the frame
    left = fig.axes[0].get_title()
    assert "24 blocks x 16 tokens" in left
    assert f"{format_size(report['kv_cache_bytes'], digits=1)} KV cache" in left


@pytest.mark.parametrize(
    "draw",
    [
        lambda kw: plots.offline_figure(throughput_report({"pagedllm": 90.0, "hf": 30.0}), **kw),
        lambda kw: plots.concurrency_figure(serve_runs(), **kw),
        lambda kw: plots.latency_figure(serve_runs(), **kw),
        lambda kw: plots.memory_figure(memory_report(), **kw),
    ],
    ids=["offline", "concurrency", "latency", "memory"],
)
def test_every_title_names_model_dtype_quantization_cpu_and_date(draw):
    text = title(draw(META))
    caps = capabilities()
    for part in (
        "tiny-Q4_1.gguf",
        "fp32",
        "gguf",
        caps.cpu_model,
        caps.tier,
        datetime.date.today().isoformat(),
    ):
        assert part in text, (part, text)


def test_title_falls_back_to_the_report():
    assert "model served" in title(plots.concurrency_figure(serve_runs()))  # run_serve's "model" key
    report = {
        **throughput_report({"pagedllm": 90.0}),
        "model": "m.gguf",
        "dtype": "bf16",
        "quantization": "none",
    }
    text = title(plots.offline_figure(report))
    assert "model m.gguf" in text and "dtype bf16" in text and "quantization none" in text


def test_offline_draws_every_row_of_every_run():
    peers = {
        "hf": 30.0,
        "llama.cpp": 80.0,
        "openvino": 70.0,
        "llama-cpp-python": 10.0,
        "llama-cpp-python-batch": 40.0,
    }
    none = throughput_report({"pagedllm": 60.0, "pagedllm+json": 50.0, **peers})
    gguf = throughput_report({"pagedllm": 90.0, **peers})
    fig = drawn(plots.offline_figure(none, quantization="none", more_runs={"gguf": gguf, "int8": None}))
    assert len(fig.axes) == 2  # a run that did not happen (None) gets no panel
    runs = [("none", none, ["pagedllm", "pagedllm+json", *peers]), ("gguf", gguf, ["pagedllm", *peers])]
    for ax, (q, report, names) in zip(fig.axes, runs):
        assert plots.systems(report) == names
        labels = [t.get_text() for t in ax.get_yticklabels()]
        assert labels == [plots._label(n, q) for n in names]
        assert len(ax.containers[0]) == len(names)
        assert [b.get_width() for b in ax.containers[0]] == pytest.approx(
            [report[n]["output_tokens_per_second"] for n in names]
        )
        assert f"--quantization {q}" in ax.get_title(loc="left")
    assert "pagedllm (gguf)" in labels and "quantization none and gguf" in title(fig)


def test_plan_figure_is_styled_too():
    plan = planner.build_plan(num_layers=4, d_model=64, seq_len=40, max_len=128, memory="1MiB")
    fig = drawn(plan_figure(plan))
    assert "4 layers, kv_width 64" in title(fig) and "fp16" in title(fig)
    assert all(t == int(t) for t in visible_ticks(fig.axes[0].xaxis))  # token slots


def test_every_plot_writes_a_png(tmp_path):
    runs = serve_runs()
    paths = [
        plots.plot_offline(
            throughput_report({"pagedllm": 90.0, "hf": 30.0}), tmp_path / "a" / "offline.png", **META
        ),
        plots.plot_concurrency(runs, tmp_path / "a" / "concurrency.png", **META),
        plots.plot_latency(runs, tmp_path / "a" / "latency.png"),
        plots.plot_memory(memory_report(), tmp_path / "a" / "memory.png"),
    ]
    plot_plan(planner.build_plan(num_layers=4, d_model=64, seq_len=40), str(tmp_path / "plan.png"))
    for path in [*paths, tmp_path / "plan.png"]:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
