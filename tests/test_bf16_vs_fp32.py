"""bf16 (the default compute dtype on AVX-512 BF16 CPUs) against fp32 on the default model.

bf16 keeps 8 significant bits, so where fp32's two best tokens are within a few thousandths of a nat
the rounding can pick the other one. Measured: two of these prompts agree for all 32 tokens;
"Once upon a time, in a small village," diverges at token 16, where fp32 rates " known" -0.9474 and
" a" -0.9523 (margin 0.005) and bf16 picks " a". The test allows a divergence only at such a tie.
"""

from pagedllm import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
NEAR_TIE_NATS = 0.02


def test_bf16_greedy_equals_fp32_for_32_tokens_except_at_near_ties():
    fp32 = LLM(model="default", dtype="fp32", num_kv_blocks=64, show_progress=False)
    ref = fp32.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2), use_tqdm=False
    )
    del fp32
    bf16 = LLM(model="default", dtype="bf16", num_kv_blocks=64, show_progress=False)
    got = bf16.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False
    )
    agreeing = 0
    for prompt, r, g in zip(PROMPTS, ref, got):
        a, b = r.outputs[0].token_ids, g.outputs[0].token_ids
        if a == b:
            agreeing += 1
            continue
        i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        top2 = sorted(r.outputs[0].logprobs[i].items(), key=lambda kv: -kv[1].logprob)[:2]
        margin = top2[0][1].logprob - top2[1][1].logprob
        assert margin < NEAR_TIE_NATS, (
            f"{prompt!r}: bf16 diverges at token {i} where fp32 is sure ({margin:.3f})"
        )
        assert b[i] == top2[1][0], f"{prompt!r}: at token {i} bf16 picks neither of fp32's two best tokens"
    assert agreeing >= 2
