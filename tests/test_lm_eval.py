"""lm-evaluation-harness against `pagedllm serve` (local-completions: loglikelihood and generate_until),
on a tiny task written here from local files, giving the same accuracy as lm-eval's own `hf` backend on the
same weights: the default model dequantized into a Hugging Face folder that both load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from test_server import running_server

from pagedllm.model.loader import resolve_model_path
from pagedllm.model.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

MC = [
    ("The capital of France is", [" Paris", " Berlin", " Madrid", " Rome"], 0),
    ("The capital of Germany is", [" Paris", " Berlin", " Madrid", " Rome"], 1),
    ("Water is made of hydrogen and", [" oxygen", " gold", " iron", " salt"], 0),
    ("The opposite of hot is", [" cold", " big", " loud", " green"], 0),
    ("A cat says", [" woof", " meow", " moo", " quack"], 1),
    ("The sun rises in the", [" west", " north", " east", " south"], 2),
    ("Two plus two equals", [" four", " five", " six", " seven"], 0),
    ("Ice is frozen", [" water", " fire", " air", " sand"], 0),
]
GEN = [
    ("What is the capital of France?", "Paris"),
    ("What is 2 + 2?", "4"),
    ("What color is the sky on a clear day?", "Blue"),
    ("What is the largest planet in our solar system?", "Jupiter"),
]


def write_tasks(root: Path) -> None:
    (root / "mc.jsonl").write_text(
        "".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in MC)
    )
    (root / "gen.jsonl").write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in GEN))
    (root / "tiny_mc.yaml").write_text(
        f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
    )
    (root / "tiny_gen.yaml").write_text(
        f"""task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / "gen.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
    regexes_to_ignore: [" "]
"""
    )


def save_hf_folder(folder: Path) -> None:
    """The default GGUF dequantized by transformers, with pagedllm's tokenizer for it, as an HF folder."""
    path = resolve_model_path("default")
    gguf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    # transformers will not save a model it loaded from GGUF: the same weights into a plain one
    config = type(gguf.config).from_dict(
        {k: v for k, v in gguf.config.to_dict().items() if k != "quantization_config"}
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf.state_dict())
    model.save_pretrained(folder)
    Tokenizer.from_checkpoint(path).hf.save_pretrained(folder)


def evaluate(model: str, model_args: str, include: Path) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["tiny_mc", "tiny_gen"],
        task_manager=TaskManager(include_path=str(include)),
        log_samples=True,
    )
    return out


def test_lm_eval_local_completions_equals_hf_backend(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", "test-key")  # local-completions sends it as the bearer token
    tasks, folder = tmp_path / "tasks", tmp_path / "hf"
    tasks.mkdir()
    write_tasks(tasks)
    save_hf_folder(folder)
    with running_server(tmp_path / "server.log", "--dtype", "fp32", model=str(folder)) as server:
        ours = evaluate(
            "local-completions",
            f"base_url={server.url('/v1/completions')},model={server.model},num_concurrent=1,max_retries=1",
            tasks,
        )
    theirs = evaluate("hf", f"pretrained={folder},dtype=float32,device=cpu,batch_size=1", tasks)
    for task, metric in (("tiny_mc", "acc,none"), ("tiny_gen", "exact_match,none")):
        assert ours["results"][task][metric] == theirs["results"][task][metric], task
    # and the same loglikelihood of every choice, not only the same argmax
    for a, b in zip(ours["samples"]["tiny_mc"], theirs["samples"]["tiny_mc"]):
        for (lp_a, _), (lp_b, _) in zip(a["filtered_resps"], b["filtered_resps"]):
            assert abs(lp_a - lp_b) < 1e-3
    assert ours["results"]["tiny_mc"]["acc,none"] >= 0.5  # the task is not noise for this model
