"""The seam's structure (issue 33's "Done when"), read from the source with `ast` (nothing is imported).

  - kernels are loaded by the op table only: `kernels.load(` in pagedllm/ops.py, pagedllm/kernels.py and
    `pagedllm build-kernels` only; `load_cpp_extension(` in pagedllm/kernels.py (and its definition's file);
  - the server never probes the engine: no getattr/hasattr on it under pagedllm/entrypoints/ (it is typed
    against engine/protocol.py's EngineClient);
  - one function assembles a model for inference: the only caller of `shard_model(` and `fuse_for_inference(`;
  - the docs cite what exists: every module path and name in docs/architecture.md and the README's
    architecture section.
Each failure names file:line.
"""

from __future__ import annotations

import ast
import os
import re
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PKG = REPO / "pagedllm"

KERNEL_LOADERS = {"pagedllm/ops.py", "pagedllm/kernels.py", "pagedllm/entrypoints/cli/build_kernels.py"}
EXTENSION_BUILDERS = {"pagedllm/kernels.py", "pagedllm/cpp_extension.py"}
ASSEMBLY_CALLS = ("shard_model", "fuse_for_inference")


def _rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def _by_place(found: list[str]) -> list[str]:
    """`file:line: ...` messages in file, then line order."""
    return sorted(found, key=lambda s: (s.split(":")[0], int(s.split(":")[1])))


@cache
def _sources() -> dict[str, ast.Module]:
    """pagedllm/**.py (repo-relative posix path) -> its syntax tree."""
    return {_rel(p): ast.parse(p.read_text(), str(p)) for p in sorted(PKG.rglob("*.py"))}


def _call_name(call: ast.Call) -> str | None:
    """The called name: `f(...)` and `x.y.f(...)` are both "f"."""
    if isinstance(call.func, ast.Name):
        return call.func.id
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    return None


def _kernels_aliases(tree: ast.Module) -> set[str]:
    """The names a file binds to the pagedllm.kernels module (`from pagedllm import kernels as k`)."""
    names = {"kernels"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("pagedllm", None):
            names |= {a.asname or a.name for a in node.names if a.name == "kernels"}
        elif isinstance(node, ast.Import):
            names |= {a.asname for a in node.names if a.name == "pagedllm.kernels" and a.asname}
    return names


# -- (a) kernels are loaded in one place ---------------------------------------------------------------


def test_kernels_are_loaded_by_the_op_table_only():
    bad = []
    for path, tree in _sources().items():
        aliases = _kernels_aliases(tree)
        for node in ast.walk(tree):
            if path not in KERNEL_LOADERS:
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "load"
                ):
                    owner = ast.unparse(node.func.value)
                    if owner in aliases or owner.endswith("pagedllm.kernels"):
                        bad.append(f"{path}:{node.lineno}: {ast.unparse(node.func)}(...)")
                elif isinstance(node, ast.ImportFrom) and (node.module or "").endswith("kernels"):
                    if (node.module == "pagedllm.kernels" or node.level) and any(
                        a.name == "load" for a in node.names
                    ):
                        bad.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
            if path not in EXTENSION_BUILDERS:
                if isinstance(node, ast.Call) and _call_name(node) == "load_cpp_extension":
                    bad.append(f"{path}:{node.lineno}: load_cpp_extension(...)")
                elif isinstance(node, ast.ImportFrom) and any(
                    a.name == "load_cpp_extension" for a in node.names
                ):
                    bad.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, (
        "a kernel is loaded outside the op table: ask `ops.kernel(op)` instead (kernels.load only in "
        + ", ".join(sorted(KERNEL_LOADERS))
        + "; load_cpp_extension only in pagedllm/kernels.py):\n  "
        + "\n  ".join(_by_place(bad))
    )


# -- (b) the server does not probe the engine ----------------------------------------------------------


def _is_engine(text: str) -> bool:
    """`engine`, `self.engine`, `app.state.engine`, `self._engine`, `llm_engine`, `engine.model_config`."""
    return text.endswith("engine") or text.endswith("engine.model_config")


def test_entrypoints_do_not_probe_the_engine():
    bad = []
    for path, tree in _sources().items():
        if not path.startswith("pagedllm/entrypoints/"):
            continue
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and node.args
                and _is_engine(ast.unparse(node.args[0]))
            ):
                bad.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, (
        "the entry points probe the engine; declare what they need on engine/protocol.py's EngineClient:\n  "
        + "\n  ".join(_by_place(bad))
    )


# -- (c) one function assembles a model ----------------------------------------------------------------


