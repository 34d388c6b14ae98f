"""What a request names to run with an adapter, and the engine's adapter limits (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.errors import InputError


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for a request: `lora_int_id` (>= 1) is its identity inside the engine (device slot,
    prefix-cache key), `lora_name` what the API calls it, `lora_path` its PEFT folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if type(self.lora_int_id) is not int or self.lora_int_id < 1:
            raise InputError(
                f"lora_int_id must be an integer >= 1 (0 is the base model), got {self.lora_int_id!r}",
                param="lora_request",
            )
        if not self.lora_name:
            raise InputError("lora_name must not be empty", param="lora_request")


@dataclass(frozen=True)
class LoRAConfig:
    """max_loras: adapters that may run in one step (device slots); max_lora_rank: the largest rank taken
    (every slot is this wide); max_cpu_loras: adapters kept loaded in memory (LRU), at least max_loras."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise InputError(f"{name} must be an integer >= 1, got {value!r}", param=name)
        if self.max_cpu_loras is not None and (
            type(self.max_cpu_loras) is not int or self.max_cpu_loras < self.max_loras
        ):
            raise InputError(
                f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), got {self.max_cpu_loras!r}",
                param="max_cpu_loras",
            )

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


def check_lora_options(
    enable_lora: bool,
    max_loras: int,
    max_lora_rank: int,
    max_cpu_loras: int | None,
    *,
    tensor_parallel_size: int = 1,
    speculative: bool = False,
    batch_invariant: bool = False,
) -> LoRAConfig | None:
    """The engine's LoRAConfig, or None without enable_lora; what LoRA does not run with is refused by name
    (never ignored)."""
    if not enable_lora:
        return None
    config = LoRAConfig(max_loras, max_lora_rank, max_cpu_loras)
    for name, on in (
        ("tensor_parallel_size > 1", tensor_parallel_size > 1),
        ("speculative_config", speculative),
        ("batch_invariant", batch_invariant),
    ):
        if on:
            raise InputError(f"enable_lora does not run with {name} yet", param="enable_lora")
    return config


@dataclass(frozen=True)
class LoRAStats:
    """The adapters of the running and the waiting requests (vLLM's lora_requests_info gauge)."""

    running: tuple[str, ...]  # adapter names
    waiting: tuple[str, ...]
    max_loras: int

    @classmethod
    def of(cls, scheduler, max_loras: int, names: dict[int, str]) -> LoRAStats:
        def adapters(requests) -> tuple[str, ...]:
            ids = {r.lora_int_id for r in requests if r.lora_int_id}
            return tuple(sorted(names.get(i, str(i)) for i in ids))

        return cls(adapters(scheduler.running), adapters(scheduler.waiting), max_loras)
