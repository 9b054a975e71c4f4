"""The house's shape: hexrl's packages import only down the order of LAYERS, no import cycles (late and
type-level imports included) in hexrl/, kernels/ or tools/, no file name used twice in hexrl/, a short
top level, one meaning of `ctx`, the torch.distributed store helpers usable without ZeroMQ, and tools/
depending on the package, never the reverse, with no edits of sys.path anywhere."""
import ast
import configparser
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

from hexrl.runtime.context import RankContext

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hexrl"
# The one statement of hexrl's layering: its packages and top-level modules, bottom to top. A module
# may import from its own unit and from the tiers below its own, never from a peer in its tier or
# from above; imports inside functions and under TYPE_CHECKING count the same.
LAYERS = [
    ["kernels", "hexrl.ranges", "hexrl.input_files", "hexrl.gpus", "hexrl.trajectory"],  # leaves
    ["hexrl.rewards"],  # reward functions and the worker pool that runs them
    ["hexrl.envs"],  # multi-turn environments (their calls run in the reward pool's workers)
    ["hexrl.data"],  # problems, datasets, tokenizers, the prompts a run can use
    ["hexrl.model"],  # the HF config parser (torch-free), the decoder, HF checkpoint I/O
    ["hexrl.schema"],  # job.json and plan.json (torch-free: the planner runs without torch)
    ["hexrl.runtime"],  # around every role's loop: RankContext, watchdog, collective rules, pinning
    ["hexrl.comm"],  # messages between ranks, and the trainer -> rollout weight sync
    ["hexrl.control"],  # the controller: staleness gate, dispatch, replay buffer, metrics
    ["hexrl.rollout", "hexrl.train"],  # the two roles
    ["hexrl.preflight", "hexrl.generate"],  # the input checks before launch; sampling from a checkpoint
    ["hexrl.plan", "hexrl.main"],  # the two commands: plan a job (and simulate it), run a plan
]
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


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """hexrl modules that `name` imports anywhere in its file (inside functions too, and under
    TYPE_CHECKING), with each package whose __init__ such an import runs, except its own packages."""
    return imports_in(path.read_text(), name, path.name == "__init__.py", modules)


