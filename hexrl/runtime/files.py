"""Small run-directory files that readers may open at any moment."""
from __future__ import annotations

import json
import os
from pathlib import Path


def write_json_atomic(path: Path, obj) -> None:
    """Write `obj` as indented JSON to `path` through a temporary file, so readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    tmp.replace(path)


def set_run_umask(share: bool) -> None:
    """The run's files are private (directories 0700, files 0600: checkpoints, metrics, final/)
    unless the job sets share_run_dir (0755 / 0644). Process-wide, so it is set once per rank
    before anything is written, and children (reward workers) inherit it."""
    os.umask(0o022 if share else 0o077)
