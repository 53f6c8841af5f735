"""No import cycles in the package: the module-level imports form no cycle, and the model side
(drafters, the TTT objective, decoding, diagnostics) imports no kvshot module inside a function,
the usual way a cycle hides. The trainer's forward is `ttt.TTTUnroll`, so the drafters load
without the training objective."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from .conftest import REPO

PACKAGE = REPO / "src" / "kvshot"
MODEL_SIDE = [*sorted((PACKAGE / "drafters").glob("*.py")), PACKAGE / "ttt.py", PACKAGE / "decode.py",
              PACKAGE / "diagnostics.py"]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(module: str, node: ast.Import | ast.ImportFrom, is_package: bool) -> set[str]:
    """The kvshot modules an import statement runs (a submodule's parent packages too, except
    the packages the importing module is itself inside: they are already running)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = module if is_package else module.rsplit(".", 1)[0]
        for _ in range(max(node.level - 1, 0)):
            base = base.rsplit(".", 1)[0]
        target = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
        names = [target] + [f"{target}.{a.name}" for a in node.names]
    out = set()
    for name in names:
        parts = name.split(".")
        out |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return {m for m in out if m.startswith("kvshot") and not f"{module}.".startswith(f"{m}.")}


def module_level_graph() -> dict[str, set[str]]:
    files = {module_name(f): f for f in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        deps: set[str] = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
                continue
            for sub in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    deps |= imported(name, sub, path.name == "__init__.py")
        graph[name] = {d for d in deps if d in files and d != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}   # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_module_level_imports_form_no_cycle():
    graph = module_level_graph()
    assert "kvshot.drafters.skeleton" in graph and "kvshot.ttt" in graph["kvshot.train"]   # the graph is real
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
    assert find_cycle({**graph, "kvshot.drafters.skeleton": graph["kvshot.drafters.skeleton"] | {"kvshot.ttt"}})


def test_the_model_side_imports_no_kvshot_module_inside_a_function():
    hidden = []
    for path in MODEL_SIDE:
        name = module_name(path)
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                hidden += [f"{path.name}:{n.lineno}" for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))
                           and imported(name, n, path.name == "__init__.py")]
    assert not hidden, hidden


def test_the_drafters_load_without_the_training_objective():
    code = "import sys, kvshot.drafters.skeleton, kvshot.drafters; print(sorted(m for m in sys.modules if m == 'kvshot.ttt'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_no_import_cycle_even_through_imports_inside_functions():
    """Lazy imports (kept for start-up time) must not hide a cycle either: the graph of every
    import statement, wherever it sits, has none (config <-> checks and chat <-> data had one)."""
    files = {module_name(f): f for f in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                deps |= imported(name, node, path.name == "__init__.py")
        graph[name] = {d for d in deps if d in files and d != name}
    assert "kvshot.drafters" in graph["kvshot.stepwise"]   # function-level edges are in the graph
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
