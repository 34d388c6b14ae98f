"""The README's picture of /kv under the W32 workload (docs/img/kv_page.png), taken as the page tests take theirs.

    .venv/bin/python scripts/kv_page_screenshot.py [--out docs/img/kv_page.png] [--dataset ../shared/bench/w32.jsonl]

Starts the real server (default model, its default 1 GiB KV cache, one torch thread: the other core draws
the page; --kv-debug-routes, to hold the engine still for the picture), opens /kv in headless Chromium
(tests/browser.py), runs `pagedllm bench serve` with the dataset through /v1/chat/completions (the chat
template's system prompt is a prefix every request shares), waits until the page shows every request
running and decoding, holds the engine, selects one request and hovers a shared block, takes the
screenshot, and lets the benchmark finish.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from browser import chromium  # noqa: E402
from test_server import API_KEY, running_server  # noqa: E402

WAIT_MS = 300_000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "docs/img/kv_page.png"))
    parser.add_argument("--dataset", default=str(REPO.parent / "shared/bench/w32.jsonl"))
    args = parser.parse_args()
    num_requests = sum(1 for line in Path(args.dataset).read_text().splitlines() if line.strip())
    log = Path(tempfile.mkdtemp(prefix="kv-screenshot-")) / "server.log"
    with running_server(log, "--threads", "1", "--kv-debug-routes") as server, chromium((1400, 1300)) as browser:
        page = browser.new_page()
        page.goto(server.url(f"/kv?api_key={API_KEY}"))
        bench = subprocess.Popen(
            [
                sys.executable, "-m", "pagedllm.entrypoints.cli.main", "bench", "serve",
                "--dataset", args.dataset, "--base-url", server.base_url, "--api-key", API_KEY,
                "--endpoint", "/v1/chat/completions", "--served-model-name", server.model,
                "--max-concurrency", str(num_requests),
            ],
            cwd=REPO, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            page.wait_for_function(
                """n => [...document.querySelectorAll('#rows tr[data-status=running]')]
                         .filter(r => Number(r.dataset.numComputed) > Number(r.dataset.numTokens) - 2 &&
                                      Number(r.dataset.numTokens) > 60).length >= n""",
                arg=num_requests,
                timeout=WAIT_MS,
            )
            held = httpx.post(server.url("/kv/debug/hold?hold=true"), headers=server.headers, timeout=30).json()
            page.wait_for_function(
                "seq => Number(document.querySelector('#status').dataset.seq) >= seq", arg=held["seq"]
            )
            page.click("#rows tr[data-request-id]:nth-child(3)")
            shared = page.get_attribute("#cells [data-state=shared]", "data-block-id")
            point = page.evaluate("id => window.kvPage.cellCenter(id)", int(shared))
            page.mouse.move(point["x"], point["y"])
            page.wait_for_selector("#tip[data-loaded=true]")
            page.screenshot(path=args.out, full_page=False)
            print(f"wrote {args.out}")
        finally:
            httpx.post(server.url("/kv/debug/hold?hold=false"), headers=server.headers, timeout=30)
            bench.wait(timeout=600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
