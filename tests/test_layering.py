"""The package's layering: data flows one way, nothing below imports from above, no import cycles.

Every module under pagedllm/ is parsed with `ast` (nothing is imported). Two graphs come out of it:
  - modules, from module-level imports only (what runs at import time): must have no cycle;
  - packages, from every import, function-level ones included: a package is `pagedllm.<first level>`,
    and for `pagedllm.model` and `pagedllm.entrypoints` their second level too (`pagedllm.model.loader`).
    Each package must sit in LAYERS, import only from its own layer or lower ones, and the package
    graph must have no cycle.
"""

from __future__ import annotations

import ast
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
    {"pagedllm.model"},  # the decoder, its builder and fusions
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


def _imports(module: str, node: ast.AST, module_level_only: bool) -> set[str]:
    """pagedllm modules imported under node; module_level_only skips function bodies (run later)."""
    found: set[str] = set()
    for child in ast.iter_child_nodes(node):
        if module_level_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if _is_type_checking(child):  # annotations only, never executed
            continue
        if isinstance(child, ast.Import):
            found |= {_resolve(a.name) for a in child.names if a.name.split(".")[0] == "pagedllm"}
        elif isinstance(child, ast.ImportFrom):
            base = child.module or ""
            if child.level:  # relative: from the importing module's package
                pkg = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
                pkg = pkg[: len(pkg) - child.level + 1]
                base = ".".join(pkg + ([child.module] if child.module else []))
            if base.split(".")[0] == "pagedllm":
                # `from pagedllm import planner` imports the module pagedllm.planner
                found |= {
                    f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else _resolve(base)
                    for a in child.names
                }
        found |= _imports(module, child, module_level_only)
    return found


def _graph(module_level_only: bool) -> dict[str, set[str]]:
    return {
        m: _imports(m, ast.parse(p.read_text(), str(p)), module_level_only) - {m} for m, p in MODULES.items()
    }


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
    for m, targets in _graph(module_level_only=False).items():
        packages.setdefault(package_of(m), set()).update(package_of(t) for t in targets)
    return {p: ts - {p} for p, ts in packages.items()}


def test_every_package_has_a_layer():
    layered = set().union(*LAYERS)
    missing = {package_of(m) for m in MODULES} - layered
    assert not missing, f"add these packages to LAYERS in tests/test_layering.py: {sorted(missing)}"
    assert sum(len(layer) for layer in LAYERS) == len(layered), "a package is listed in two layers"


def test_no_module_level_import_cycle():
    cycle = _find_cycle(_graph(module_level_only=True))
    assert cycle is None, "module-level import cycle: " + " -> ".join(cycle)


def test_no_package_import_cycle():
    cycle = _find_cycle(_package_graph())
    assert cycle is None, "package import cycle (function-level imports included): " + " -> ".join(cycle)


def test_nothing_imports_from_a_higher_layer():
    level = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}
    upward = sorted(
        f"{m} -> {t}"
        for m, targets in _graph(module_level_only=False).items()
        for t in targets
        if level.get(package_of(t), len(LAYERS)) < level.get(package_of(m), len(LAYERS))
    )
    assert not upward, "imports from a higher layer:\n  " + "\n  ".join(upward)


