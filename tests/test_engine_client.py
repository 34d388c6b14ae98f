"""One engine interface: EngineClient (engine/protocol.py) is all the server knows of an engine.

Both engines define every member of it (checked on the classes: DataParallelEngine needs Ray to build),
the engines the server tests serve satisfy it, and nothing under pagedllm/entrypoints/ probes an engine
with getattr/hasattr: the server reads each member plainly.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest
from fake_engine import FakeEngine

from pagedllm.engine.async_engine import AsyncEngine
from pagedllm.engine.data_parallel import DataParallelEngine
from pagedllm.engine.protocol import EngineClient

ENTRYPOINTS = Path(__file__).resolve().parent.parent / "pagedllm" / "entrypoints"
MEMBERS = sorted(n for n in {*vars(EngineClient), *EngineClient.__annotations__} if not n.startswith("_"))
ENGINES = [AsyncEngine, DataParallelEngine]


def _definition(cls: type, name: str) -> tuple[bool, object]:
    """(found, the class-level object or None for an annotated instance attribute), searched up the MRO."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return True, vars(klass)[name]
        if name in vars(klass).get("__annotations__", {}):
            return True, None
    return False, None


def test_the_protocol_names_what_the_server_uses() -> None:
    expected = {"generate", "abort", "health", "get_stats", "publishes_kv_view", "watch_kv", "unwatch_kv"}
    expected |= {"kv_block", "replica_labels", "model_config", "tokenizer", "max_model_len", "shutdown"}
    assert expected <= set(MEMBERS)


@pytest.mark.parametrize("cls", ENGINES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", MEMBERS)
def test_each_engine_defines_every_member(cls: type, name: str) -> None:
    found, impl = _definition(cls, name)
    assert found, f"{cls.__name__} does not define {name}"
    spec = vars(EngineClient).get(name)
    if not inspect.isfunction(spec):
        return  # a property or an attribute: a property, a class attribute or an annotated one all do
    assert inspect.isfunction(impl), f"{cls.__name__}.{name} should be a method"
    assert inspect.iscoroutinefunction(impl) == inspect.iscoroutinefunction(spec), f"{name}: async or not"
    impl_params = list(inspect.signature(impl).parameters.values())
    spec_params = list(inspect.signature(spec).parameters.values())
    assert [(p.name, p.default) for p in impl_params] == [(p.name, p.default) for p in spec_params], name


def test_a_single_engine_answers_as_one() -> None:
    engine = AsyncEngine(FakeEngine(), start=False)
    assert isinstance(engine, EngineClient)
    assert engine.replica_labels is None and engine.health() is None
    assert not engine.publishes_kv_view  # FakeEngine has no KV view; the /kv routes answer 409
    assert isinstance(engine.model_config.vocab_size, int)


def test_the_pool_fake_publishes_a_view() -> None:
    from pool_engine import PoolEngine

    engine = AsyncEngine(PoolEngine(num_blocks=64, num_requests=2, prompt_len=32, max_tokens=4), start=False)
    assert isinstance(engine, EngineClient)
    assert engine.publishes_kv_view
    assert isinstance(engine.model_config.vocab_size, int)


def test_data_parallel_publishes_no_view() -> None:
    assert DataParallelEngine.publishes_kv_view is False


# ---- no probing in the server -----------------------------------------------------------------------------

_ENGINE_TEXT = re.compile(r"^(self\.)?engine\b|\.engine\b")


def engine_probes(source: str) -> list[str]:
    """`getattr(...)` / `hasattr(...)` calls whose first argument is an engine or something read from it."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and node.args
            and _ENGINE_TEXT.search(ast.unparse(node.args[0]))
        ):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_probe_finder_finds_probes() -> None:
    bad = """
getattr(engine, "health", None)
hasattr(self.engine, "x")
getattr(self.engine.model_config, "vocab_size", None)
getattr(app.state.engine, "replica_labels", None)
"""
    assert len(engine_probes(bad)) == 4
    fine = 'getattr(tok, "hf", tok)\ngetattr(engine_args, "threads", None)\ngetattr(self.engines, "x")\n'
    assert engine_probes(fine) == []


def test_nothing_under_entrypoints_probes_an_engine() -> None:
    probes = {
        str(path.relative_to(ENTRYPOINTS.parent)): found
        for path in sorted(ENTRYPOINTS.rglob("*.py"))
        if (found := engine_probes(path.read_text()))
    }
    assert probes == {}
