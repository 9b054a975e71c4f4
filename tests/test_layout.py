"""The house's shape: no import cycles (late imports included) in hexrl/, kernels/ or tools/, a short top
level, one meaning of `ctx`, and the torch.distributed store helpers usable without ZeroMQ."""
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hexrl"
# tools' scripts import each other by file name (their folders are on pytest's pythonpath, pytest.ini)
TOOL_DIRS = [ROOT / "tools", ROOT / "tools" / "bench", ROOT / "tools" / "experiments"]


def module_names() -> dict[str, Path]:
    """Module name -> file, for every module of hexrl/ and kernels/ (dotted, packages by their
    __init__.py) and every script of tools/ (by its file name, as they import each other)."""
    out = {}
    for path in [*PACKAGE.rglob("*.py"), *(ROOT / "kernels").rglob("*.py")]:
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for folder in TOOL_DIRS:
        out.update({path.stem: path for path in folder.glob("*.py")})
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """hexrl modules that `name` imports anywhere in its file (inside functions too, and under
    TYPE_CHECKING), with each package whose __init__ such an import runs, except its own packages."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level > 0:  # relative: from .x import y
            base = name.rsplit(".", node.level - (path.name == "__init__.py"))[0]
            found.add(f"{base}.{node.module}" if node.module else base)
    out = set()
    for imported in found:
        parts = imported.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in modules and prefix != name and not name.startswith(prefix + "."):
                out.add(prefix)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_even_through_late_imports():
    modules = module_names()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert "hexrl.data.datasets" in graph["hexrl.runtime.preflight"]  # the walk sees real imports
    assert "kernels.sampling_split" in graph["kernels.sampling"]
    assert "learning_run" in graph["staleness_study"]  # a tool importing a tool by file name
    assert cycles(graph) == []


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_top_level_holds_at_most_eight_modules():
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= 8, loose


def test_ctx_parameters_are_rank_contexts():
    """`ctx` names a RankContext and nothing else (not an autograd context, a zmq.Context, a length)."""
    wrong = []
    for path in [*PACKAGE.rglob("*.py"), *(ROOT / "kernels").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for arg in node.args.args + node.args.kwonlyargs:
                    if arg.arg == "ctx" and not (arg.annotation is not None
                                                 and ast.unparse(arg.annotation) == "RankContext"):
                        wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert wrong == []


def test_store_helpers_import_neither_zmq_nor_msgpack():
    code = "import sys, hexrl.comm.store; print(sorted({'zmq', 'msgpack'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_tests_reach_tools_through_pytest_ini_only():
    """Tests import tools' scripts by name through pytest.ini's pythonpath, never by editing sys.path."""
    edits = []
    for path in (ROOT / "tests").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            target = node.func.value if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) else None
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                target = (node.targets[0] if isinstance(node, ast.Assign) else node.target)
                target = target.value if isinstance(target, ast.Subscript) else None
            if target is not None and ast.unparse(target) == "sys.path":
                edits.append(f"{path.name}:{node.lineno}")
    assert edits == []