def _callers(name: str) -> dict[str, list[str]]:
    """`file:qualname` of every function (or `<module>`) in pagedllm/ that calls `name(...)` -> call sites."""
    found: dict[str, list[str]] = {}
    for path, tree in _sources().items():

        def visit(node: ast.AST, scope: list[str], path: str = path) -> None:
            for child in ast.iter_child_nodes(node):
                inner = scope
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    inner = [*scope, child.name]
                elif isinstance(child, ast.Call) and _call_name(child) == name:
                    key = f"{path}:{'.'.join(scope) or '<module>'}"
                    found.setdefault(key, []).append(f"{path}:{child.lineno}")
                visit(child, inner)

        visit(tree, [])
    return found


def test_one_function_assembles_a_model():
    callers = {name: _callers(name) for name in ASSEMBLY_CALLS}
    where = "\n  ".join(
        f"{name}(...) at {site}" for name, by in callers.items() for sites in by.values() for site in sites
    )
    functions = set().union(*(set(by) for by in callers.values()))
    assert len(functions) == 1 and all(len(by) == 1 for by in callers.values()), (
        f"{' and '.join(ASSEMBLY_CALLS)} must be called by exactly one function in pagedllm/ (the one "
        f"model assembly, model/build.py's load_model_for_inference); called from {len(functions)}:\n  "
        + (where or "nowhere")
    )


# -- (d) the docs cite what exists ---------------------------------------------------------------------

CODE_EXT = r"(?:py|h|cpp)"
# not inside a longer path or word: `~/.cache/pagedllm/kernels` is no module path
_START = r"(?<![\w/.~-])"
PKG_PATH = re.compile(_START + r"pagedllm/[\w/.-]*[\w/]")
DOTTED = re.compile(_START + r"pagedllm(?:\.\w+)+")
REL_FILE = re.compile(_START + r"(?:[\w-]+/)+[\w-]+\." + CODE_EXT + r"\b")
BARE_FILE = re.compile(_START + r"[\w-]+\." + CODE_EXT + r"\b(?!/)")
BACKTICKED_DIR = re.compile(r"`((?:[\w-]+/)+)`")
MD_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
NOT_FILES = {"llama.cpp"}  # a project's name, not a file


@cache
def _repo_files() -> list[str]:
    """Every file and folder of the repository (posix, repo-relative; folders end in /), hidden folders
    (.git, .venv), caches and build metadata left out."""
    out = []
    for top, dirs, files in os.walk(REPO):
        dirs[:] = sorted(
            d for d in dirs if not d.startswith(".") and d != "__pycache__" and "egg-info" not in d
        )
        rel = Path(top).relative_to(REPO).as_posix()
        prefix = "" if rel == "." else rel + "/"
        out += [f"{prefix}{d}/" for d in dirs] + [prefix + f for f in sorted(files)]
    return out


def _exists_path(text: str, under: str = "") -> bool:
    """A path cited in prose: from the repo root, from pagedllm/ (or `under`), or the tail of a real path
    (`csrc/greedy.cpp` is pagedllm/worker/csrc/greedy.cpp)."""
    if (REPO / text).exists() or (PKG / text).exists():
        return True
    return any(f.startswith(under) and (f == text or f.endswith("/" + text)) for f in _repo_files())


def _module_exists(dotted: str) -> bool:
    """`pagedllm.a.b` is a module or package, or a name a module defines (`pagedllm.ops.kernel`)."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        base = REPO.joinpath(*parts[:n])
        module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if module.is_file():
            if n == len(parts):
                return True
            rest = parts[n]
            if (base / rest).is_dir() or (base / f"{rest}.py").is_file():
                return True
            return rest in _top_level_names(module)
    return False


@cache
def _top_level_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _readme_architecture() -> tuple[list[str], int]:
    """The README's `## Architecture` section (to the next `## `) and the line number it starts on."""
    lines = (REPO / "README.md").read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if re.match(r"##\s+Architecture\b", line)), None)
    assert start is not None, "README.md has no `## Architecture` section"
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end], start + 1


def _map_folder(line: str, folder: str | None) -> str | None:
    """In the indented package map (`    pagedllm/` then entries at a deeper indent), the folder an entry
    line belongs to: `      engine/  llm_engine.py, ...` -> pagedllm/engine/; continuation lines keep it."""
    if line.strip() == "pagedllm/":
        return "pagedllm/"
    if folder is None or not line.startswith("    "):
        return None
    head = line.strip().split()[0] if line.strip() else ""
    indent = len(line) - len(line.lstrip())
    if indent <= 6 and head:  # an entry: a folder of pagedllm/ or a top-level module
        return f"pagedllm/{head}" if head.endswith("/") else "pagedllm/"
    return folder


