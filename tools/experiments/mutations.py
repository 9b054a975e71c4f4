"""Mutation check of the planner's and simulator's tests: each mutation, applied alone,
must make the test that claims it fail.

    python tools/experiments/mutations.py              # the unmutated tests pass, then every mutation
    python tools/experiments/mutations.py kv_batch     # only the mutations named

Each mutation names a function ("module:Qualified.name") and one exact text edit inside that
function's source, found with ast wherever the function sits in its file: moving code around
(or the same text elsewhere in the file) does not stale the audit, renaming or moving the
function to another module does, and says so. The file is written in place and restored
afterwards (also on an error or Ctrl-C): run it on a clean tree and never commit what it leaves.
The first six pin the main cost terms; the rest pin the other cost terms the hand tests check.
Exit status 0 when every test passes unmutated and every mutation fails its test.
"""

import argparse
import ast
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Mutation:
    name: str
    function: str  # "package.module:Class.method" or "package.module:function"
    old: str  # exact text, found once in that function's source
    new: str
    tests: tuple[str, ...]  # pytest node ids that must fail

    @property
    def path(self) -> Path:
        """The module's file under the repository root."""
        return ROOT / (self.function.split(":")[0].replace(".", "/") + ".py")

    @property
    def qualname(self) -> str:
        return self.function.split(":")[1]


TRAIN, ROLLOUT = "hexrl.plan.cost_train:TrainCost.", "hexrl.plan.cost_rollout:RolloutCost."
SIM, LENGTHS = "hexrl.plan.simulate:", "hexrl.plan.lengths:"
HAND = "tests/test_simulate.py::test_synchronous_step_matches_hand_computation"
MUTATIONS = [
    Mutation("prefill_attention_x0.5", ROLLOUT + "prefill_s", "self.attn_flops_per_pos() * context\n",
             "self.attn_flops_per_pos() * context * 0.5\n",
             (HAND, "tests/test_bench_tools.py::test_calibration_recovers_known_efficiencies",
              "tests/test_plan_cost.py::test_prefill_prices_linears_and_causal_attention")),
    Mutation("kv_batch_is_1", ROLLOUT + "max_decode_batch",
             "return int(min(self.decode_batch_cap, room // (kv * self.w.ctx_decode)))",
             "return 1", ("tests/test_plan_cost.py::test_kv_capacity_fits_memory",)),
    Mutation("decode_attention_x2", ROLLOUT + "decode_coeffs",
             "c = max(self.kv_bytes_per_token(tp) / bw, self.attn_flops_per_pos() / peak)",
             "c = 2 * max(self.kv_bytes_per_token(tp) / bw, self.attn_flops_per_pos() / peak)",
             (HAND, "tests/test_plan_cost.py::test_decode_attention_reads_the_kv_cache",
              "tests/test_plan_cost.py::test_decode_attention_flops_bind_with_one_kv_head")),
    Mutation("expected_max_x1.04", LENGTHS + "LengthDist.expected_max", "return out\n", "return out * 1.04\n",
             ("tests/test_plan_lengths.py::test_expected_max_against_a_monte_carlo_and_the_tail_sum",)),
    Mutation("slowest_of_m_sqrt_0.5_ln_m", ROLLOUT + "_one_wave", "sd * math.sqrt(2 * math.log(m))",
             "sd * math.sqrt(0.5 * math.log(m))",
             ("tests/test_plan_wave.py::test_the_slowest_replica_against_a_monte_carlo_of_its_draws",)),
    Mutation("controller_work_x0.01", SIM + "Simulation.arrive", "self.control_debt += work\n",
             "self.control_debt += work * 0.01\n",
             ("tests/test_simulate.py::test_controller_work_takes_the_trainers_core_only_while_it_trains_and_shares_it",)),
    # beyond the table: the other terms the hand tests pin
    Mutation("decode_weights_read_x0.5", ROLLOUT + "decode_fixed_s", "np.maximum(2 * n / tp / bw,",
             "np.maximum(n / tp / bw,",
             (HAND, "tests/test_plan_cost.py::test_decode_reads_the_weights_once_and_multiplies_them_per_sequence")),
    Mutation("kv_not_replicated_past_kv_heads", ROLLOUT + "kv_bytes_per_token",
             "self.m.kv_bytes_per_token() / min(tp, self.m.num_key_value_heads)",
             "self.m.kv_bytes_per_token() / tp",
             ("tests/test_plan_cost.py::test_decode_attention_reads_the_kv_cache",
              "tests/test_plan_cost.py::test_kv_capacity_fits_memory")),
    Mutation("train_without_proximal_forward", TRAIN + "_passes", "return 3 + self.w.extra_fwd + int(recompute)",
             "return 3 + int(recompute)", (HAND, "tests/test_plan_cost.py::test_training_flops_and_time_by_hand")),
    Mutation("train_attention_x0.5", TRAIN + "__init__", "4 * q_dim * w.ctx_attn", "2 * q_dim * w.ctx_attn",
             (HAND, "tests/test_plan_cost.py::test_training_flops_and_time_by_hand",
              "tests/test_bench_tools.py::test_calibration_recovers_known_efficiencies")),
]


