"""Run an untrusted program isolated: fresh Linux namespaces, an unprivileged uid, rlimits.

Each `Sandbox` is one program run by `sandbox_init.py` (the launcher; see its docstring for the
process tree). What the program gets:
- user, pid, mount, net, ipc and uts namespaces of its own (none nested); uid/gid 65534 (the host's `nobody`
  when hexrl runs as root, else the caller's own uid), no capabilities, no_new_privs;
- a root filesystem holding only read-only system directories (/usr, /lib*, the Python
  install with its site-packages hidden, so no installed dataset is readable), its files in a
  read-only /in, a private tmpfs /tmp (the only writable place), a /proc showing only itself;
- no network device but a down loopback; rlimits on address space, CPU seconds, file size,
  process count and open files; a wall-clock timeout, after which pid 1 of its namespace is
  killed, and with it every process it started. Nothing it writes reaches the host's disk.
stdin and stdout are pipes to the caller; stderr is discarded.

If the kernel refuses the namespaces (user namespaces disabled, a seccomp policy in a
container), `Sandbox` raises `SandboxUnavailable` naming the failed step. `unsafe=True` runs
the program without isolation (rlimits and a temp dir only): for trusted code, never for
model output.
"""

from __future__ import annotations

import json
import os
import select
import signal
import site
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

LAUNCHER = Path(__file__).with_name("sandbox_init.py")
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_GRACE_S = 2.0  # our backstop beyond the launcher's own timeout (its startup): whatever the program writes


class SandboxUnavailable(RuntimeError):
    """The isolation could not be set up on this machine."""


@dataclass
class Limits:
    """Resource limits of one sandboxed run (memory and file size per process)."""

    timeout_s: float = 5.0
    memory_mb: int = 512
    nproc: int = 32
    fsize_mb: int = 16
    tmp_mb: int = 32
    output_bytes: int = 1 << 20  # more stdout than this is never a correct answer

    def for_launcher(self) -> dict:
        """The limits as sandbox_init.py reads them, with a CPU-time cap just above the wall timeout."""
        d = asdict(self)
        d["cpu_s"] = int(self.timeout_s) + 1
        return d


@lru_cache(maxsize=1)
def system_view() -> tuple[list[str], dict[str, str], list[str]]:
    """(directories bound read-only, top-level symlinks recreated, directories hidden)."""
    python_dirs = {sys.base_prefix, str(Path(os.path.realpath(sys.executable)).parent.parent)}
    binds, links = [], {}
    for path in sorted(set(_SYSTEM_DIRS) | python_dirs):
        if os.path.islink(path) and path in _SYSTEM_DIRS:
            links[path] = os.readlink(path)
        elif os.path.isdir(path) and not any(path.startswith(b + "/") for b in binds):
            binds.append(path)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    hidden = site.getsitepackages() + [site.getusersitepackages(), "/usr/lib/python3/dist-packages"] + [
        f"{prefix}/lib/{version}/{d}" for prefix in (sys.base_prefix, "/usr/local", "/usr")  # a venv's base too
        for d in ("site-packages", "dist-packages")]
    masks = sorted({os.path.realpath(p) for p in hidden if os.path.isdir(p)})
    return binds, links, [m for m in masks if any(m.startswith(b + "/") for b in binds)]


def python_argv(script: str, *args: str) -> list[str]:
    """argv that runs /in/`script` with the sandbox's Python, isolated from the environment."""
    return [os.path.realpath(sys.executable), "-I", "-S", "/in/" + script, *args]


