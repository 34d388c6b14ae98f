"""`pagedllm generate` and `pagedllm chat` as a user runs them: real processes, the real default model."""

import subprocess
import sys

PAGEDLLM = [sys.executable, "-m", "pagedllm.entrypoints.cli.main"]


def run(args, stdin=None):
    return subprocess.run(PAGEDLLM + args, input=stdin, capture_output=True, text=True, timeout=300)


def test_generate_greedy_completes_the_prompt():
    r = run(["generate", "The capital of France is", "--max-tokens", "8", "--num-kv-blocks", "64"])
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_chat_repl_answers_and_quits():
    r = run(
        # the dequantized weights: the GGUF-native default's first token is a near tie here (fp32 rates
        # "The" -1.88 and "L" -1.97) that its int8 activations flip, and the answer is no longer Paris
        ["chat", "--temperature", "0", "--max-tokens", "16", "--num-kv-blocks", "64", "--quantization", "none"],
        stdin="What is the capital of France?\n/quit\n",
    )
    assert r.returncode == 0, r.stderr
    assert "assistant>" in r.stdout and "Paris" in r.stdout


def test_bad_input_is_one_line_and_exit_2():
    for args in (
        ["generate", "hi", "--model", "/no/such/model"],
        ["generate", "hi", "--temperature", "-1", "--num-kv-blocks", "64"],
        ["generate", "hi", "--max-tokens", "0", "--num-kv-blocks", "64"],
    ):
        r = run(args)
        assert r.returncode == 2, (args, r.stderr)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip() and "exceeds the KV cache" not in ln]
        assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
