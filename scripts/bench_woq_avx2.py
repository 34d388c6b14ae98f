"""Benchmark the AVX2 weight-only matmul (quantization/avx2.py) on the default model's real layers.

The set is one decode step's linears of SmolLM2-135M (Q4_1 + Q8_0 GGUF): 30 x (qkv 576->960, o 576->576,
gate_up 576->3072, down 1536->576) + lm_head 576->49152, 121 calls. For each M:
    cold  the 121 calls in order, as a forward pass makes them (98 MB of codes: every layer from DRAM)
    hot   each of the 5 shapes called back to back (its weights in cache), times its count
against F.linear on the dequantized float32 weight (torch / MKL), with the layout's bytes / the measured
memory read speed as the bound for M = 1. Old and new alternate in one process; medians.

    python scripts/bench_woq_avx2.py [--rows 1,8,32,256,1024] [--reps 7] [--threads 2] [--cpu-time] [--min]
                                     [--check]
--check first compares every real layer with the float32 reference (relative Frobenius error). At M=1 the
float32-activation gemv (csrc/woq_avx2.h panel_fp32) is timed too.
"""

from __future__ import annotations

import argparse
import statistics
import time

import gguf
import torch
import torch.nn.functional as F

from pagedllm import ops
from pagedllm.model.loader import resolve_model_path
from pagedllm.quantization import avx2
from pagedllm.quantization.gguf_native import decode_blocks

GROUP = 32


def decoded(reader: gguf.GGUFReader, name: str):
    t = next(t for t in reader.tensors if t.name == name)
    rows, cols = int(t.shape[1]), int(t.shape[0])
    return decode_blocks(t.tensor_type.name, t.data, (rows, cols))