class Sandbox:
    """One program running isolated. Use as a context manager, or call `finish()`.

    `files` (name -> text) appear read-only under /in; `stdin_text`, when given, is the
    program's stdin (else stdin stays a pipe for `send_line`).
    """

    def __init__(self, argv: list[str], files: dict[str, str], limits: Limits | None = None,
                 stdin_text: str | None = None, unsafe: bool = False):
        self.limits = limits or Limits()
        files = dict(files)
        if stdin_text is not None:
            files["stdin.txt"] = stdin_text
        binds, links, masks = system_view()
        cfg = {"argv": argv, "files": files, "limits": self.limits.for_launcher(), "binds": binds,
               "symlinks": links, "masks": masks, "root_mountpoint": "/tmp", "parent_pid": os.getpid(),
               "stdin_file": "stdin.txt" if stdin_text is not None else None, "tmp_mb": self.limits.tmp_mb,
               "unsafe": unsafe}
        header = json.dumps(cfg).encode()
        self.deadline = time.monotonic() + self.limits.timeout_s + _GRACE_S
        self._buf = b""
        self._eof = False
        self._overflow = False
        self.status: dict | None = None
        self.proc = subprocess.Popen([os.path.realpath(sys.executable), "-I", "-S", str(LAUNCHER)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            self.proc.stdin.write(len(header).to_bytes(8, "little") + header)
            self.proc.stdin.flush()
            if stdin_text is not None:
                self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass  # the launcher died: finish() reports why

    # -- talking to the program ---------------------------------------------------

    def send_line(self, obj) -> bool:
        """Write one JSON line to the program's stdin; False when it is gone."""
        try:
            self.proc.stdin.write((json.dumps(obj) + "\n").encode())
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError, ValueError):
            return False

    def _fill(self) -> bool:
        """Read what stdout has, waiting until the deadline; False on EOF, timeout or overflow."""
        fd = self.proc.stdout.fileno()
        left = self.deadline - time.monotonic()
        if self._eof or left <= 0 or not select.select([fd], [], [], left)[0]:
            return False
        chunk = os.read(fd, 1 << 16)
        self._eof = not chunk
        self._buf += chunk
        return bool(chunk) and len(self._buf) <= self.limits.output_bytes

    @property
    def expired(self) -> bool:
        """True once the deadline (timeout_s + _GRACE_S from the start) has passed."""
        return time.monotonic() >= self.deadline

    @property
    def ended(self) -> bool:
        """True once the program's stdout reached EOF (it exited, or was killed)."""
        return self._eof

    def read_line(self) -> bytes | None:
        """The next line of stdout (without the newline); None at EOF, timeout or overflow
        (and for every line after an overflow: the stream is out of step)."""
        while b"\n" not in self._buf:
            if self._overflow or not self._fill():
                self._overflow |= len(self._buf) > self.limits.output_bytes
                return None
        line, self._buf = self._buf.split(b"\n", 1)
        if len(line) > self.limits.output_bytes:
            self._overflow = True
            return None
        return line

    def read_all(self) -> bytes | None:
        """All of stdout until the program ends; None on timeout or overflow."""
        while not self._eof:
            if not self._fill() and not self._eof:
                return None
        return self._buf

    # -- ending ---------------------------------------------------------------------

    def finish(self) -> dict:
        """Stop the program if still running, wait for the launcher, return its status.

        The status is {"status": "exited", "rc": n} or {"status": "timeout"}; raises
        SandboxUnavailable when isolation could not be set up.
        """
        if self.status is not None:
            return self.status
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=max(0.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGTERM)  # the launcher kills the namespace, then exits
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # its children die with it (parent-death signals)
                self.proc.wait()
        err = self.proc.stderr.read().decode(errors="replace")
        self.proc.stdout.close()
        self.proc.stderr.close()
        try:
            self.status = json.loads(err.strip().splitlines()[-1])
        except (ValueError, IndexError):
            self.status = {"status": "launcher_failed", "error": err[-1000:]}
        if self.status["status"] in ("setup_failed", "launcher_failed"):
            raise SandboxUnavailable(_explain(self.status.get("error", "")))
        return self.status

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.finish()
        except SandboxUnavailable:
            if exc[0] is None:
                raise


def _explain(error: str) -> str:
    return (f"cannot isolate untrusted code on this machine: {error.strip()}. The sandbox needs "
            "unprivileged user namespaces (sysctl user.max_user_namespaces > 0, "
            "kernel.unprivileged_userns_clone=1, and no AppArmor/seccomp policy blocking unshare "
            "and mount). For trusted code only, pass unsafe=True (reward option `unsafe`).")


def run_program(argv: list[str], files: dict[str, str], stdin_text: str = "", limits: Limits | None = None,
                unsafe: bool = False) -> tuple[dict, bytes | None]:
    """Run to completion with `stdin_text`; (launcher status, stdout or None on timeout/overflow)."""
    with Sandbox(argv, files, limits, stdin_text=stdin_text, unsafe=unsafe) as box:
        out = box.read_all()
        if out is None:
            box.proc.send_signal(signal.SIGTERM)
        status = box.finish()
    return status, (out if status["status"] == "exited" else None)


@lru_cache(maxsize=2)
def check_isolation(unsafe: bool = False) -> None:
    """Raise SandboxUnavailable (with what is missing) unless a sandboxed program can run here."""
    status, out = run_program(python_argv("probe.py"), {"probe.py": "print(6 * 7)"}, unsafe=unsafe)
    if status != {"status": "exited", "rc": 0} or out != b"42\n":
        raise SandboxUnavailable(_explain(f"a probe program ended with {status} and output {out!r}"))
