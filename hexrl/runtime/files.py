"""Small run-directory files that readers may open at any moment."""
from __future__ import annotations

import json
from pathlib import Path


def write_json_atomic(path: Path, obj) -> None:
    """Write `obj` as indented JSON to `path` through a temporary file, so readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    tmp.replace(path)