def model_layers() -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, int]]:
    """(kind, codes, scales, mins, bits) of the 121 linears of one decode step, in call order."""
    reader = gguf.GGUFReader(resolve_model_path("default"))
    n_layers = 1 + max(int(t.name.split(".")[1]) for t in reader.tensors if t.name.startswith("blk."))
    layers = []

    def fused(names: list[str]):
        parts = [decoded(reader, n) for n in names]
        return tuple(torch.cat([p[i] for p in parts]) for i in range(3)) + (parts[0][3],)

    for i in range(n_layers):
        b = f"blk.{i}."
        layers.append(("qkv", *fused([b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"])))
        layers.append(("o", *decoded(reader, b + "attn_output.weight")))
        layers.append(("gate_up", *fused([b + "ffn_gate.weight", b + "ffn_up.weight"])))
        layers.append(("down", *decoded(reader, b + "ffn_down.weight")))
    layers.append(("lm_head", *decoded(reader, "token_embd.weight")))
    return layers


def dequantize(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    n, k = codes.shape
    g = scales.shape[1]
    q = codes.view(n, g, k // g).float()
    return (q * scales[:, :, None] + mins[:, :, None]).view(n, k)


def layout_bytes(layout: tuple[torch.Tensor, ...]) -> int:
    return sum(t.numel() * t.element_size() for t in layout)


def read_speed_gbs() -> float:
    """Memory read speed: torch.sum over 512 MB, median of five (GB/s)."""
    a = torch.ones(128 * 2**20)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        a.sum()
        times.append(time.perf_counter() - t)
    return a.numel() * 4 / statistics.median(times) / 1e9


def check(layers, packed) -> float:
    worst = 0.0
    for (_, codes, s, m, bits), lay in zip(layers, packed):
        n, k = codes.shape
        x = torch.randn(4, k)
        ref = x @ dequantize(codes, s, m).T
        y = avx2.matmul(x, lay, None, bits, GROUP, n)
        worst = max(worst, ((y - ref).norm() / ref.norm()).item())
    return worst


def seconds(fn, cpu: bool) -> float:
    """One call's time: wall clock, or with --cpu-time this thread's CPU time (a loaded machine's other
    tenants then cost nothing but cache; only meaningful with one thread)."""
    clock = time.thread_time if cpu else time.perf_counter
    t = clock()
    fn()
    return clock() - t


def calls(kind: str, meta, packed, weights, xs, which: list[int]):
    """The calls of `which` layers, as one function: ours, fp32 F.linear, or (M=1) the fp32-activation gemv."""
    ext = ops.kernel("quantized_linear", "woq_avx2")
    if kind == "ours":
        return lambda: [
            avx2.matmul(xs[meta[i][1]], packed[i], None, meta[i][2], GROUP, meta[i][0]) for i in which
        ]
    if kind == "gemv_fp32":
        return lambda: [
            ext.gemv_fp32(xs[meta[i][1]], *packed[i], None, meta[i][2], GROUP, meta[i][0]) for i in which
        ]
    return lambda: [F.linear(xs[meta[i][1]], weights[i]) for i in which]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,32,256,1024")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--cpu-time", action="store_true", help="time by this thread's CPU time (use --threads 1)"
    )
    ap.add_argument("--check", action="store_true")
    ap.add_argument(
        "--min", action="store_true", help="the fastest rep instead of the median (a loaded machine)"
    )
    args = ap.parse_args()
    pick = min if args.min else statistics.median
    if ops.kernel("quantized_linear", "woq_avx2") is None:
        raise SystemExit(
            "the AVX2 kernel is not available on this machine (op table: quantized_linear="
            f"{ops.backend('quantized_linear')})"
        )
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    layers = model_layers()
    packed = [avx2.pack(c, s, m, bits) for _, c, s, m, bits in layers]
    weights = [dequantize(c, s, m) for _, c, s, m, _ in layers]
    meta = [(c.shape[0], c.shape[1], bits) for _, c, _, _, bits in layers]
    total_bytes = sum(layout_bytes(p) for p in packed)
    macs = sum(n * k for n, k, _ in meta)
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    print(
        f"threads {args.threads}, {'CPU' if args.cpu_time else 'wall'} time, {'min' if args.min else 'median'} "
        f"of {args.reps}, load average {load}; "
        f"{len(layers)} calls, layout {total_bytes / 1e6:.1f} MB"
    )
    if args.check:
        print(f"every real layer vs the float32 reference: worst relative error {check(layers, packed):.2e}")
    gbs = read_speed_gbs()
    print(
        f"memory read speed {gbs:.1f} GB/s -> M=1 bound {total_bytes / gbs * 1e3 / 1e9:.2f} ms (at 20 GB/s "
        f"{total_bytes / 20e9 * 1e3:.2f} ms)"
    )
    kinds: dict[str, list[int]] = {}
    for i, (kind, *_rest) in enumerate(layers):
        kinds.setdefault(kind, []).append(i)
    every = list(range(len(layers)))

    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k) for k in {k for _, k, _ in meta}}
        reps = args.reps if rows <= 256 else max(3, args.reps // 2)
        names = ["ours", "ref"] + (["gemv_fp32"] if rows == 1 else [])
        # cold: the 121 calls in order (98 MB: each layer comes from DRAM); alternated, medians
        fns = {name: calls(name, meta, packed, weights, xs, every) for name in names}
        for fn in fns.values():
            fn()  # warm up
        cold = {name: [] for name in names}
        for _ in range(reps):
            for name in names:
                cold[name].append(seconds(fns[name], args.cpu_time))
        cold = {name: pick(t) for name, t in cold.items()}
        # hot: one layer of each kind called back to back, times its count
        hot = dict.fromkeys(names, 0.0)
        for idx in kinds.values():
            n, k, _ = meta[idx[0]]
            inner = max(1, int(2e7 // (rows * n * k)))
            fns = {name: calls(name, meta, packed, weights, xs, [idx[0]] * inner) for name in names}
            times = {name: [] for name in names}
            for _ in range(reps):
                for name in names:
                    times[name].append(seconds(fns[name], args.cpu_time))
            for name in names:
                hot[name] += pick(times[name]) / inner * len(idx)
        flops = 2 * rows * macs
        for label, t in (("cold", cold), ("hot ", hot)):
            o, r = t["ours"], t["ref"]
            line = (
                f"M={rows:5d} {label}: avx2 {o * 1e3:8.2f} ms {flops / o / 1e9:6.1f} GFLOP/s "
                f"{total_bytes / o / 1e9:5.1f} GB/s | fp32 F.linear {r * 1e3:8.2f} ms {flops / r / 1e9:6.1f} "
                f"GFLOP/s | x{r / o:5.2f}"
            )
            if rows == 1:
                line += f" | fp32-act gemv {t['gemv_fp32'] * 1e3:.2f} ms | vs bytes/20 GB/s {o / (total_bytes / 20e9):.2f}x"
            print(line, flush=True)


if __name__ == "__main__":
    main()
