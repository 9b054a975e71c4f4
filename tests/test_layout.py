"""The house's shape: hexrl's packages import only down the order of LAYERS, no import cycles (late and
type-level imports included) in hexrl/, kernels/ or tools/, no file name used twice in hexrl/, a short
top level, one meaning of `ctx`, and the torch.distributed store helpers usable without ZeroMQ."""
import ast
import subprocess
import sys
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
    return imports_in(path.read_text(), name, path.name == "__init__.py", modules)


def imports_in(source: str, name: str, is_package: bool, modules: dict[str, Path]) -> set[str]:
    """`imports_of` for the source text of module `name` (`is_package`: it is a package's __init__)."""
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
    assert "learning_run" in graph["staleness_study"]  # a tool importing a tool by file name
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
