"""LoRA adapters on the server (issue 37): the options, the name -> adapter registry, and vLLM's routes.

    --enable-lora --lora-modules name=path ... --max-loras N --max-lora-rank R --max-cpu-loras N
    --allow-runtime-lora-updating   POST /v1/load_lora_adapter {"lora_name", "lora_path"}
                                    POST /v1/unload_lora_adapter {"lora_name"}

A request picks an adapter by its `model` field; GET /v1/models lists each adapter with `parent` (the
base's name). An unknown name is a 404 naming it; a bad folder is a 400 naming what is wrong (the engine
reads and checks it: lora/peft.py), and the server serves on. --lora-modules are checked at start-up.
"""

from __future__ import annotations

import argparse
import asyncio

from fastapi import FastAPI
from pydantic import BaseModel

from pagedllm.engine.protocol import EngineClient
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.lora_args import parse_lora_modules
from pagedllm.entrypoints.openai.protocol import ModelCard
from pagedllm.errors import InputError
from pagedllm.lora.request import LoRARequest


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


class LoRAModels:
    """The adapters a server serves: name -> LoRARequest, ids given in order and never reused (an id is a
    prefix-cache key: a name loaded again from another folder must not find the old KV)."""

    def __init__(self, engine: EngineClient, base_names: list[str]):
        self.engine = engine
        self.base_names = list(base_names)
        self.adapters: dict[str, LoRARequest] = {}
        self._next_id = 1
        self.allow_runtime = False  # --allow-runtime-lora-updating: the load / unload routes

    def _new(self, name: str, path: str) -> LoRARequest:
        if name in self.base_names:
            raise InputError(f"adapter name {name!r} is the base model's name", param="lora_name")
        request = LoRARequest(name, self._next_id, path)
        self._next_id += 1
        return request

    async def add_startup(self, modules: list[tuple[str, str]]) -> None:
        """--lora-modules, registered with the engine before it serves (InputError naming a bad one)."""
        for name, path in modules:
            request = self._new(name, path)
            await self.engine.add_lora(request)
            self.adapters[name] = request

    def resolve(self, model: str | None) -> LoRARequest | None:
        return self.adapters.get(model) if model is not None else None

    def __contains__(self, model: str) -> bool:
        return model in self.adapters

    async def load(self, body: LoadLoRAAdapterRequest) -> str:
        if body.lora_name in self.adapters:
            raise InputError(f"adapter {body.lora_name!r} is already loaded", param="lora_name")
        request = self._new(body.lora_name, body.lora_path)
        await self.engine.add_lora(request)  # reads and checks the folder: InputError naming the problem
        self.adapters[body.lora_name] = request
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    async def unload(self, body: UnloadLoRAAdapterRequest) -> str:
        request = self.adapters.get(body.lora_name)
        if request is None:
            raise APIError(
                f"The lora adapter `{body.lora_name}` cannot be found.", status=404, param="lora_name"
            )
        del self.adapters[body.lora_name]
        await self.engine.remove_lora(request.lora_int_id)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

    def cards(self, root: str | None, max_model_len: int) -> list[ModelCard]:
        return [
            ModelCard(id=name, root=r.lora_path, parent=self.base_names[0], max_model_len=max_model_len)
            for name, r in self.adapters.items()
        ]


def make_lora_models(
    args: argparse.Namespace, engine: EngineClient, base_names: list[str]
) -> LoRAModels | None:
    """The server's adapters (None without --enable-lora); called on the loading thread, which has no event
    loop of its own: the --lora-modules are registered through one (InputError naming a bad one)."""
    if not getattr(args, "enable_lora", False):
        return None
    models = LoRAModels(engine, base_names)
    asyncio.run(models.add_startup(parse_lora_modules(args.lora_modules)))
    models.allow_runtime = bool(args.allow_runtime_lora_updating)
    return models


def add_lora_routes(app: FastAPI, loras: LoRAModels, responses: dict) -> None:
    """vLLM's runtime routes, under --allow-runtime-lora-updating only."""
    if not getattr(loras, "allow_runtime", False):
        return

    @app.post("/v1/load_lora_adapter", responses=responses)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> str:
        return await loras.load(body)

    @app.post("/v1/unload_lora_adapter", responses=responses)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> str:
        return await loras.unload(body)
