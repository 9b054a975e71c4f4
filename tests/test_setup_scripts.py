"""tools/python.sh, which setup.sh, test.sh and demo.sh source: outside a virtual environment the project's
own .venv, never the system's Python (a stock Debian python3 refuses pip installs there: PEP 668)."""
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def chosen_python(bin_dir: Path) -> str:
    """PY as tools/python.sh sets it when `bin_dir` (which holds a python3) leads the PATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "CONDA_PREFIX", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin"
    out = subprocess.run(["bash", "-c", "source tools/python.sh && echo $PY"], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_outside_a_virtual_environment_the_project_venv():
    assert (Path(sys.base_prefix) / "bin" / "python3").exists()
    assert chosen_python(Path(sys.base_prefix) / "bin") == ".venv/bin/python"


def test_inside_a_virtual_environment_that_one(tmp_path):
    venv.create(tmp_path / "env", with_pip=False)  # as after `source env/bin/activate`: its bin leads the PATH
    assert chosen_python(tmp_path / "env" / "bin") == "python3"


def test_setup_never_installs_outside_the_chosen_python():
    text = (ROOT / "tools" / "setup.sh").read_text()
    installs = [line for line in text.splitlines() if "pip install" in line and not line.lstrip().startswith("#")]
    assert installs and all(line.lstrip().startswith('"$PY" -m pip install') for line in installs), installs
