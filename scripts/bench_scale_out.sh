#!/usr/bin/env bash
# Issue 24's figures, every system in one run, repeats interleaved, medians:
#   W32 and single50 at TP=1 on this checkout against BASE (an older checkout, e.g. the commit before the
#   plain-data step: `git worktree add /tmp/base 2a96165`), then TP=2 on this checkout.
# Usage: BASE=/tmp/base REPEATS=3 bash scripts/bench_scale_out.sh      (TP2=0: TP=1 against BASE only)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
REPEATS=${REPEATS:-3}
SHARED=${SHARED:-../shared}
out=$(mktemp -d)
run() {  # name, checkout, workload, extra flags...
  local name=$1 tree=$2 work=$3; shift 3
  PYTHONPATH="$tree" "$PY" -m pagedllm.entrypoints.cli.main bench throughput --dataset "$SHARED/bench/$work.jsonl" \
    --output-json "$out/$name.$work.$i.json" "$@" > /dev/null 2>&1
}
for i in $(seq "$REPEATS"); do
  for work in w32 single50; do
    [ -n "${BASE:-}" ] && run base "$BASE" "$work"
    run tp1 "$PWD" "$work"
    if [ "${TP2:-1}" = 1 ]; then run tp2 "$PWD" "$work" --tensor-parallel-size 2; fi
  done
done
"$PY" - "$out" <<'PY'
import json, statistics, sys
from collections import defaultdict
from pathlib import Path
runs = defaultdict(list)
for f in Path(sys.argv[1]).glob("*.json"):
    name, work, _ = f.name.split(".", 2)
    d = json.loads(f.read_text())
    runs[name, work].append((d["output_tokens_per_second"], d["decode_tokens_per_second"], d["median_ttft_s"]))
for work in ("w32", "single50"):
    base = None
    for name in ("base", "tp1", "tp2"):
        rows = runs.get((name, work))
        if not rows:
            continue
        out, dec, ttft = (statistics.median(r[i] for r in rows) for i in range(3))
        base = base or out
        print(f"{work:9s} {name:5s} output {out:7.1f} tok/s  decode {dec:7.1f} tok/s  TTFT {ttft * 1e3:6.0f} ms  "
              f"({out / base:.2f}x the first row; {len(rows)} runs: {', '.join(f'{r[0]:.1f}' for r in rows)})")
PY
