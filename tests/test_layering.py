"""The package's layering: data flows one way, nothing below imports from above, no import cycles.

Every module under pagedllm/ is parsed with `ast` (nothing is imported). Its imports are every `import` and
`from ... import` in the file, those inside functions included (they run too, only later), except those
under `if TYPE_CHECKING:` (never run; its `else:` branch does). Two graphs come out of it:
  - modules: must have no cycle, none allowed;
  - packages: a package is `pagedllm.<first level>`, and for `pagedllm.model` and `pagedllm.entrypoints`
    their second level too (`pagedllm.model.loader`). Each package must sit in LAYERS, import only from
    its own layer or lower ones, and the package graph must have no cycle.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "pagedllm"
SPLIT_PACKAGES = {"pagedllm.model", "pagedllm.entrypoints"}  # counted by their second level too

# Top to bottom. A package may import from its own layer (the cycle checks still apply) or any lower one.
LAYERS: list[set[str]] = [
    {"pagedllm"},  # the public facade: LLM, SamplingParams, RequestOutput, __version__
    {"pagedllm.entrypoints.cli"},  # `pagedllm ...`: one module a subcommand
    {"pagedllm.entrypoints.openai", "pagedllm.bench"},  # the HTTP server; benchmarks the CLI runs
    {"pagedllm.entrypoints"},  # the offline LLM class, engine_args.py
    {"pagedllm.engine"},  # LLMEngine, AsyncEngine, detokenizer
    {"pagedllm.spec_decode"},  # draft-token proposers (a draft model runs its own runner and KV manager)
    {"pagedllm.executor"},  # where the runner runs: this process, or tensor-parallel worker processes
    # scheduler + KV cache; model runner; perplexity; grammars for structured outputs
    {"pagedllm.core", "pagedllm.worker", "pagedllm.eval", "pagedllm.structured_output"},
    {"pagedllm.model", "pagedllm.lora"},  # the decoder, its builder and fusions; LoRA adapters over its linears
    {"pagedllm.quantization"},  # QuantLinear and the quantizers
    {"pagedllm.attention", "pagedllm.model.layers", "pagedllm.model.loader"},
    {
        "pagedllm.planner",
        "pagedllm.metrics",
        "pagedllm.outputs",
        "pagedllm.sampling_params",
        "pagedllm.cpp_extension",
        "pagedllm.ops",  # the op table: which backend each op runs on this machine
        "pagedllm.kernels",  # the list of C++ kernels and their tiers
        "pagedllm.plot_style",  # the look of every PNG: bench plots and `plan --plot`
        "pagedllm.distributed",  # tensor parallelism: the split of a model over ranks, the collectives
        "pagedllm.cpu_bind",  # PAGEDLLM_CPU_BIND: torch's threads pinned, before torch loads
    },
    {
        "pagedllm.config",
        "pagedllm.platform",
        "pagedllm.units",
        "pagedllm.gguf_layout",
        "pagedllm.version",
        "pagedllm.errors",
    },
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: dict[str, Path] = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def package_of(module: str) -> str:
    parts = module.split(".")
    first = ".".join(parts[:2])
    if first in SPLIT_PACKAGES and len(parts) > 2 and (ROOT / parts[1] / parts[2]).is_dir():
        return ".".join(parts[:3])
    return first


def _resolve(name: str) -> str:
    """The module an import name lands in (`pagedllm.model.loader.Checkpoint` -> `pagedllm.model.loader`)."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(module: str, nodes: list[ast.AST], found: dict[str, int]) -> dict[str, int]:
    """Adds to found every pagedllm module imported anywhere in nodes (function bodies included), with the
    line of its first import."""
    for node in nodes:
        if _is_type_checking(node):  # annotations only, never executed; its else branch runs
            _imports(module, node.orelse, found)
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [_resolve(a.name) for a in node.names if a.name.split(".")[0] == "pagedllm"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package
                pkg = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join(pkg + ([node.module] if node.module else []))
            if base.split(".")[0] == "pagedllm":
                # `from pagedllm import planner` imports the module pagedllm.planner
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else _resolve(base)
                    for a in node.names
                ]
        for t in targets:
            found.setdefault(t, node.lineno)
        _imports(module, list(ast.iter_child_nodes(node)), found)
    return found


