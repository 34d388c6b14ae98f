"""Which adapter holds which device slot, which adapters stay loaded, and this step's row -> slot map.

The manager lives beside the model runner (worker side). The engine registers adapters (`add_adapter`
reads and checks the folder at once, so a bad one is refused before any request uses it); the scheduler
keeps at most max_loras adapters among the running requests, so a step never needs more slots than
exist; `set_batch` gives each of the step's adapters a slot (evicting the least recently used slot that
this step does not need) and builds the row mask every LoRALinear reads.
Loaded adapters (float32 on the CPU) are kept up to max_cpu_loras, least recently used first out; an
evicted one is read again from its folder when a request needs it.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from pagedllm import ops
from pagedllm.config import ModelConfig
from pagedllm.errors import InputError
from pagedllm.lora.layers import LoRABatch, LoRALinear
from pagedllm.lora.peft import LoRAAdapter, load_adapter
from pagedllm.lora.request import LoRAConfig, LoRARequest


def check_model(model: nn.Module, cfg: ModelConfig) -> None:
    """The model kinds the adapters' layers cover: a dense Llama-family decoder (not MoE experts)."""
    if cfg.num_experts:
        raise InputError("LoRA adapters are not supported on mixture-of-experts models", param="enable_lora")
    if not hasattr(model, "model") or not hasattr(model.model, "layers"):
        raise InputError(f"LoRA adapters are not supported on {type(model).__name__}", param="enable_lora")


def wrap_linears(model: nn.Module, batch: LoRABatch, dtype: torch.dtype) -> dict[int, list[LoRALinear]]:
    """Replace each decoder linear by a LoRALinear around it (after fuse.py: a fused qkv / gate_up takes
    its modules' slices), in the fused decoder stack's order of linears (qkv's, o, gate_up's, down).
    Returns layer index -> its LoRALinears."""
    out: dict[int, list[LoRALinear]] = {}
    for idx, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        wrapped = out[idx] = []

        def wrap(owner: nn.Module, attr: str, in_features: int, slices: tuple, into: list = wrapped) -> None:
            lora = LoRALinear(getattr(owner, attr), in_features, slices, batch, dtype)
            setattr(owner, attr, lora)
            into.append(lora)

        q, kv = attn.qkv_sizes[0], attn.qkv_sizes[1]
        hidden = layer.input_layernorm.weight.shape[0]
        if attn.qkv_proj is not None:
            wrap(attn, "qkv_proj", hidden, (("q_proj", q), ("k_proj", kv), ("v_proj", kv)))
        else:
            for name, width in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                wrap(attn, name, hidden, ((name, width),))
        wrap(attn, "o_proj", q, (("o_proj", hidden),))
        f = _intermediate(mlp)
        if mlp.gate_up_proj is not None:
            wrap(mlp, "gate_up_proj", hidden, (("gate_proj", f), ("up_proj", f)))
        else:
            wrap(mlp, "gate_proj", hidden, (("gate_proj", f),))
            wrap(mlp, "up_proj", hidden, (("up_proj", f),))
        wrap(mlp, "down_proj", f, (("down_proj", hidden),))
    return out


def _intermediate(mlp: nn.Module) -> int:
    down = mlp.down_proj
    for attr in ("in_features", "infeatures"):
        if hasattr(down, attr):
            return int(getattr(down, attr))
    return int(down.weight.shape[1])