def function_span(source: str, qualname: str) -> tuple[int, int] | None:
    """(start, end) character offsets of the function `qualname` ("Class.method" or "function")
    in `source`, decorators excluded; None if there is no such function."""
    body, node = ast.parse(source).body, None
    for part in qualname.split("."):
        node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == part), None)
        if node is None:
            return None
        body = node.body
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    starts = [0]  # character offset of each line
    for line in source.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    return starts[node.lineno - 1], starts[node.end_lineno]


def mutate(source: str, qualname: str, old: str, new: str) -> str:
    """`source` with `old` replaced by `new` inside function `qualname`; ValueError (saying why)
    unless the function exists and holds `old` exactly once."""
    span = function_span(source, qualname)
    if span is None:
        raise ValueError(f"no function {qualname}")
    start, end = span
    n = source[start:end].count(old)
    if n != 1:
        raise ValueError(f"the text to mutate occurs {n} times in {qualname}, not once")
    return source[:start] + source[start:end].replace(old, new) + source[end:]

def pytest_run(test: str) -> tuple[bool, str]:
    """(passed, the first assertion line of its failure, or its last line) for one test id."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout=900", test],
                         cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    lines = out.stdout.splitlines()
    first = next((l.strip() for l in lines if l.startswith("E ")), lines[-1] if lines else out.stderr.strip())
    return out.returncode == 0, first


def stale_mutations(mutations: list[Mutation]) -> list[str]:
    """One line per mutation that no longer applies: its module or function is gone, or its text
    does not occur exactly once in the function."""
    lines = []
    for m in mutations:
        if not m.path.exists():
            lines.append(f"{m.name}: no module file {m.path.relative_to(ROOT)} for {m.function}")
            continue
        try:
            mutate(m.path.read_text(), m.qualname, m.old, m.new)
        except ValueError as e:
            lines.append(f"{m.name}: {m.path.relative_to(ROOT)}: {e}")
    return lines


def apply(m: Mutation) -> str:
    """Write the mutation; returns the file's original text (to restore)."""
    text = m.path.read_text()
    m.path.write_text(mutate(text, m.qualname, m.old, m.new))
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", help="mutations to run (default: all)")
    args = p.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.names or m.name in args.names]
    stale = stale_mutations(chosen)
    if stale:  # the code moved on: say so before spending minutes on tests
        raise SystemExit("\n".join(stale))
    ok = True
    for test in dict.fromkeys(t for m in chosen for t in m.tests):  # unmutated, every test passes
        passed, line = pytest_run(test)
        ok &= passed
        print(f"unmutated  {'pass' if passed else 'FAIL: ' + line}  {test}", flush=True)
    for m in chosen:
        print(f"\n{m.name}: {m.function}: {m.old.strip()!r} -> {m.new.strip()!r}", flush=True)
        original = apply(m)
        try:
            for test in m.tests:
                passed, line = pytest_run(test)
                ok &= not passed
                print(f"  {'SURVIVED' if passed else 'fails'}  {test}\n      {line}", flush=True)
        finally:
            m.path.write_text(original)
    print("\nevery mutation fails its tests" if ok else
          "\nNOT every mutation fails its tests (or a test fails unmutated)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
