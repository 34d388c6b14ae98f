"""bf16 linears per call: oneDNN's prepacked kernel against the AMX tile order (model/layers/packed_linear.py).

.venv/bin/python scripts/bench_linears.py

For each of the default model's linear shapes, 30 different weights (a model's worth, so they come from
L3 / DRAM as in a step) are multiplied back to back with 1-2,048 rows, the two layouts alternated; each
median is printed per call with the ratio.
"""

import statistics
import time

import torch

import pagedllm.model.layers.packed_linear as packed_linear
from pagedllm.model.layers.packed_linear import PackedLinear

if not packed_linear.tile_order_fits(torch.zeros(16, 32, dtype=torch.bfloat16)):
    raise SystemExit("no AMX here (or no compiler): no tile order to compare")
torch.manual_seed(0)
for n, k in ((960, 576), (576, 576), (3072, 576), (576, 1536)):
    weights = [torch.randn(n, k).bfloat16() for _ in range(30)]
    tiles = [PackedLinear(w, None, layout="amx") for w in weights]
    onednn = [PackedLinear(w, None, layout="onednn") for w in weights]
    for rows in (1, 4, 32, 50, 256, 2048):
        x = torch.randn(rows, k).bfloat16()
        times: dict[str, list[float]] = {"oneDNN": [], "tiles": []}
        for _ in range(5 if rows < 256 else 3):
            for name, layers in (("oneDNN", onednn), ("tiles", tiles)):
                start = time.perf_counter()
                for layer in layers:
                    layer(x)
                times[name].append((time.perf_counter() - start) / len(layers))
        a, b = statistics.median(times["oneDNN"]), statistics.median(times["tiles"])
        print(f"{n}x{k}, {rows:4d} rows: oneDNN {a * 1e6:6.0f} us, tiles {b * 1e6:6.0f} us -> {a / b:.2f}x")
