"""The house's shape: no import cycles (late imports included) in hexrl/, kernels/ or tools/, a short top
level, one meaning of `ctx`, the torch.distributed store helpers usable without ZeroMQ, and tools/ depending
on the package, never the reverse, with no edits of sys.path anywhere."""
import ast
import configparser
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hexrl"
TOOLS = ROOT / "tools"  # a package too: its scripts import each other as tools.bench.bench_rollout
CODE_DIRS = [PACKAGE, ROOT / "kernels", TOOLS]


def module_names() -> dict[str, Path]:
    """Module name -> file, for every module of hexrl/, kernels/ and tools/ (dotted, packages by their
    __init__.py)."""
    out = {}
    for path in (p for folder in CODE_DIRS for p in folder.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported_names(name: str, path: Path) -> set[str]:
    """Every module name the file of module `name` imports, absolute, anywhere in it (inside functions too,
    and under TYPE_CHECKING); `from a import b` gives a and a.b."""
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
    return found


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules that `name` imports anywhere in its file, with each package whose __init__ such an
    import runs, except its own packages."""
    out = set()
    for imported in imported_names(name, path):
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
    assert "tools.experiments.learning_run" in graph["tools.experiments.staleness_study"]  # a tool importing a tool
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


# ----------------------------------------------------------------------------- tools depend on the package


def tools_imported(name: str, path: Path) -> set[str]:
    """What module `name` imports from tools/ (the package `tools` and anything under it)."""
    return {i for i in imported_names(name, path) if i == "tools" or i.startswith("tools.")}


def test_the_package_never_imports_tools(tmp_path):
    example = tmp_path / "planner.py"
    example.write_text("def f():\n    from tools.bench.bench_rollout import SHAPES\n")
    assert "tools.bench.bench_rollout" in tools_imported("hexrl.plan.planner", example)
    found = {name: tools_imported(name, path) for name, path in module_names().items()
             if not name.startswith("tools")}
    assert {name: hit for name, hit in found.items() if hit} == {}


SYS_PATH_EDITS = {"insert", "append", "extend", "remove", "pop", "clear"}


def path_edits(source: str) -> list[int]:
    """Lines of `source` that edit the import path: sys.path's methods, assignments to it or its items,
    site.addsitedir, and pytest's monkeypatch.syspath_prepend (allowed only for the test's own tmp_path: a
    user's module, imported by name as a job names it)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner, method = ast.unparse(node.func.value), node.func.attr
            if (owner == "sys.path" and method in SYS_PATH_EDITS) or (owner, method) == ("site", "addsitedir") or (
                    method == "syspath_prepend" and "tmp_path" not in ast.unparse(node.args[0])):
                lines.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                target = target.value if isinstance(target, ast.Subscript) else target
                if ast.unparse(target) == "sys.path":
                    lines.append(node.lineno)
    return sorted(lines)


def test_path_edits_are_found():
    edits = ["sys.path.insert(0, 'tools')", "sys.path.append(ROOT)", "sys.path[:0] = [ROOT]", "sys.path += [ROOT]",
             "sys.path = [ROOT]", "site.addsitedir(ROOT)", "monkeypatch.syspath_prepend(str(ROOT / 'tools'))"]
    assert path_edits("\n".join(edits)) == list(range(1, len(edits) + 1))
    reads = ["print(sys.path)", "first = sys.path[0]", "monkeypatch.syspath_prepend(str(tmp_path))"]
    assert path_edits("\n".join(reads)) == []


def test_nothing_edits_sys_path():
    """Tools and tests import the package as installed and tools as the package `tools` from the repository's
    root (pytest.ini), so no file of the package, kernels, tools or tests edits the import path."""
    edits = [f"{path.relative_to(ROOT)}:{line}" for folder in [*CODE_DIRS, ROOT / "tests"]
             for path in sorted(folder.rglob("*.py")) for line in path_edits(path.read_text())]
    assert edits == []


def pythonpath(ini_text: str) -> list[str]:
    """The folders a pytest.ini puts on sys.path."""
    config = configparser.ConfigParser()
    config.read_string(ini_text)
    return config.get("pytest", "pythonpath", fallback="").split()


def test_pytest_ini_puts_no_folder_on_the_path():
    """Tests reach tools' scripts as `tools.bench.bench_rollout`, not by file name through pytest's pythonpath."""
    assert pythonpath("[pytest]\ntestpaths = tests\npythonpath = tools tools/bench\n") == ["tools", "tools/bench"]
    assert pythonpath((ROOT / "pytest.ini").read_text()) == []
