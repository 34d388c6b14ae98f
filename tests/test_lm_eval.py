"""lm-evaluation-harness against `pagedllm serve` (local-completions: loglikelihood and generate_until),
on a tiny task written here from local files, giving the same accuracy as lm-eval's own `hf` backend on the
same weights: the default model dequantized into a Hugging Face folder that both load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from test_server import running_server

from pagedllm.model.loader import resolve_model_path
from pagedllm.model.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

TASKS = Path(__file__).resolve().parents[1] / "docs" / "lm-eval-tasks"  # data and YAML, as documented


def write_tasks(root: Path) -> None:
    """docs/lm-eval-tasks' YAML with its data files' paths made absolute (the docs' run from the repo root)."""
    for yaml in TASKS.glob("*.yaml"):
        (root / yaml.name).write_text(yaml.read_text().replace("docs/lm-eval-tasks/", f"{TASKS}/"))


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

    return simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["tiny_mc", "tiny_gen"],
        task_manager=TaskManager(include_path=str(include)),
        log_samples=True,
    )


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