def imported_names(source: str, name: str, is_package: bool) -> set[str]:
    """Every module name the source of module `name` imports, absolute, anywhere in it (inside functions
    too, and under TYPE_CHECKING); `from a import b` gives a and a.b (`is_package`: a package's __init__)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = node.module
            if node.level > 0:  # relative: from .x import y, from . import x
                base = name.rsplit(".", node.level - is_package)[0]
                module = f"{base}.{node.module}" if node.module else base
            if module:
                found.add(module)
                found |= {f"{module}.{a.name}" for a in node.names}  # a name may be a submodule
    return found


def imports_in(source: str, name: str, is_package: bool, modules: dict[str, Path]) -> set[str]:
    """`imports_of` for the source text of module `name` (`is_package`: it is a package's __init__)."""
    out = set()
    for imported in imported_names(source, name, is_package):
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


def unit_of(module: str) -> str | None:
    """The LAYERS entry `module` belongs to (itself or its package), or None."""
    units = [u for tier in LAYERS for u in tier if module == u or module.startswith(u + ".")]
    return max(units, key=len) if units else None


def layer_problems(graph: dict[str, set[str]], layers: list[list[str]], unit=unit_of) -> list[str]:
    """Every import of `graph` that points up `layers` or across a tier, and every module of the
    graph in no layer, one line each."""
    tier = {u: i for i, names in enumerate(layers) for u in names}
    out = [f"{m} is in no layer of LAYERS" for m in sorted(graph) if unit(m) is None]
    for module in sorted(graph):
        for imported in sorted(graph[module]):
            a, b = unit(module), unit(imported)
            if a is not None and b is not None and a != b and tier[b] >= tier[a]:
                where = "a peer in its tier" if tier[b] == tier[a] else "up the order"
                out.append(f"{module} imports {imported}: {where}")
    return out


def package_graph() -> dict[str, set[str]]:
    """The import graph of hexrl/ and kernels/ (tools/ stands above the package), the root package left out."""
    modules = {n: p for n, p in module_names().items() if n.split(".")[0] in ("hexrl", "kernels") and n != "hexrl"}
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def test_no_import_cycles_even_through_late_imports():
    modules = module_names()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert "hexrl.data.datasets" in graph["hexrl.preflight"]  # the walk sees real imports
    assert "kernels.sampling_split" in graph["kernels.sampling"]
    assert "tools.experiments.learning_run" in graph["tools.experiments.staleness_study"]  # a tool importing a tool
    assert cycles(graph) == []


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_packages_import_only_down_the_order():
    graph = package_graph()
    assert "hexrl.train.checkpoint" in graph["hexrl.preflight"]  # an in-function import counts
    assert "hexrl.model.rotary" in graph["hexrl.model.ops"]  # so does one under TYPE_CHECKING
    assert layer_problems(graph, LAYERS) == []


def test_the_walk_sees_late_type_level_and_relative_imports():
    source = """
from typing import TYPE_CHECKING
from . import ops
from .config import ModelConfig
if TYPE_CHECKING:
    from hexrl.train.trainer import Trainer
def f():
    import hexrl.schema.job
"""
    modules = {m: Path() for m in ["hexrl.model.ops", "hexrl.model.config", "hexrl.train.trainer",
                                   "hexrl.train", "hexrl.schema", "hexrl.schema.job", "hexrl.model"]}
    assert imports_in(source, "hexrl.model.decoder", False, modules) == {
        "hexrl.model.ops", "hexrl.model.config", "hexrl.train", "hexrl.train.trainer", "hexrl.schema",
        "hexrl.schema.job"}


def test_layer_check_names_imports_up_the_order_across_a_tier_and_outside_the_order():
    layers = [["low"], ["mid", "peer"], ["top"]]

    def unit(m):
        return m.split(".")[0] if m.split(".")[0] in ("low", "mid", "peer", "top") else None

    graph = {"low.a": {"mid.b"}, "mid.b": {"low.a", "mid.c", "peer"}, "mid.c": set(), "peer": set(),
             "top": {"mid.b", "low.a"}, "stray": set()}
    assert layer_problems(graph, layers, unit) == [
        "stray is in no layer of LAYERS",
        "low.a imports mid.b: up the order",
        "mid.b imports peer: a peer in its tier",
    ]


def test_every_package_is_placed_once_in_the_order():
    units = [u for tier in LAYERS for u in tier]
    assert len(units) == len(set(units))
    on_disk = {p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"} | {
        p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert sorted(u.removeprefix("hexrl.") for u in units if u.startswith("hexrl.")) == sorted(on_disk)


def repeated_file_names(paths: list[Path]) -> dict[str, list[str]]:
    """File name -> the paths that share it, for names held by more than one file (package markers aside)."""
    by_name: dict[str, list[str]] = {}
    for path in paths:
        if path.name not in ("__init__.py", "__main__.py"):
            by_name.setdefault(path.name, []).append(path.as_posix())
    return {name: sorted(found) for name, found in by_name.items() if len(found) > 1}


def test_no_two_modules_share_a_file_name():
    """A file's name says what it holds, so `pool.py` in two packages would mean two things."""
    assert repeated_file_names([p.relative_to(ROOT) for p in PACKAGE.rglob("*.py")]) == {}
    two_pools = [Path("hexrl/envs/pool.py"), Path("hexrl/rewards/pool.py"), Path("hexrl/a/__init__.py"),
                 Path("hexrl/b/__init__.py")]
    assert repeated_file_names(two_pools) == {"pool.py": ["hexrl/envs/pool.py", "hexrl/rewards/pool.py"]}


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


def test_rank_context_is_built_with_keywords():
    with pytest.raises(TypeError):
        RankContext(None, 0, 0, None, Path("run"), None, None, None, [], None, None, None, None)
    ctx = RankContext(plan=None, rank=3, local_rank=1, device=None, run_dir=Path("run"), resume=None, store=None,
                      layout=None, sync_groups=[], replica_group=None, watchdog=None, train_prompts=None,
                      heldout_prompts=None)
    assert (ctx.rank, ctx.local_rank, ctx.sync_ipc, ctx.secret) == (3, 1, False, b"")


def test_store_helpers_import_neither_zmq_nor_msgpack():
    code = "import sys, hexrl.comm.store; print(sorted({'zmq', 'msgpack'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ----------------------------------------------------------------------------- tools depend on the package


def tools_imported(name: str, path: Path) -> set[str]:
    """What module `name` imports from tools/ (the package `tools` and anything under it)."""
    return {i for i in imported_names(path.read_text(), name, path.name == "__init__.py")
            if i == "tools" or i.startswith("tools.")}


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


ISSUE_NUMBER = re.compile(r"\bissues?\s*#?\s*\d+", re.IGNORECASE)
STATEMENT_START = {tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING}


def issue_references(source: str) -> list[int]:
    """Lines of the comments and docstrings (strings standing alone as a statement) that name an issue
    number. A reader needs what the code does and why; the history belongs in docs/."""
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    lines = [t.start[0] for t in tokens if t.type == tokenize.COMMENT and ISSUE_NUMBER.search(t.string)]
    code = [t for t in tokens if t.type != tokenize.COMMENT]
    for before, tok, after in zip([None, *code], code, [*code[1:], None]):
        alone = (before is None or before.type in STATEMENT_START) and (
            after is None or after.type in (tokenize.NEWLINE, tokenize.ENDMARKER))
        if tok.type == tokenize.STRING and alone:
            lines += [tok.start[0] + tok.string[:m.start()].count("\n") for m in ISSUE_NUMBER.finditer(tok.string)]
    return sorted(set(lines))


def test_issue_references_are_found_in_comments_and_docstrings_only():
    source = ('"""Module (issue 47)."""\n'
              'x = 1  # see Issue #12\n'
              'def f():\n'
              '    """What f does.\n\n    Item 3 of issues 35."""  # a comment after it\n'
              '    return "issue 44"  # a string the code uses is not documentation\n'
              'class C:\n'
              '    # the issue tracker says what happened; no number here\n'
              '    y = "issue 9"\n')
    assert issue_references(source) == [1, 2, 6]


def test_no_comment_or_docstring_names_an_issue_number():
    """Comments and docstrings in the package, kernels, tools and tests say what the code does and why;
    study history and the issues behind a change go to docs/ (docs/README.md indexes it)."""
    found = [f"{path.relative_to(ROOT)}:{line}" for folder in [*CODE_DIRS, ROOT / "tests"]
             for path in sorted(folder.rglob("*.py")) for line in issue_references(path.read_text())]
    assert found == [], "comments and docstrings name issue numbers:\n" + "\n".join(found)
