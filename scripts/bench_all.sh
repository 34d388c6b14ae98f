#!/usr/bin/env bash
# Regenerate docs/benchmarks.md and its plots (docs/img/*.png) in one go: `make bench`.
# The JSON reports land in out/bench/ (ignored by git). Takes about 15-25 minutes on 2 cores.
# Knobs: W32_REPEAT and SINGLE_REPEAT (runs per offline figure, median; default 3), BENCH_THREADS
# (torch threads for ours and HF; default: all cores; 1 is faster on a machine shared with busy
# processes), BENCH_SERVE_PROMPTS, BENCH_OUT, VENV.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
OUT=${BENCH_OUT:-out/bench}
IMG=docs/img
W32_REPEAT=${W32_REPEAT:-3}
SINGLE_REPEAT=${SINGLE_REPEAT:-3}
export OMP_NUM_THREADS=${BENCH_THREADS:-$(nproc)}
W32=../shared/bench/w32.jsonl
SINGLE50=../shared/bench/single50.jsonl
PAGEDLLM="$VENV/bin/pagedllm"

mkdir -p "$OUT" "$IMG"
: > "$OUT/commands.txt"
echo "export OMP_NUM_THREADS=$OMP_NUM_THREADS" >> "$OUT/commands.txt"
run() {  # record the command as a reader would type it, then run it
    echo "pagedllm $*" >> "$OUT/commands.txt"
    "$PAGEDLLM" "$@"
}

"$VENV/bin/python" -m pagedllm.bench.report machine "$OUT/machine.json"
# The peers a user would pick instead, where they are here: llama.cpp's own llama-server (built once by
# scripts/build_llama_server.sh; PAGEDLLM_LLAMA_SERVER points at another) and OpenVINO GenAI.
PEERS=(--compare hf)
LLAMA_SERVER=${PAGEDLLM_LLAMA_SERVER:-${XDG_CACHE_HOME:-$HOME/.cache}/pagedllm/llama.cpp/0.3.36/bin/llama-server}
if [ -x "$LLAMA_SERVER" ]; then
    PEERS+=(--compare llama.cpp)
else
    echo "note: no llama-server at $LLAMA_SERVER: llama.cpp rows are skipped (bash scripts/build_llama_server.sh)"
fi
if "$VENV/bin/python" -c "import openvino_genai" 2>/dev/null; then
    PEERS+=(--compare openvino)
else
    echo "note: openvino-genai is not installed: OpenVINO rows are skipped (pip install openvino-genai)"
fi

# Memory first: it does not run the model, and its figures are exact.
run bench memory --output-json "$OUT/memory.json" --plot-dir "$IMG"

# W32 offline, ours vs HF (same dtype) vs llama.cpp vs OpenVINO, medians of W32_REPEAT runs. Both modes of
# ours, each spelled out: --quantization none here (the GGUF dequantized to the compute dtype), gguf below
# (its blocks served natively). The default, auto, is one or the other depending on the CPU, so leaving it
# unsaid would run the same mode twice on most machines and never the other.
run bench throughput --dataset "$W32" --repeat "$W32_REPEAT" --quantization none "${PEERS[@]}" \
    --output-json "$OUT/w32.json" --plot-dir "$IMG"

# single50: one stream, decode tok/s and TTFT.
run bench throughput --dataset "$SINGLE50" --repeat "$SINGLE_REPEAT" --quantization none "${PEERS[@]}" \
    --output-json "$OUT/single50.json"

# The same two workloads on the default model's own Q4_1 weights, served natively (the C++ 1-4 row kernel
# and the AMX kernel above where the CPU has it), the peers beside them again in the same run. docs/img/
# offline_w32.png draws both W32 runs (pagedllm.bench.report's replot), every row each one measured.
run bench throughput --dataset "$W32" --repeat "$W32_REPEAT" --quantization gguf "${PEERS[@]}" \
    --output-json "$OUT/w32_gguf.json"
run bench throughput --dataset "$SINGLE50" --repeat "$SINGLE_REPEAT" --quantization gguf "${PEERS[@]}" \
    --output-json "$OUT/single50_gguf.json"

# Serving latency at a few concurrencies (the server is started and stopped by --launch).
run bench serve --launch --num-prompts "${BENCH_SERVE_PROMPTS:-16}" --input-len 128 --output-len 32 \
    --max-concurrency 1 4 16 --output-json "$OUT/serve.json" --plot-dir "$IMG" \
    || echo "warning: bench serve reported failed requests (see $OUT/serve.json errors)"

"$VENV/bin/python" -m pagedllm.bench.report machine "$OUT/machine_end.json"
"$VENV/bin/python" -m pagedllm.bench.report render "$OUT" docs/benchmarks.md
echo "wrote docs/benchmarks.md and $IMG/*.png"
