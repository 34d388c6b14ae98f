"""OpenVINO GenAI as its users run it on a CPU: `ContinuousBatchingPipeline` reading the GGUF file directly.

`--compare openvino`: the pipeline with its default scheduler (paged KV cache, dynamic split-fuse) but
no prefix caching (every run cold, like ours), INFERENCE_NUM_THREADS threads; every prompt is handed to
one `generate` call as our tokenizer's token ids (so no chat template is applied, and no re-tokenizing),
greedy, exactly max_new_tokens (ignore_eos). For one prompt a streamer notes when the first token
arrives, for TTFT and the decode tokens/s after it. Output token counts are checked.

Optional: `pip install openvino-genai` (or `pip install 'pagedllm[bench]'`).
"""

from __future__ import annotations

import time
from pathlib import Path

from pagedllm.bench.dataset import BenchPrompt, prompt_token_ids
from pagedllm.bench.roofline import gguf_bytes_per_token

INSTALL_HINT = "pip install openvino-genai  (or pip install 'pagedllm[bench]')"


def unavailable_reason(model_path: Path) -> str | None:
    """Why OpenVINO GenAI cannot run here, or None when it can."""
    try:
        import openvino_genai  # noqa: F401
    except ImportError:
        return f"openvino-genai is not installed; to compare with it: {INSTALL_HINT}"
    if model_path.suffix != ".gguf":
        return f"OpenVINO GenAI is run on the GGUF file here; {model_path} is not one"
    return None


def generation_config(max_new_tokens: int):
    import openvino_genai as ov_genai

    cfg = ov_genai.GenerationConfig()
    cfg.max_new_tokens = max_new_tokens
    cfg.ignore_eos = True
    cfg.do_sample = False  # greedy
    cfg.num_beams = 1
    cfg.apply_chat_template = False  # token ids go in as they are; said here for string prompts too
    return cfg


def _first_token_streamer():
    """A streamer noting when the first generated token(s) arrive (one request only: OpenVINO streams
    a single request of a continuous-batching generate)."""
    import openvino_genai as ov_genai

    class FirstToken(ov_genai.StreamerBase):
        def __init__(self) -> None:
            super().__init__()
            self.first_token_at: float | None = None

        def write(self, token):
            if self.first_token_at is None:
                self.first_token_at = time.perf_counter()
            return ov_genai.StreamingStatus.RUNNING

        def end(self) -> None:
            pass

    return FirstToken()


def run_openvino(
    model_path: Path, prompts: list[BenchPrompt], threads: int = 2, repeat: int = 1
) -> list[dict]:
    """`repeat` runs of the whole workload on one pipeline; one dict of counts per run."""
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    ids = prompt_token_ids(prompts, model_path)
    sched = ov_genai.SchedulerConfig()
    sched.enable_prefix_caching = False
    sched.max_num_seqs = max(sched.max_num_seqs, len(ids))  # all in flight at once, as for ours
    load_start = time.perf_counter()
    pipe = ov_genai.ContinuousBatchingPipeline(
        str(model_path), sched, "CPU", {"INFERENCE_NUM_THREADS": threads}
    )
    load_time_s = time.perf_counter() - load_start  # start to ready: the GGUF read and the model compiled
    tensors = [ov.Tensor(np.array([x], dtype=np.int64)) for x in ids]
    configs = [generation_config(p.max_tokens) for p in prompts]
    pipe.generate(tensors[:2], [generation_config(2)] * len(tensors[:2]))  # warm-up: compiles, not timed
    runs = []
    for _ in range(repeat):
        streamer = _first_token_streamer() if len(ids) == 1 else None
        start = time.perf_counter()
        results = pipe.generate(tensors, configs, streamer)
        elapsed = time.perf_counter() - start
        runs.append(_run(results, ids, [p.max_tokens for p in prompts], start, elapsed, streamer))
    # OpenVINO turns the GGUF's blocks into its own compressed weights (4 or 8-bit codes, a scale and zero
    # point a group), not read back here: the file's bytes per token stand for them, an approximation
    extra = {"load_time_s": load_time_s, "bytes_per_token": gguf_bytes_per_token(model_path)}
    return [run | extra for run in runs]


def _run(results, ids: list[list[int]], asked: list[int], start: float, elapsed: float, streamer) -> dict:
    got = [len(r.m_generation_ids[0]) for r in results]
    if got != asked:
        raise RuntimeError(f"OpenVINO GenAI generated {got} tokens where {asked} were asked")
    out_tokens = sum(got)
    run = {
        "elapsed_time": elapsed,
        "num_requests": len(ids),
        "prompt_tokens": sum(map(len, ids)),
        "output_tokens": out_tokens,
    }
    # the pipeline's own TTFT (ms), beside ours: a cross-check of the streamer's figure
    ttfts = sorted(r.perf_metrics.get_ttft().mean / 1000 for r in results)
    run["openvino_reported_ttft_s"] = ttfts[len(ttfts) // 2]
    if streamer is not None and streamer.first_token_at is not None:
        ttft = streamer.first_token_at - start
        run["median_ttft_s"] = ttft
        run["decode_tokens_per_second"] = (out_tokens - 1) / (elapsed - ttft)
    return run
