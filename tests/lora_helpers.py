"""PEFT adapters for the LoRA tests, written by peft itself over a tiny random Llama (tests/tiny_models.py),
and the transformers + peft reference they are compared against."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_adapter(
    base: str | Path,
    path: str | Path,
    seed: int,
    r: int = 8,
    alpha: int = 16,
    targets: list[str] | None = None,
    use_rslora: bool = False,
) -> Path:
    """A PEFT LoRA folder for `base` with random A and non-zero B (peft starts B at zero, which would change
    nothing), large enough that greedy tokens differ from the base's."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    config = LoraConfig(
        r=r, lora_alpha=alpha, target_modules=targets or ALL_LINEARS, lora_dropout=0.0, use_rslora=use_rslora
    )
    peft_model = get_peft_model(model, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    peft_model.save_pretrained(path)
    return Path(path)


def reference_greedy(
    base: str | Path, adapter: str | Path | None, prompt: list[int], max_tokens: int
) -> list[int]:
    """transformers (+ peft) greedy tokens in float32."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            min_new_tokens=max_tokens,
        )
    return out[0, len(prompt) :].tolist()


def write_random_adapter(
    path: Path, cfg, rank: int, modules: dict[int, list[str]], scale: float, seed: int
) -> Path:
    """A PEFT folder written directly (no peft, no HF model of the base's shapes): random A and B for
    `modules` ({layer: [module names]}) of a base of config `cfg` (pagedllm's ModelConfig)."""
    import json

    from safetensors.torch import save_file

    from pagedllm.lora.peft import module_shapes

    path.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    shapes, tensors = module_shapes(cfg), {}
    for layer, names in modules.items():
        for name in names:
            fan_in, fan_out = shapes[name]
            part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * scale
    save_file(tensors, str(path / "adapter_model.safetensors"))
    targets = sorted({n for names in modules.values() for n in names})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": targets}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path
