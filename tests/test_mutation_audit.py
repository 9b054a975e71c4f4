"""The mutation audit (tools/experiments/mutations.py) must stay runnable: every mutation's
function still exists, holds its text exactly once, and every test it names still exists. Running the
mutations themselves takes minutes; this only keeps the audit from rotting as the code moves."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("mutations", ROOT / "tools" / "experiments" / "mutations.py")
mutations = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mutations)


def test_every_mutation_still_applies_once():
    assert mutations.stale_mutations(mutations.MUTATIONS) == []


def test_every_named_test_still_exists():
    missing = []
    for m in mutations.MUTATIONS:
        for node in m.tests:
            path, name = node.split("::")
            if f"def {name}(" not in (ROOT / path).read_text():
                missing.append(f"{m.name}: {node}")
    assert missing == []


SOURCE = """def first():
    return x + 1


class Model:
    @property
    def second(self):
        return x + 1
"""


def test_a_mutation_edits_its_function_wherever_it_sits():
    """The same text in another function does not count, and moving the function keeps it found."""
    in_method = ("        return x + 1", "        return x + 2")  # the method's line, not first()'s
    assert mutations.mutate(SOURCE, "Model.second", "x + 1", "x + 2") == SOURCE.replace(*in_method)
    moved = SOURCE[SOURCE.index("class"):] + "\n\n" + SOURCE[:SOURCE.index("class")]
    assert mutations.mutate(moved, "Model.second", "x + 1", "x + 2") == moved.replace(*in_method)


def test_a_mutation_names_what_went_stale():
    with pytest.raises(ValueError, match="no function Model.third"):
        mutations.mutate(SOURCE, "Model.third", "x + 1", "x + 2")
    with pytest.raises(ValueError, match="occurs 0 times in first"):
        mutations.mutate(SOURCE, "first", "x + 3", "x + 2")
