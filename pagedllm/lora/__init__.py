"""Multi-LoRA serving (issue 37): many PEFT adapters over one base model, batched together.

    request.py   LoRARequest (what a request names) and LoRAConfig (the engine's limits)
    peft.py      reads and checks a PEFT folder against the base model's shapes (LoRAAdapter)
    layers.py    LoRALinear: a decoder linear (float, quantized or fused qkv / gate_up) plus its adapters'
                 stacked low-rank weights, one row block per device slot; the product is the `lora` op
    punica.py    the `lora` op: every row's own adapter in one shrink and one expand matmul (no loop)
    manager.py   which adapter holds which of the max_loras device slots, LRU over --max-cpu-loras

The model definition (model/llama.py) does not change: the manager replaces its linears after the build,
as model/fuse.py merges them.
"""

from pagedllm.lora.request import LoRAConfig, LoRARequest

__all__ = ["LoRAConfig", "LoRARequest"]
