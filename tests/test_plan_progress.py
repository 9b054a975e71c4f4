"""Progress of a long plan: the phase and how far along, on stderr, only where someone watches.

    progress = Progress()                  # enabled when stderr is a terminal
    plan_job(job, progress=progress); progress.close()
"""

import io
import json

from test_plan import hetero_job, write

from hexrl.plan.__main__ import main
from hexrl.plan.planner import plan_job
from hexrl.plan.progress import AFTER_S, Progress
from hexrl.schema import load_job


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_quiet_at_first_then_phase_and_count_then_a_newline():
    now = [0.0]
    out = Terminal()
    p = Progress(out, clock=lambda: now[0])
    p("sweeping splits", 10, 400)
    assert out.getvalue() == ""  # a short plan prints nothing
    now[0] = AFTER_S + 1
    p("sweeping splits", 120, 400)
    assert "planning: sweeping splits 120/400" in out.getvalue()
    p("sweeping splits", 121, 400)  # too soon after the last line: skipped
    assert "121/400" not in out.getvalue()
    now[0] += 1
    p("bisecting the training share", 3, 16)
    assert out.getvalue().count("\r") == 2 and "bisecting the training share 3/16" in out.getvalue()
    p.close()
    assert out.getvalue().endswith("\n")


def test_quiet_when_not_a_terminal_or_turned_off():
    now = [0.0]
    for out, enabled in ((io.StringIO(), None), (Terminal(), False)):  # a pipe or log file; --json
        p = Progress(out, enabled, clock=lambda: now[0])
        now[0] += AFTER_S + 1
        p("sweeping splits", 1, 2)
        p.close()
        assert out.getvalue() == ""


def test_the_search_reports_its_phases():
    seen = []
    plan_job(load_job(hetero_job()), progress=lambda phase, done, total: seen.append((phase, done, total)))
    phases = {phase for phase, _, _ in seen}
    assert {"initial split", "bisecting the training share", "sweeping splits"} <= phases
    assert all(0 <= done <= total for phase, done, total in seen if total)


def test_cli_json_prints_the_predictions_and_nothing_on_stderr(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main([write(tmp_path, hetero_job()), "-o", str(out), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["step_time_s"] > 0 and captured.err == ""
    assert json.loads(out.read_text())["predicted"] == json.loads(captured.out)
