"""What torchrun prints last about a failed rank (its summary, read from torch elastic's error file):
hexrl's message for a deliberate refusal, the traceback for a bug (hexrl/runtime/errors.py)."""
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from hexrl.runtime import errors


def torchrun_summary(error_file) -> str:
    """The box torchrun prints when worker 0 exits 1 having written `error_file` (torch's own formatting)."""
    failure = ProcessFailure(local_rank=0, pid=1234, exitcode=1, error_file=str(error_file))
    return ChildFailedError("hexrl.main", {0: failure}).format_msg()


def test_a_refusal_is_what_torchrun_prints_last(tmp_path, monkeypatch):
    monkeypatch.setenv(errors.ERROR_FILE_ENV, str(tmp_path / "error.json"))
    errors.record_message("hexrl.main (rank 0): WORLD_SIZE=2 but the plan has 3 ranks")
    errors.record_message("a later message")  # the first failure is the one reported
    summary = torchrun_summary(tmp_path / "error.json")
    assert "traceback : hexrl.main (rank 0): WORLD_SIZE=2 but the plan has 3 ranks" in summary
    assert "a later message" not in summary and "To enable traceback" not in summary


def test_a_bug_still_shows_its_traceback(tmp_path, monkeypatch):
    monkeypatch.setenv(errors.ERROR_FILE_ENV, str(tmp_path / "error.json"))

    def buggy():
        return {}["missing"]

    try:
        buggy()
    except KeyError as e:
        errors.record_traceback(e)
    summary = torchrun_summary(tmp_path / "error.json")
    assert "Traceback (most recent call last)" in summary and "in buggy" in summary and "KeyError" in summary


def test_outside_torchrun_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv(errors.ERROR_FILE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    errors.record_message("no file")
    assert list(tmp_path.iterdir()) == []
