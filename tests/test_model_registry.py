"""ModelRegistry's rules without a server or a model (issue 38 item 1): loads share --max-loaded-models
without waiting on each other, a model with a request in flight is never unloaded, --idle-unload-s unloads,
--load-timeout-s answers while the load goes on. The real thing: tests/test_server_models.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagedllm.entrypoints.openai.model_registry import LoadedModel, ModelLoadTimeout, ModelRegistry
from pagedllm.entrypoints.openai.model_specs import ModelSpec, model_specs, parse_model_option


class FakeEngine:
    max_model_len = 128

    def __init__(self) -> None:
        self.stopped = False

    async def shutdown(self, timeout: float = 10.0) -> None:
        self.stopped = True


def registry(names: str, load_s: float = 0.0, **kw) -> tuple[ModelRegistry, list[str]]:
    loads: list[str] = []

    def load(spec: ModelSpec) -> LoadedModel:
        time.sleep(load_s)
        loads.append(spec.name)
        return LoadedModel(app=None, engine=FakeEngine(), metrics=None)

    specs = [ModelSpec(n, n) for n in names]
    kw.setdefault("load_timeout_s", 10.0)
    return ModelRegistry(specs, load, **kw), loads


def states(r: ModelRegistry) -> str:
    return "".join({"loaded": "L", "loading": "~", "unloaded": "."}[e.state] for e in r.entries.values())


def test_parse_model_option() -> None:
    assert parse_model_option("a=default") == ModelSpec("a", "default")
    assert parse_model_option("default") == ModelSpec("default", "default")
    assert parse_model_option("/x/a=b.gguf") == ModelSpec("/x/a=b.gguf", "/x/a=b.gguf")  # '/' in the name


def test_lru_never_unloads_in_flight_and_concurrent_loads_do_not_deadlock() -> None:
    async def main() -> None:
        r, loads = registry("abc", max_loaded_models=1)
        a = r.entries["a"]
        await r.acquire(a)  # a in flight
        b_task = asyncio.create_task(r.acquire(r.entries["b"]))
        c_task = asyncio.create_task(r.acquire(r.entries["c"]))
        await asyncio.sleep(0.3)
        assert states(r) == "L~~" and not b_task.done()  # a busy: b and c wait, neither holds the place
        r.release(a)
        done, _ = await asyncio.wait({b_task, c_task}, timeout=5, return_when=asyncio.FIRST_COMPLETED)
        winner = "b" if b_task in done else "c"
        assert states(r).count("L") == 1 and r.entries[winner].state == "loaded"
        r.release(r.entries[winner])
        await asyncio.wait_for(asyncio.gather(b_task, c_task), 5)  # the other then evicts it
        assert loads[0] == "a" and sorted(loads[1:]) == ["b", "c"]
        assert states(r).count("L") == 1

    asyncio.run(main())


def test_idle_unload_and_reload() -> None:
    async def main() -> None:
        r, loads = registry("ab", idle_unload_s=0.2)
        r.preload("a")
        engine = r.entries["a"].loaded.engine
        r.start()
        await asyncio.sleep(0.8)
        assert states(r) == ".." and engine.stopped
        await r.acquire(r.entries["a"])
        assert states(r) == "L." and loads == ["a", "a"]
        await r.shutdown()

    asyncio.run(main())


def test_load_timeout_then_loaded() -> None:
    async def main() -> None:
        r, _ = registry("ab", load_s=0.5, load_timeout_s=0.05)
        with pytest.raises(ModelLoadTimeout, match="`b` is loading"):
            await r.acquire(r.entries["b"])
        assert r.entries["b"].in_flight == 0 and states(r) == ".~"
        await asyncio.sleep(0.8)
        assert states(r) == ".L"  # the load went on

    asyncio.run(main())


def _serve_args(*argv: str):
    import argparse

    from pagedllm.entrypoints.openai.cli_args import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_one_model_stays_the_one_model_server() -> None:
    args = _serve_args()
    assert model_specs(args) is None and args.model == "default" and args.served_model_name is None
    args = _serve_args("--model", "some/path.gguf", "--served-model-name", "x")
    assert model_specs(args) is None and (args.model, args.served_model_name) == ("some/path.gguf", "x")
    args = _serve_args("--model", "smol=default")  # NAME=PATH alone: the one-model server, named NAME
    assert model_specs(args) is None and (args.model, args.served_model_name) == ("default", "smol")


def test_several_models_and_router_options() -> None:
    args = _serve_args("--model", "a=default", "--model", "b=default")
    assert model_specs(args) == [ModelSpec("a", "default"), ModelSpec("b", "default")]
    assert args.load_timeout_s == 600.0
    args = _serve_args("--model", "default", "--idle-unload-s", "30")  # one model, unloaded when idle
    assert model_specs(args) == [ModelSpec("default", "default")] and args.idle_unload_s == 30.0
