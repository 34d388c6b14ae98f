"""Tokens/s of a random-weight mixture of experts against a dense model of the same active parameter count,
in one process (not a test).

    .venv/bin/python scripts/bench_moe.py                    # engine defaults (--dtype auto)
    .venv/bin/python scripts/bench_moe.py --dtype fp32 --repeats 7

Two checkpoints written by transformers with the same attention, vocabulary and depth: a Mixtral with
8 experts of width F and top-2 routing, and a Llama whose MLP is 2F wide, so a token runs the same number of
weights through both (the MoE's router adds hidden x 8 a layer). Each is loaded once as an `LLM`; then, in
alternating order, each generates greedily for a single stream (one 32-token prompt, 64 new tokens) and a
batch (16 prompts, 32 new tokens each); the tokens/s figures are medians over the repeats, and the ratio is
MoE / dense. The MoE holds 4x the MLP weights of the dense model, and the dense one may run the fused C++
decoder stack where the MoE runs the per-op layer loop (printed), so that ratio is what a user sees; the
dense model is also run with its stack turned off ("dense-loop"), which leaves the MoE block's own cost.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pagedllm import LLM, SamplingParams

SHAPE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
             max_position_embeddings=1024, tie_word_embeddings=False)  # fmt: skip
EXPERT_WIDTH, NUM_EXPERTS, TOP_K = 768, 8, 2


def _tokenizer():
    from pagedllm.model.loader import default_model_path
    from pagedllm.model.tokenizer import Tokenizer

    return Tokenizer.from_checkpoint(default_model_path()).hf


def write_checkpoints(folder: Path) -> dict[str, Path]:
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    tok = _tokenizer()
    common = dict(SHAPE, vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    models = {
        "moe": MixtralForCausalLM(
            MixtralConfig(
                **common,
                intermediate_size=EXPERT_WIDTH,
                num_local_experts=NUM_EXPERTS,
                num_experts_per_tok=TOP_K,
            )  # fmt: skip
        ),
        "dense": LlamaForCausalLM(LlamaConfig(**common, intermediate_size=TOP_K * EXPERT_WIDTH)),
    }
    paths = {}
    for name, model in models.items():
        with torch.no_grad():  # router logits of O(1), so the tokens spread over the experts
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0, p.shape[-1] ** -0.5)
        paths[name] = folder / name
        model.save_pretrained(paths[name])
        tok.save_pretrained(paths[name])
    return paths


def weight_counts(llm: LLM) -> tuple[int, int]:
    """(weights one token runs through, all weights), the embedding lookup aside: the planner's count,
    less the experts a MoE layer does not choose."""
    from pagedllm.planner.memory import param_count

    cfg = llm.llm_engine.model_config
    total = param_count(cfg) - cfg.vocab_size * cfg.hidden_size
    idle = (cfg.num_experts - cfg.num_experts_per_tok) * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    return total - moe_layers * idle, total


def run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_checkpoints(Path(tmp))
        llms = {
            n: LLM(model=str(p), dtype=args.dtype, num_kv_blocks=512, show_progress=False)
            for n, p in (*paths.items(), ("dense-loop", paths["dense"]))
        }
        llms["dense-loop"].llm_engine.model.decode_stack = None  # the same per-op layer loop as the MoE's
        vocab = llms["moe"].llm_engine.model_config.vocab_size
        workloads = {
            "single stream (1 x 64 tokens)": ([torch.randint(3, vocab, (32,), generator=g).tolist()], 64),
            "batch (16 x 32 tokens)": (
                [torch.randint(3, vocab, (32,), generator=g).tolist() for _ in range(16)],
                32,
            ),
        }
        for name, llm in llms.items():
            model = llm.llm_engine.model
            stack = "fused C++ decoder stack" if model.decode_stack is not None else "per-op layer loop"
            active, total = weight_counts(llm)
            weights = f"{active / 1e6:.1f}M weights a token, {total / 1e6:.1f}M in all (embedding aside)"
            print(f"{name}: {weights}, {stack}")
            for prompts, _ in workloads.values():
                run(llm, prompts, 4)  # warm-up
        times: dict[tuple[str, str], list[float]] = {}
        for r in range(args.repeats):
            order = list(llms)[r % 3 :] + list(llms)[: r % 3]  # each first in turn
            for work, (prompts, n) in workloads.items():
                for name in order:
                    times.setdefault((work, name), []).append(run(llms[name], prompts, n))
    print(
        f"dtype {args.dtype}, {torch.get_num_threads()} threads, medians of {args.repeats} interleaved runs"
    )
    for work in workloads:
        moe, dense, loop = (statistics.median(times[(work, n)]) for n in llms)
        print(f"  {work}: MoE {moe:.1f} tok/s, dense {dense:.1f} tok/s (MoE / dense {moe / dense:.2f}), "
              f"dense-loop {loop:.1f} tok/s (MoE / dense-loop {moe / loop:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