@cache
def _edges() -> dict[str, dict[str, int]]:
    """module -> {pagedllm module it imports (at import time or in a function): line of the first import}."""
    out = {}
    for m, p in MODULES.items():
        found = _imports(m, ast.parse(p.read_text(), str(p)).body, {})
        found.pop(m, None)
        out[m] = found
    return out


def _graph() -> dict[str, set[str]]:
    return {m: set(targets) for m, targets in _edges().items()}


def _where(module: str, target: str) -> str:
    """`pagedllm/x.py:12` where module imports target (or a module of target's package)."""
    lines = _edges()[module]
    line = lines.get(target) or min(n for t, n in lines.items() if package_of(t) == target)
    return f"{MODULES[module].relative_to(ROOT.parent)}:{line}"


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path [a, b, ..., a], or None (iterative DFS, white/grey/black)."""
    state: dict[str, int] = {}
    for start in sorted(graph):
        if state.get(start):
            continue
        stack = [(start, iter(sorted(graph.get(start, ()))))]
        path = [start]
        state[start] = 1
        while stack:
            node, children = stack[-1]
            for child in children:
                if state.get(child) == 1:
                    return path[path.index(child) :] + [child]
                if not state.get(child):
                    state[child] = 1
                    path.append(child)
                    stack.append((child, iter(sorted(graph.get(child, ())))))
                    break
            else:
                state[node] = 2
                path.pop()
                stack.pop()
    return None


def _package_graph() -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for m, targets in _graph().items():
        packages.setdefault(package_of(m), set()).update(package_of(t) for t in targets)
    return {p: ts - {p} for p, ts in packages.items()}


def _package_edge(src: str, dst: str) -> str:
    """Where a module of package src imports one of package dst: `pagedllm/x.py:12 (pagedllm.x -> pagedllm.y)`."""
    m, t = min(
        (m, t)
        for m, targets in _graph().items()
        if package_of(m) == src
        for t in targets
        if package_of(t) == dst
    )
    return f"{_where(m, t)} ({m} -> {t})"


def test_every_package_has_a_layer():
    layered = set().union(*LAYERS)
    missing = {package_of(m) for m in MODULES} - layered
    assert not missing, f"add these packages to LAYERS in tests/test_layering.py: {sorted(missing)}"
    assert sum(len(layer) for layer in LAYERS) == len(layered), "a package is listed in two layers"


def test_no_module_import_cycle():
    """No cycle at all, function-level imports included: an import inside a function hides a cycle from
    Python's import machinery, not from the design (model/build.py <-> model/quantized_checkpoint.py was one)."""
    cycle = _find_cycle(_graph())
    assert cycle is None, "module import cycle (function-level imports included):\n  " + "\n  ".join(
        f"{_where(a, b)}: {a} -> {b}" for a, b in zip(cycle, cycle[1:])
    )


def test_no_package_import_cycle():
    cycle = _find_cycle(_package_graph())
    assert cycle is None, "package import cycle (function-level imports included):\n  " + "\n  ".join(
        _package_edge(a, b) for a, b in zip(cycle, cycle[1:])
    )


def test_nothing_imports_from_a_higher_layer():
    level = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}
    upward = sorted(
        f"{_where(m, t)}: {m} -> {t}"
        for m, targets in _graph().items()
        for t in targets
        if level.get(package_of(t), len(LAYERS)) < level.get(package_of(m), len(LAYERS))
    )
    assert not upward, "imports from a higher layer:\n  " + "\n  ".join(upward)