class LoRAModelManager:
    def __init__(self, model: nn.Module, cfg: ModelConfig, config: LoRAConfig, dtype: torch.dtype):
        check_model(model, cfg)
        self.cfg, self.config = cfg, config
        self.batch = LoRABatch(config.max_loras, config.max_lora_rank)
        self.model, self._decode_stack = model, model.decode_stack
        self.layers = wrap_linears(model, self.batch, dtype)
        # The fused decoder stack calls the linears from C++ (it holds the base's own weights, taken at fuse
        # time). Where the `lora` op is C++ the stack adds the adapters with it, reading the LoRALinears'
        # buffers; else it runs only the steps without adapter rows (set_batch) and the layer loop the rest.
        self._stack_has_lora = self._decode_stack is not None and ops.kernel("lora") is not None
        if self._stack_has_lora:
            self._attach_to_stack()
        else:
            model.decode_stack = None
        self.registered: dict[int, LoRARequest] = {}  # what requests may name
        # removed while requests may still run with them: read again from their folders if they need a slot
        self.retired: dict[int, LoRARequest] = {}
        self.loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()  # CPU copies, LRU first
        self.slots: list[int | None] = [None] * config.max_loras  # slot -> lora_int_id
        self._slot_use: dict[int, int] = {}  # slot -> step it last served (LRU among slots)
        self._step = 0

    # -- adapters --------------------------------------------------------------------------------
    def add_adapter(self, request: LoRARequest) -> LoRAAdapter:
        """Read and check the folder (InputError naming the problem) and keep it loaded."""
        known = self.registered.get(request.lora_int_id)
        if known is not None and (known.lora_name, known.lora_path) != (request.lora_name, request.lora_path):
            raise InputError(
                f"lora_int_id {request.lora_int_id} is adapter {known.lora_name!r} ({known.lora_path}); "
                f"{request.lora_name!r} needs its own id",
                param="lora_request",
            )
        adapter = self._load(request)
        self.registered[request.lora_int_id] = request
        if (
            self.retired.pop(request.lora_int_id, None) is not None and request.lora_int_id in self.slots
        ):  # registered again, perhaps from another folder: reload it
            self.slots[self.slots.index(request.lora_int_id)] = None
        return adapter

    def remove_adapter(self, lora_int_id: int) -> bool:
        """Forget an adapter: no new request may name it and its CPU copy is freed; requests running with
        it finish with it (its slot is reused like any other)."""
        request = self.registered.pop(lora_int_id, None)
        self.loaded.pop(lora_int_id, None)
        if request is not None:
            self.retired[lora_int_id] = request
        return request is not None

    def _load(self, request: LoRARequest) -> LoRAAdapter:
        adapter = self.loaded.get(request.lora_int_id)
        if adapter is None:
            adapter = load_adapter(
                request.lora_path, request.lora_name, request.lora_int_id, self.cfg, self.config.max_lora_rank
            )
            self.loaded[request.lora_int_id] = adapter
            while len(self.loaded) > self.config.cpu_capacity:
                self.loaded.popitem(last=False)
        self.loaded.move_to_end(request.lora_int_id)
        return adapter

    def names(self) -> dict[int, str]:
        """lora_int_id -> name of every adapter a request may still run with."""
        return {i: r.lora_name for i, r in {**self.retired, **self.registered}.items()}

    def _attach_to_stack(self) -> None:
        tensors: list[torch.Tensor] = []
        shapes: list[int] = []
        for linear in self._linears():  # layer by layer, each layer's in the stack's order (wrap_linears)
            tensors += linear.kernel_weights()
            shapes += [len(linear.widths), *linear.widths]
        self._decode_stack.attach_lora(tensors, shapes, self.batch.rank)

    def _linears(self):
        for linears in self.layers.values():
            yield from linears

    # -- one step --------------------------------------------------------------------------------
    def _slot_for(self, lora_int_id: int, needed: set[int]) -> int:
        if lora_int_id in self.slots:
            return self.slots.index(lora_int_id)
        free = [s for s, held in enumerate(self.slots) if held is None]
        if not free:  # the least recently used slot whose adapter this step does not need
            free = sorted(
                (s for s, held in enumerate(self.slots) if held not in needed),
                key=lambda s: self._slot_use.get(s, -1),
            )
        if not free:
            raise RuntimeError(f"a step needs more than max_loras={self.config.max_loras} adapters")
        slot = free[0]
        request = self.registered.get(lora_int_id) or self.retired[lora_int_id]
        adapter = self._load(request)
        per_layer: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer, module), ab in adapter.weights.items():
            per_layer.setdefault(layer, {})[module] = ab
        for layer, linears in self.layers.items():
            weights = per_layer.get(layer, {})
            for linear in linears:
                linear.set_slot(slot, weights)
        self.slots[slot] = lora_int_id
        return slot

    def set_batch(self, rows: list[tuple[int, int]]) -> None:
        """rows: (lora_int_id, number of rows) of each request in the flat batch's order; 0 is the base."""
        self._step += 1
        needed = {lid for lid, _ in rows if lid}
        if not self._stack_has_lora:  # the fused stack (base weights only) for steps without an adapter row
            self.model.decode_stack = None if needed else self._decode_stack
        if not needed:
            self.batch.set(None)
            self._set_stack_rows()
            return
        slot_of = {lid: self._slot_for(lid, needed) for lid in sorted(needed)}
        for slot in slot_of.values():
            self._slot_use[slot] = self._step
        # one list, one tensor: this runs every step (a few microseconds; repeat_interleave took ~30)
        row_slots = [slot_of[lid] if lid else -1 for lid, n in rows for _ in range(n)]
        self.batch.set(torch.tensor(row_slots, dtype=torch.long), max(slot_of.values()) + 1)
        self._set_stack_rows()

    def _set_stack_rows(self) -> None:
        if self._stack_has_lora:
            self._decode_stack.set_lora_rows(self.batch.row_slots)