def _check_doc(path: Path, lines: list[str], first_line: int) -> list[str]:
    bad: list[str] = []
    folder: str | None = None
    for offset, line in enumerate(lines):
        where = f"{_rel(path)}:{first_line + offset}"
        folder = _map_folder(line, folder)
        for m in PKG_PATH.finditer(line):
            if not (REPO / m.group(0)).exists():
                bad.append(f"{where}: {m.group(0)} does not exist")
        for m in DOTTED.finditer(line):
            if not _module_exists(m.group(0)):
                bad.append(f"{where}: {m.group(0)} is no module (nor a name one defines)")
        for m in REL_FILE.finditer(line):
            text = m.group(0)
            if text.startswith("pagedllm/"):
                continue
            if not _exists_path(text, under=folder or ""):
                bad.append(f"{where}: {text} does not exist" + (f" under {folder}" if folder else ""))
        for m in BARE_FILE.finditer(line):
            text = m.group(0)
            if text in NOT_FILES:
                continue
            # in the map: a file of that entry's folder (or one below it); elsewhere: some file of the repo,
            # pagedllm/ first (`ops.py` is pagedllm/ops.py)
            scope = folder or ""
            hits = [f for f in _repo_files() if f.startswith(scope) and f.rsplit("/", 1)[-1] == text]
            if not hits:
                bad.append(f"{where}: {text} does not exist" + (f" under {folder}" if folder else ""))
        for m in BACKTICKED_DIR.finditer(line):
            if not _exists_path(m.group(1), under=folder or ""):
                bad.append(f"{where}: {m.group(1)} does not exist")
        for m in MD_LINK.finditer(line):
            target = m.group(1)
            if "://" not in target and not (path.parent / target).exists():
                bad.append(f"{where}: link {target} does not exist")
    return bad


def test_docs_cite_modules_that_exist():
    arch = REPO / "docs" / "architecture.md"
    bad = _check_doc(arch, arch.read_text().splitlines(), 1)
    section, start = _readme_architecture()
    bad += _check_doc(REPO / "README.md", section, start)
    assert not bad, "the docs cite what is not there:\n  " + "\n  ".join(bad)


def test_the_map_has_every_package_and_top_level_module():
    """docs/architecture.md's package map has an entry for every package and module directly under pagedllm/
    (an entry line: `      ops.py   ...` or `      engine/   ...`)."""
    path = REPO / "docs" / "architecture.md"
    entries, folder = set(), None
    for line in path.read_text().splitlines():
        folder = _map_folder(line, folder)
        if folder is not None and line.strip() != "pagedllm/" and len(line) - len(line.lstrip()) <= 6:
            entries.add(line.split()[0])
    wanted = {p.name for p in PKG.glob("*.py")} | {
        f"{p.name}/" for p in PKG.iterdir() if (p / "__init__.py").is_file()
    }
    missing = sorted(wanted - entries)
    assert entries, f"{_rel(path)} has no package map (an indented block starting `    pagedllm/`)"
    assert not missing, f"{_rel(path)}'s package map has no entry for: {', '.join(missing)}"
    stale = sorted(e for e in entries if not (PKG / e).exists())
    assert not stale, f"{_rel(path)}'s package map has entries for what is gone: {', '.join(stale)}"


def test_the_doc_check_sees_a_wrong_citation():
    """The check itself: made-up paths, names and map entries are caught, real ones are not."""
    doc = REPO / "docs" / "architecture.md"
    lines = [
        "`pagedllm/ops.py`, pagedllm.ops.backend, pagedllm.executor.worker, `ops.py`, model/build.py",
        "`pagedllm/nowhere.py`, pagedllm.ops.no_such_name, `no_such_file.py`, quantization/checkpoint.py",
        "    pagedllm/",
        "      ops.py                 the op table",
        "      quantization/          linear.py, csrc/woq_amx.h, checkpoint.py",
        "                             build.py",
    ]
    bad = _check_doc(doc, lines, 1)
    assert [b.split(": ", 1)[1] for b in bad] == [
        "pagedllm/nowhere.py does not exist",
        "pagedllm.ops.no_such_name is no module (nor a name one defines)",
        "quantization/checkpoint.py does not exist",
        "no_such_file.py does not exist",
        "checkpoint.py does not exist under pagedllm/quantization/",
        "build.py does not exist under pagedllm/quantization/",
    ], bad
    assert bad[0].startswith("docs/architecture.md:2: ")
