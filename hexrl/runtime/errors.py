"""What torchrun prints last when a rank fails: torch elastic's error file.

torchrun gives each worker a file (TORCHELASTIC_ERROR_FILE); when a worker exits non-zero its
summary ("Root Cause (first observed failure)") shows what that file says, else "To enable
traceback see ...". hexrl's deliberate refusals (a wrong plan or launch, a rank not where the plan
puts it, a job ended because another rank failed) write their message alone, so the fix is
what the user reads last; anything else is a bug and writes its traceback (torch's ErrorHandler).
Outside torchrun (no such variable) both do nothing.
"""
from __future__ import annotations

import json
import os
import sys
import time

from torch.distributed.elastic.multiprocessing.errors import get_error_handler

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


def say(text: str) -> None:
    """`text` to stderr as one line in one write: ranks run with `python -u`, where print() writes the
    text and its newline separately and another rank's output can land between them."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def refuse_with(text: str) -> None:
    """A deliberate refusal: `text` on stderr and as what torchrun's summary shows last."""
    say(text)
    record_message(text)


def record_message(text: str) -> None:
    """This process's failure is `text`, shown as-is by torchrun's summary (first record wins)."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path or os.path.exists(path):
        return
    try:
        with open(path, "w") as f:  # torch's format for a message without a traceback
            json.dump({"message": text, "timestamp": str(int(time.time()))}, f)
    except OSError:  # the report is a courtesy: never let it mask the failure itself
        pass


def record_traceback(e: BaseException) -> None:
    """This process failed on `e`, a bug: its traceback goes into torchrun's summary. Call it
    inside the `except` block that caught `e` (torch reads the traceback being handled)."""
    if os.environ.get(ERROR_FILE_ENV) and not os.path.exists(os.environ[ERROR_FILE_ENV]):
        get_error_handler().record_exception(e)
