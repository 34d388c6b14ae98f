"""Start `pagedllm serve` as a child process on a free loopback port, for `bench serve --launch`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def launched_server(serve_args: list[str], startup_timeout_s: float = 600.0) -> Iterator[str]:
    """Yield the base URL of a fresh `pagedllm serve` with serve_args; stop it (SIGINT, then kill) after.

    Its log goes to a temporary file, shown when it fails to start.
    """
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "serve", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--log-level", "warning", *serve_args]
    log = tempfile.NamedTemporaryFile("w+", prefix="pagedllm-serve-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    base_url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(base_url, proc, startup_timeout_s, log.name)
        yield base_url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # graceful: the server drains and exits
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
        os.unlink(log.name)


def _wait_healthy(base_url: str, proc: subprocess.Popen, timeout_s: float, log_path: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(log_path) as f:
                tail = f.read()[-2000:]
            raise RuntimeError(f"`pagedllm serve` exited with {proc.returncode} during start-up:\n{tail}")
        try:
            if httpx.get(base_url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"`pagedllm serve` did not become healthy within {timeout_s:.0f}s")
