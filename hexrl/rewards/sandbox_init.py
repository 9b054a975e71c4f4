"""The sandbox launcher: a standalone script (stdlib only) run as `python -I -S sandbox_init.py`.

It is the trusted half of `hexrl.rewards.sandbox`. Process tree and duties:

    launcher L (caller's uid)  reads the config, writes the id maps, enforces the wall timeout,
     └─ C  unshare(user, mount, pid, net, ipc, uts); becomes uid 65534; waits for G
         └─ G  pid 1 of the new pid namespace: builds a fresh root (read-only system dirs, a
               tmpfs /in with the files, a tmpfs /tmp, a new /proc), pivots into it, sets
               rlimits and no_new_privs, then execs the program (capabilities are lost at exec)

When G exits or is killed, the kernel kills every process of its pid namespace, however it
was forked (setsid and double forks included); its tmpfs mounts vanish with the namespace.
L reports one JSON status line on its stderr, which the program never holds.
Config (stdin): 8-byte little-endian length, then JSON (see `sandbox.py`). stdin/stdout after
the header belong to the program.
"""

import ctypes
import json
import os
import platform
import resource
import select
import shutil
import signal
import sys
import tempfile
import time

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_DUMPABLE = 1, 38, 4
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203}.get(platform.machine())
SETUP_FAILED = 121  # G's exit code when it could not build the sandbox (message on the pipe)
SANDBOX_ID = 65534  # the uid and gid inside; mapped to outer nobody when we are root

libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def _mount(src, target, fstype, flags, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {src} on {target}")


def _die_with_parent(parent: int | None) -> None:
    _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
    if parent is not None and os.getppid() != parent:  # it died before the prctl took effect
        os._exit(1)


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


# ----------------------------------------------------------------------------- inside (G)


def _bind_ro(fd: int, target: str) -> None:
    """Bind the directory open as O_PATH `fd` on `target`, read-only, nosuid, nodev."""
    os.makedirs(target, exist_ok=True)
    _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)
    _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _build_root(cfg: dict, fds: dict) -> None:
    """A new root on a tmpfs: binds, symlinks, /in, /tmp, /proc, /dev/null; then pivot into it."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount propagates to the host
    root = cfg["root_mountpoint"]
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path, fd in fds.items():
        _bind_ro(fd, root + path)
    for path, target in cfg["symlinks"].items():
        os.symlink(target, root + path)
    for path in cfg["masks"]:  # e.g. site-packages: installed datasets must not be readable
        if os.path.isdir(root + path):
            _mount("tmpfs", root + path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k")
    os.makedirs(root + "/in")
    _mount("tmpfs", root + "/in", "tmpfs", MS_NOSUID | MS_NODEV, "size=16m,mode=0755")
    for name, text in cfg["files"].items():
        with open(f"{root}/in/{os.path.basename(name)}", "w") as f:
            f.write(text)
    _mount(None, root + "/in", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.makedirs(root + "/tmp")
    _mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={cfg['tmp_mb']}m,mode=0700,uid={SANDBOX_ID},gid={SANDBOX_ID}")
    os.makedirs(root + "/proc")
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _write(root + "/proc/sys/user/max_user_namespaces", "0")  # no nested namespaces: less kernel surface
    os.makedirs(root + "/dev")
    for dev in ("null", "zero", "urandom"):
        open(f"{root}/dev/{dev}", "w").close()
        _mount(f"/dev/{dev}", f"{root}/dev/{dev}", None, MS_BIND)
    os.makedirs(root + "/old")
    _check(libc.syscall(SYS_PIVOT_ROOT, root.encode(), (root + "/old").encode()), "pivot_root")
    os.chdir("/")
    _check(libc.umount2(b"/old", MNT_DETACH), "umount old root")  # the host tree is gone
    os.rmdir("/old")
    _mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _limit(cfg: dict) -> None:
    lim = cfg["limits"]
    for name, value in (("RLIMIT_AS", lim["memory_mb"] << 20), ("RLIMIT_CPU", lim["cpu_s"]),
                        ("RLIMIT_FSIZE", lim["fsize_mb"] << 20), ("RLIMIT_NPROC", lim["nproc"]),
                        ("RLIMIT_NOFILE", 64), ("RLIMIT_CORE", 0), ("RLIMIT_MEMLOCK", 0)):
        resource.setrlimit(getattr(resource, name), (value, value))
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")


def _run_g(cfg: dict, fds: dict, err_w: int) -> None:
    try:
        _die_with_parent(None)  # C is outside our pid namespace: getppid() reads 0 here
        _build_root(cfg, fds)
        for fd in fds.values():
            os.close(fd)
        os.chdir("/tmp")
        stdin = os.open("/in/" + cfg["stdin_file"], os.O_RDONLY) if cfg.get("stdin_file") else None
        if stdin is not None:
            os.dup2(stdin, 0)
        devnull = os.open("/dev/null", os.O_WRONLY)
        os.dup2(devnull, 2)  # the program never holds the launcher's status channel
        _limit(cfg)
        os.set_inheritable(err_w, False)
        os.closerange(3, err_w)
        os.closerange(err_w + 1, 1 << 16)
        env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
        os.execve(cfg["argv"][0], cfg["argv"], env)  # err_w closes on exec: C sees EOF
    except BaseException as e:  # report, never run the program half-isolated
        os.write(err_w, f"{type(e).__name__}: {e}".encode()[:1000])
        os._exit(SETUP_FAILED)


# ----------------------------------------------------------------------------- middle (C)


def _run_c(cfg: dict, sync_r: int, sync_w: int, err_w: int, launcher: int) -> None:
    try:
        _die_with_parent(launcher)
        _check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC
                            | CLONE_NEWUTS), "unshare")
        os.write(sync_w, b"u")
        if os.read(sync_r, 1) != b"m":  # the launcher wrote our uid/gid maps
            os._exit(SETUP_FAILED)
        # Opened in the new mount namespace (a bind source must live there), with the caller's
        # kernel uid, so directories a nobody cannot traverse (/root/.pyenv) can still be bound.
        fds = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p in cfg["binds"]}
        os.setresgid(SANDBOX_ID, SANDBOX_ID, SANDBOX_ID)
        os.setresuid(SANDBOX_ID, SANDBOX_ID, SANDBOX_ID)  # kernel uid now nobody (or the caller)
        _die_with_parent(launcher)  # a change of uid clears the parent-death signal: set it again
        g = os.fork()
        if g == 0:
            _run_g(cfg, fds, err_w)
        os.write(sync_w, g.to_bytes(4, "little"))
        _, status = os.waitpid(g, 0)  # returns once every process of the namespace is gone
        os._exit(os.waitstatus_to_exitcode(status) & 0xFF if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
    except BaseException as e:
        os.write(err_w, f"{type(e).__name__}: {e}".encode()[:1000])
        os._exit(SETUP_FAILED)


# ----------------------------------------------------------------------------- outside (L)


def _read_config() -> dict:
    def read_exact(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = os.read(0, n - len(buf))
            if not chunk:
                raise EOFError("config truncated")
            buf += chunk
        return buf
    return json.loads(read_exact(int.from_bytes(read_exact(8), "little")))


def _host_root() -> bool:
    """Root of the initial user namespace (not merely root inside some container's namespace)."""
    try:
        with open("/proc/self/uid_map") as f:
            return os.geteuid() == 0 and f.read().split() == ["0", "0", "4294967295"]
    except OSError:
        return False


def _map_ids(pid: int) -> None:
    if _host_root():  # root: the sandbox uid is the host's unprivileged nobody
        _write(f"/proc/{pid}/uid_map", f"{SANDBOX_ID} {SANDBOX_ID} 1\n")
        _write(f"/proc/{pid}/gid_map", f"{SANDBOX_ID} {SANDBOX_ID} 1\n")
    else:  # an unprivileged caller may only map itself
        _write(f"/proc/{pid}/uid_map", f"{SANDBOX_ID} {os.geteuid()} 1\n")
        _write(f"/proc/{pid}/setgroups", "deny")
        _write(f"/proc/{pid}/gid_map", f"{SANDBOX_ID} {os.getegid()} 1\n")


def _report(status: dict) -> None:
    os.write(2, (json.dumps(status) + "\n").encode())


def _wait(c: int, deadline: float) -> int | None:
    """C's exit code, or None when the deadline passed first."""
    pidfd = os.pidfd_open(c)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        if select.select([pidfd], [], [], left)[0]:
            return os.waitstatus_to_exitcode(os.waitpid(c, 0)[1])


def _run_unsafe(cfg: dict) -> None:
    """No isolation, for trusted code: a temp dir, rlimits, a process group killed at the end."""
    tmp = tempfile.mkdtemp(prefix="hexrl_unsafe_")
    try:
        for name, text in cfg["files"].items():
            with open(os.path.join(tmp, os.path.basename(name)), "w") as f:
                f.write(text)
        argv = [tmp + a[3:] if a.startswith("/in/") else a for a in cfg["argv"]]
        pid = os.fork()
        if pid == 0:
            os.setsid()
            os.chdir(tmp)
            if cfg.get("stdin_file"):
                os.dup2(os.open(os.path.join(tmp, cfg["stdin_file"]), os.O_RDONLY), 0)
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
            _limit(cfg)
            os.execve(argv[0], argv, {"PATH": "/usr/bin:/bin", "HOME": tmp, "PYTHONHASHSEED": "0"})
        code = _wait(pid, time.monotonic() + cfg["limits"]["timeout_s"])
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        if code is None:
            os.waitpid(pid, 0)
        _report({"status": "timeout"} if code is None else {"status": "exited", "rc": code})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    cfg = _read_config()
    _die_with_parent(cfg["parent_pid"])
    if cfg["unsafe"]:
        return _run_unsafe(cfg)
    sync_c_r, sync_c_w = os.pipe()  # C -> L
    sync_l_r, sync_l_w = os.pipe()  # L -> C
    err_r, err_w = os.pipe()
    if _host_root():
        os.setgroups([])  # root's supplementary groups must not follow the sandbox
    me = os.getpid()
    c = os.fork()
    if c == 0:
        _run_c(cfg, sync_l_r, sync_c_w, err_w, me)
    for fd in (err_w, sync_c_w, sync_l_r):
        os.close(fd)  # so a read sees EOF when C dies
    g_fd = None  # a pidfd: C reaps pid 1, so its pid number could be reused, the pidfd not

    def stop(*_):  # kill pid 1 of the namespace, and with it everything; C reaps it and exits
        try:  # (C's wait for pid 1 returns only once the whole namespace is gone)
            if g_fd is not None:
                signal.pidfd_send_signal(g_fd, signal.SIGKILL)
            else:
                os.kill(c, signal.SIGKILL)
        except ProcessLookupError:
            pass
    signal.signal(signal.SIGTERM, stop)
    try:
        if os.read(sync_c_r, 1) == b"u":
            _map_ids(c)
            os.write(sync_l_w, b"m")
            raw = os.read(sync_c_r, 4)
            if len(raw) == 4:
                g_fd = os.pidfd_open(int.from_bytes(raw, "little"))
    except ProcessLookupError:
        pass  # pid 1 already ended: C's exit code tells how
    except OSError as e:
        _report({"status": "setup_failed", "error": f"writing the id maps: {e}"})
        stop()
        os.waitpid(c, 0)
        sys.exit(1)
    code = _wait(c, time.monotonic() + cfg["limits"]["timeout_s"])
    if code is None:
        stop()
        os.waitpid(c, 0)
        _report({"status": "timeout"})
        return
    err = os.read(err_r, 1000).decode(errors="replace")
    if code == SETUP_FAILED and err:
        _report({"status": "setup_failed", "error": err})
    else:
        _report({"status": "exited", "rc": code})


if __name__ == "__main__":
    main()
