"""tools/python.sh, which setup.sh, test.sh and demo.sh source: outside a virtual environment the project's
own .venv, never the system's Python (a stock Debian python3 refuses pip installs there: PEP 668)."""
import json
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


def test_the_demo_streams_the_warm_start_to_a_log_and_can_skip_setup(tmp_path):
    """HEXRL_SKIP_SETUP=1 installs nothing; the warm start's output reaches RUN/warm_start.log as it is
    printed (a stand-in python that prints a progress line, then waits until the log holds it)."""
    calls, run = tmp_path / "calls", tmp_path / "run"
    fake = tmp_path / "python"
    fake.write_text(f"""#!/usr/bin/env bash
echo "$* unbuffered=$PYTHONUNBUFFERED" >> {calls}
if [ "$1" = tools/warm_start.py ]; then
  echo "sft step    25  loss 1.0  dev_acc 0.1    3.0s  left at most 60s"
  for i in $(seq 100); do grep -q "sft step" {run}/warm_start.log 2>/dev/null && break; sleep 0.05; done
  grep -q "sft step" {run}/warm_start.log && mkdir -p "$2" && echo "{{}}" > "$2/config.json"
fi
""")
    fake.chmod(0o755)
    env = {**os.environ, "HEXRL_SKIP_SETUP": "1", "PYTHON": str(fake), "RUN": str(run)}
    out = subprocess.run(["bash", "tools/demo.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "left at most 60s" in (run / "warm_start.log").read_text()
    assert (run / "model" / "config.json").exists()  # the log held the line while the warm start still ran
    lines = calls.read_text().splitlines()
    assert lines[0].startswith("tools/warm_start.py") and lines[0].endswith("unbuffered=1")  # python's output too
    assert not any("pip" in line for line in lines)


def test_the_demo_plans_for_the_run_directory_it_is_given(tmp_path):
    """RUN=elsewhere: the planned job reads the model warm-started there, not runs/demo's."""
    run, fake = tmp_path / "elsewhere", tmp_path / "python"
    fake.write_text(f"""#!/usr/bin/env bash
if [ "$1" = - ]; then exec {sys.executable} "$@"; fi  # the job writer runs for real
if [ "$1" = tools/warm_start.py ]; then mkdir -p "$2" && echo "{{}}" > "$2/config.json"; fi
""")
    fake.chmod(0o755)
    env = {**os.environ, "HEXRL_SKIP_SETUP": "1", "PYTHON": str(fake), "RUN": str(run)}
    out = subprocess.run(["bash", "tools/demo.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    job = json.loads((run / "job.json").read_text())
    assert (job["model"]["path"], job["out_dir"]) == (str(run.resolve() / "model"), str(run.resolve()))
