"""llama-cpp-python (llama.cpp's Python binding, in process) on the same GGUF file, greedy, exactly
max_tokens each (EOS ignored): `--compare llama-cpp-python`. `--compare llama.cpp` is llama.cpp's own
llama-server instead (llamacpp_server.py).

Two ways people run the binding:
- "llama-cpp-python": one request at a time through the high-level `Llama.generate` (what most scripts do);
- "llama-cpp-python-batch": every prompt as its own sequence of one context, decoded together with the
  low-level llama_batch API (what llama-server does with parallel slots), when that API is there.

Optional: nothing is installed for it (`pip install llama-cpp-python` compiles llama.cpp with cmake).
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

from tqdm.auto import tqdm

from pagedllm.bench.dataset import BenchPrompt, prompt_token_ids

INSTALL_HINT = (
    "pip install llama-cpp-python  (compiles llama.cpp from source: needs cmake and a C++ compiler)"
)


def unavailable_reason(model_path: Path) -> str | None:
    """Why llama-cpp-python cannot run here, or None when it can."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return f"llama-cpp-python is not installed; to compare with it: {INSTALL_HINT}"
    if model_path.suffix != ".gguf":
        return f"llama-cpp-python needs a GGUF file; {model_path} is not one"
    return _probe(model_path)


_PROBE = """
import sys, llama_cpp
llm = llama_cpp.Llama(sys.argv[1], n_ctx=64, n_threads=1, verbose=False)
next(iter(llm.generate([1, 2, 3], top_k=1, temp=0.0)))
"""


def _probe(model_path: Path) -> str | None:
    """Generate one token in a child process first: a broken build crashes there, not in the benchmark."""
    import subprocess
    import sys

    try:
        r = subprocess.run(
            [sys.executable, "-c", _PROBE, str(model_path)], capture_output=True, text=True, timeout=300
        )
    except subprocess.TimeoutExpired:
        return "llama-cpp-python did not generate one token within 300 s"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no message"])[-1]
        return f"llama-cpp-python is installed but fails on this model (exit {r.returncode}: {last}); reinstall it"
    return None


def run_llamacpp(model_path: Path, prompts: list[BenchPrompt], n_threads: int = 2, repeat: int = 1) -> dict:
    """{"llama-cpp-python": [run, ...], "llama-cpp-python-batch": [run, ...]}; each run has elapsed and
    token counts."""
    import llama_cpp

    ids = prompt_token_ids(prompts, model_path)
    n_ctx = max(len(x) + p.max_tokens for x, p in zip(ids, prompts)) + 16
    llm = llama_cpp.Llama(
        str(model_path),
        n_ctx=n_ctx,
        n_batch=512,
        n_threads=n_threads,
        n_threads_batch=n_threads,
        verbose=False,
    )
    _sequential(llm, [ids[0]], [2])  # warm-up
    out = {
        "llama-cpp-python": [_sequential(llm, ids, [p.max_tokens for p in prompts]) for _ in range(repeat)]
    }
    del llm
    if len(prompts) > 1:
        try:
            out["llama-cpp-python-batch"] = [
                _batched(model_path, ids, prompts, n_threads) for _ in range(repeat)
            ]
        except (AttributeError, RuntimeError) as e:  # the low-level API moves between versions
            print(f"llama-cpp-python-batch: skipped: {type(e).__name__}: {e}")
    return out


def _sequential(llm, ids: list[list[int]], max_tokens: list[int]) -> dict:
    ttfts = []
    bar = tqdm(total=len(ids), desc="llama-cpp-python (one at a time)", unit="req", disable=len(ids) < 2)
    start = time.perf_counter()
    for prompt, n in zip(ids, max_tokens):
        llm.reset()  # no prefix reuse from the previous prompt
        t0 = time.perf_counter()
        # generate() yields tokens until we stop: EOS is only checked by create_completion, so it is ignored
        for i, _ in enumerate(llm.generate(prompt, top_k=1, temp=0.0, reset=True)):
            if i == 0:
                ttfts.append(time.perf_counter() - t0)
            if i + 1 == n:
                break
        bar.update(1)
    elapsed = time.perf_counter() - start
    bar.close()
    out_tokens = sum(max_tokens)
    run = {
        "elapsed_time": elapsed,
        "num_requests": len(ids),
        "prompt_tokens": sum(map(len, ids)),
        "output_tokens": out_tokens,
        "median_ttft_s": sorted(ttfts)[len(ttfts) // 2],
    }
    if len(ids) == 1:
        run["decode_tokens_per_second"] = (out_tokens - 1) / (elapsed - ttfts[0])
    return run


def _batched(model_path: Path, ids: list[list[int]], prompts: list[BenchPrompt], n_threads: int) -> dict:
    """All prompts as parallel sequences of one context: prefill each, then one decode batch per step."""
    import llama_cpp as lc
    import numpy as np

    n_seq = len(ids)
    per_seq = max(len(x) + p.max_tokens for x, p in zip(ids, prompts)) + 16
    mparams = lc.llama_model_default_params()
    model = lc.llama_model_load_from_file(str(model_path).encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {model_path}")
    cparams = lc.llama_context_default_params()
    cparams.n_ctx = per_seq * n_seq
    cparams.n_batch = max(512, n_seq)
    cparams.n_ubatch = max(512, n_seq)
    cparams.n_seq_max = n_seq
    cparams.n_threads = cparams.n_threads_batch = n_threads
    ctx = lc.llama_init_from_model(model, cparams)
    if not ctx:
        lc.llama_model_free(model)
        raise RuntimeError("llama.cpp could not create a context")
    vocab = lc.llama_model_get_vocab(model)
    n_vocab = lc.llama_vocab_n_tokens(vocab)
    batch = lc.llama_batch_init(max(512, n_seq), 0, 1)

    def decode(items: list[tuple[int, int, int, bool]]) -> None:
        """items: (token, position, sequence, wants logits)."""
        batch.n_tokens = len(items)
        for i, (tok, pos, seq, logits) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax(i: int) -> int:
        ptr = lc.llama_get_logits_ith(ctx, i)
        return int(
            np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (n_vocab,)).argmax()
        )

    try:
        want = [p.max_tokens for p in prompts]
        done = [0] * n_seq
        bar = tqdm(total=sum(want), desc=f"llama-cpp-python (batch of {n_seq})", unit="tok")
        start = time.perf_counter()
        nxt = []
        for s, x in enumerate(ids):  # prefill, 512 tokens a call; logits of the last token only
            for c in range(0, len(x), 512):
                part = x[c : c + 512]
                decode([(t, c + j, s, c + j == len(x) - 1) for j, t in enumerate(part)])
            nxt.append(argmax(len(x) - 1 - (len(x) - 1) // 512 * 512))
            done[s] = 1
            bar.update(1)
        pos = [len(x) for x in ids]
        while True:
            live = [s for s in range(n_seq) if done[s] < want[s]]
            if not live:
                break
            decode([(nxt[s], pos[s], s, True) for s in live])
            for i, s in enumerate(live):
                nxt[s] = argmax(i)
                pos[s] += 1
                done[s] += 1
            bar.update(len(live))
        elapsed = time.perf_counter() - start
        bar.close()
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
        lc.llama_model_free(model)
    return {
        "elapsed_time": elapsed,
        "num_requests": n_seq,
        "prompt_tokens": sum(map(len, ids)),
        "output_tokens": sum(want),
    }
