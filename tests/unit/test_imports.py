"""The package's layers and no import cycles. Subpackages are ordered by pipeline stage and a
module imports only from its own subpackage or a lower layer; the module-level imports form no
cycle, and the model side (drafters and their unrolls, the objective, decoding, diagnostics)
imports no kvshot module inside a function, the usual way a cycle hides. The trainer's forward
is `drafters.unroll.TTTUnroll`, so the drafters load without the training objective."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from ..conftest import REPO

PACKAGE = REPO / "src" / "kvshot"
MODEL_SIDE = [*sorted((PACKAGE / "drafters").glob("*.py")), PACKAGE / "train" / "objective.py",
              PACKAGE / "evaluate" / "decode.py", PACKAGE / "train" / "diagnostics.py"]
# Lowest first. A unit is a subpackage, or the root's config modules (config, checks) as one.
LAYERS = [
    ["core"],                      # atomic files, progress, integrity, GGUF reader, taps, schedules
    ["config", "stats"],           # the validated config; intervals and tests
    ["data", "report"],            # conversations and tokenizer; tables, figures, verdicts
    ["capture"],                   # the target and its features
    ["drafters"],                  # the paradigms and their unrolls
    ["train"],                     # the one TTT trainer
    ["evaluate"],                  # step-wise and end-to-end evaluation
    ["interop"],                   # export to and import from published heads
    ["serve"],                     # the drafters in a serving engine (vLLM) beside the decoder
    ["paper_shapes"],              # the fake-tensor meter runs every stage's code
    ["cli"],                       # python -m kvshot
]
ROOT_UNITS = {"kvshot.config": "config", "kvshot.checks": "config", "kvshot.settings": "config", "kvshot.__main__": "cli", "kvshot": "cli"}


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


def unit_of(module: str) -> str:
    return ROOT_UNITS.get(module) or module.split(".")[1]


def rank_of(unit: str) -> int:
    return next(i for i, units in enumerate(LAYERS) if unit in units)


def all_imports_graph() -> dict[str, set[str]]:
    """Every import statement, wherever it sits (function-level ones too)."""
    files = {module_name(f): f for f in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                deps |= imported(name, node, path.name == "__init__.py")
        graph[name] = {d for d in deps if d in files and d != name}
    return graph


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, deps in graph.items():
        unit = unit_of(module)
        for dep in deps:
            dep_unit = unit_of(dep)
            if dep_unit != unit and rank_of(dep_unit) >= rank_of(unit):
                bad.append(f"{module} -> {dep}")
    return sorted(bad)


def test_every_module_imports_only_its_own_subpackage_or_a_lower_layer():
    graph = all_imports_graph()
    units = {unit_of(m) for m in graph}
    assert units == {u for layer in LAYERS for u in layer}, units   # every subpackage has a layer
    assert layer_violations(graph) == []
    # the check is real: evaluation reaching into training code is allowed, the reverse is not
    assert "kvshot.train.objective" in graph["kvshot.paper_shapes.shape_rules"]
    assert layer_violations({"kvshot.train.loop": {"kvshot.evaluate.stepwise"}}) == [
        "kvshot.train.loop -> kvshot.evaluate.stepwise"]
    assert layer_violations({"kvshot.report.claims": {"kvshot.data.sources"}})   # same layer, other unit


def test_the_report_imports_no_torch_of_its_own():
    """report/ reads results: no module in it imports torch or the model stack. (The sequence
    bootstrap it calls lives in stats/ and draws with torch's generator, so the intervals stay
    the ones every earlier run printed.)"""
    heavy = {"torch", "transformers", "accelerate", "safetensors", "datasets"}
    found = []
    for path in sorted((PACKAGE / "report").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            found += [f"{path.name}:{node.lineno} {n}" for n in names if n.split(".")[0] in heavy]
    assert found == []
    graph = all_imports_graph()
    assert not {d for m, deps in graph.items() if unit_of(m) == "report" for d in deps
                if unit_of(d) not in {"report", "core", "stats", "config"}}


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
    assert "kvshot.drafters.skeleton" in graph and "kvshot.drafters.unroll" in graph["kvshot.train.loop"]   # the graph is real
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
    assert find_cycle({**graph, "kvshot.drafters.skeleton": graph["kvshot.drafters.skeleton"] | {"kvshot.drafters.unroll"}})


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
    code = "import sys, kvshot.drafters.skeleton, kvshot.drafters; print(sorted(m for m in sys.modules if m == 'kvshot.drafters.unroll'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_no_import_cycle_even_through_imports_inside_functions():
    """Lazy imports (kept for start-up time) must not hide a cycle either: the graph of every
    import statement, wherever it sits, has none (config <-> checks and chat <-> data had one)."""
    graph = all_imports_graph()
    assert "kvshot.drafters" in graph["kvshot.evaluate.stepwise"]   # function-level edges are in the graph
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def workflow_imports() -> list[str]:
    """The kvshot modules the Snakefile and workflow/rules/*.smk import, at any indent (the rule
    helpers import inside functions that run while Snakemake parses the workflow)."""
    import re

    texts = [(REPO / "Snakefile").read_text(), *(p.read_text() for p in (REPO / "workflow/rules").glob("*.smk"))]
    return sorted({m.group(1) for t in texts for m in re.finditer(r"^\s*from (kvshot[\w.]*) import ", t, re.M)})


def test_the_workflow_imports_no_torch():
    """Every `snakemake` call (a dry run, each SLURM job's own Snakemake) parses the workflow:
    with torch and transformers behind one of its imports that cost ~5 s a call (measured: a
    smoke dry run 10.0 s -> 2.3 s). The rule helpers read plain data only."""
    modules = workflow_imports()
    assert {"kvshot.config", "kvshot.checks", "kvshot.interop.head_stage", "kvshot.train.launch"} <= set(modules)
    code = "import sys\n" + "".join(f"import {m}\n" for m in modules) + \
        "print(sorted(m for m in ('torch', 'transformers', 'kvshot.drafters') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"the workflow's imports {modules} load {out.strip()}"
