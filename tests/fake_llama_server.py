"""A stand-in for llama.cpp's llama-server, for tests: the two endpoints pagedllm's bench uses.

Takes llama-server's flags (only --host, --port and -np matter), answers GET /health with 503 for the
first poll (as while a model loads) and 200 after, and POST /completion with a stream shaped like the
real one: a first chunk without a token, one chunk a token, a final chunk with the counts. Its tokens
are prompt[-1] + 1, + 2, ...; it writes its pid and each request body to the file in FAKE_LLAMA_LOG.
"""

from __future__ import annotations

import argparse
import json
import os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOG = os.environ.get("FAKE_LLAMA_LOG")
_health_polls = 0


def _log(record: dict) -> None:
    if LOG:
        with open(LOG, "a") as f:
            f.write(json.dumps(record) + "\n")


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        global _health_polls
        if self.path != "/health":
            self.send_error(404)
            return
        _health_polls += 1
        ok = _health_polls > 1
        body = json.dumps({"status": "ok"} if ok else {"error": {"message": "Loading model"}}).encode()
        self.send_response(200 if ok else 503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        if self.path != "/completion":
            self.send_error(404)
            return
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _log({"body": req})
        prompt, n = req["prompt"], req["n_predict"]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()  # HTTP/1.0: the body ends when the connection closes

        def send(chunk: dict) -> None:
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()

        send({"content": "", "tokens": [], "stop": False})
        for i in range(n):
            send({"content": "x", "tokens": [prompt[-1] + 1 + i], "stop": False})
        send(
            {
                "content": "",
                "tokens": [],
                "stop": True,
                "tokens_predicted": n,
                "tokens_evaluated": len(prompt),
                "stop_type": "limit",
            }
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("-np", type=int, default=1)
    args, _ = p.parse_known_args()
    _log({"pid": os.getpid(), "slots": args.np})
    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
