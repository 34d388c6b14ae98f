"""The C++ decode stack of this checkout against those of other git revisions or source trees, in one process.

.venv/bin/python scripts/ab_decode_stack.py HEAD~1          # 120 rounds
.venv/bin/python scripts/ab_decode_stack.py 07a5e56 200
.venv/bin/python scripts/ab_decode_stack.py /tmp/variant_a /tmp/variant_b HEAD 100
PAGEDLLM_PROFILE_MODEL=/tmp/models/llama1b-q4_k_m.gguf AB_SEQS=1 .venv/bin/python scripts/ab_decode_stack.py /tmp/v 60
    (another model, its GGUF blocks as they are; AB_SEQS sequences a step instead of W32's 32)

Runs W32 (GGUF native) to its 60th model call, keeps that decode step's inputs (32 sequences, contexts
~80-350), then times the stack's forward over them: this checkout's stack and each other one (a
revision's C++ sources taken with `git archive`, or a directory holding a `pagedllm/` tree, such as a
copy of this checkout with a kernel changed; each built under its own extension name over the same
weights), in a shuffled order every round. Prints each one's median in ms. All stacks must give the
same output bit for bit (checked first; AB_CLOSE=1 prints how far they differ instead, for a change of
arithmetic). This machine's speed swings by 20% within minutes, so separate
runs of old and new code cannot show a 2% change; alternating them in one process can.
"""

import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

import torch

import pagedllm.model.decode_stack as decode_stack
from pagedllm import LLM, SamplingParams, ops
from pagedllm.cpp_extension import load_cpp_extension

ROOT = Path(__file__).resolve().parents[1]
W32 = ROOT.parent / "shared" / "bench" / "w32.jsonl"


def source_tree(rev: str) -> tuple[Path, str]:
    """A directory holding `rev`'s pagedllm/ tree, and an extension name for its stack."""
    if (Path(rev) / "pagedllm").is_dir():
        tree = Path(rev).resolve()
        return tree, "ab_stack_" + hashlib.sha1(str(tree).encode()).hexdigest()[:10]
    tree = Path(tempfile.mkdtemp(prefix="ab_stack_"))
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "pagedllm"], capture_output=True, check=True
    )
    tarfile.open(fileobj=BytesIO(archive.stdout)).extractall(tree, filter="data")
    sha = subprocess.check_output(["git", "-C", str(ROOT), "rev-parse", "--short", rev], text=True).strip()
    return tree, "ab_stack_" + sha


def stack_of_revision(rev: str, model):
    """Build the decode stack of `rev` (a git revision or a source tree) over `model`'s weights."""
    tree, name = source_tree(rev)
    ext = load_cpp_extension(name, tree / "pagedllm" / "model" / "csrc" / "decode_stack.cpp")
    current = ops.kernel
    ops.kernel = lambda op, name=None: ext if op == "decoder_stack" else current(op, name)
    try:
        return decode_stack.build_decode_stack(model)
    finally:
        ops.kernel = current


def main() -> None:
    args = sys.argv[1:]
    rounds = int(args.pop()) if len(args) > 1 and args[-1].isdigit() else 120
    model_path = os.environ.get("PAGEDLLM_PROFILE_MODEL")
    seqs = int(os.environ.get("AB_SEQS", "32"))
    kwargs = {"model": model_path, "kv_cache_memory": "1GiB"} if model_path else {"quantization": "gguf"}
    llm = LLM(show_progress=False, **kwargs)
    model = llm.llm_engine.model
    stacks = {"this checkout": model.decode_stack} | {rev: stack_of_revision(rev, model) for rev in args}

    captured = []
    calls = 0
    inner = model.decode_stack

    class Capture:  # stands in for the stack during the W32 run, keeping the 60th call's arguments
        def forward(self, *args):
            nonlocal calls
            calls += 1
            if calls == 60:
                captured.append(tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args))
            return inner.forward(*args)

    model.decode_stack = Capture()
    prompts = [json.loads(line)["prompt"] for line in W32.read_text().splitlines()]
    steps = 60 if seqs == 32 else 61  # W32's prefill takes two calls; one prompt's, one
    llm.generate(
        prompts[:seqs], SamplingParams(temperature=0, max_tokens=steps + 10, ignore_eos=True), use_tqdm=False
    )
    model.decode_stack = inner
    args = captured[0]
    assert args[0].shape[0] == seqs and not args[-1], f"the 60th call was not a decode step of {seqs}"

    times: dict[str, list[float]] = {k: [] for k in stacks}
    order = list(stacks.items())
    rng = random.Random(0)
    with torch.inference_mode():
        outputs = [s.forward(*args) for s in stacks.values()]
        if os.environ.get("AB_CLOSE"):  # a change of arithmetic: report how far the outputs moved
            for key, o in zip(stacks, outputs, strict=True):
                diff = (o.float() - outputs[0].float()).abs().max().item()
                print(f"{key}: max |output - this checkout's| {diff:.3g}")
        else:
            assert all(torch.equal(o, outputs[0]) for o in outputs), "the stacks' outputs differ"
        for _ in range(rounds):
            rng.shuffle(order)
            for key, stack in order:
                start = time.perf_counter()
                stack.forward(*args)
                times[key].append(time.perf_counter() - start)
    for key, t in times.items():
        print(f"{key}: median {statistics.median(t) * 1e3:.2f} ms over {rounds} rounds")


if __name__ == "__main__":
    main()
