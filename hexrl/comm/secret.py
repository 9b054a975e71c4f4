"""The job's channel secret, which never crosses the torchrun store.

torchrun's TCPStore listens on every interface without authentication, so anything put in it is
readable by any process that can reach its port. The secret comes instead from

  * `HEXRL_SECRET` (at least 32 characters, e.g. `openssl rand -hex 32`), set to the same value on
    every launcher; the key is a hash of it; or, without it,
  * a 0600 file `RUN_DIR/job_secret` that rank 0 writes with 32 fresh random bytes at every launch
    (a multi-node job keeps its run directory on a shared filesystem, docs/multinode.md).

The store carries only a fingerprint (a hash of the key), so every rank can tell a stale file or
a different `HEXRL_SECRET` from the right one and refuse to start, naming which. A rank that
finds neither refuses too: a multi-node job whose run directory is not shared needs HEXRL_SECRET.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import time
from datetime import timedelta
from pathlib import Path

from hexrl.comm.channel import new_secret

SECRET_ENV = "HEXRL_SECRET"
SECRET_FILE = "job_secret"
MIN_ENV_CHARS = 32
_CHECK_KEY = "hexrl/secret_check"  # the fingerprint of rank 0's key (never the key)


class SecretError(RuntimeError):
    """No usable job secret on this rank (the message says what to set)."""


def fingerprint(secret: bytes) -> str:
    """A public check value of `secret`: equal keys give equal fingerprints; it reveals no key."""
    return hashlib.sha256(b"hexrl secret check\0" + secret).hexdigest()[:32]


def secret_from_env(env=os.environ) -> bytes | None:
    """The key derived from HEXRL_SECRET, or None when it is unset; SecretError if too short or not text."""
    value = env.get(SECRET_ENV)
    if value is None:
        return None
    try:
        text = value.encode()
    except UnicodeEncodeError:  # bytes that are not UTF-8 reach os.environ as lone surrogates
        raise SecretError(f"{SECRET_ENV} is not valid UTF-8: set it to text on every launcher (e.g. the output of "
                          "`openssl rand -hex 32`)") from None
    if len(value) < MIN_ENV_CHARS:
        raise SecretError(f"{SECRET_ENV} must be at least {MIN_ENV_CHARS} characters (e.g. the output of "
                          f"`openssl rand -hex 32`), got {len(value)}")
    return hashlib.sha256(b"hexrl channel key\0" + text).digest()


def write_secret_file(run_dir: Path) -> bytes:
    """A fresh secret in RUN_DIR/job_secret, mode 0600 whatever the umask, replaced atomically;
    SecretError naming the file if it cannot be written there."""
    path = run_dir / SECRET_FILE
    secret = new_secret()
    tmp = run_dir / f".{SECRET_FILE}.{os.getpid()}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, secret)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:  # e.g. RUN_DIR/job_secret is a directory, or RUN_DIR is not writable
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise SecretError(f"cannot write the job secret to {path}: {e.strerror or e} (or set {SECRET_ENV})") from None
    return secret


def _read_matching(path: Path, expected: str, wait_s: float) -> bytes | None:
    """The file's bytes once they match the fingerprint (a shared filesystem may lag), else None."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            data = path.read_bytes()
            if fingerprint(data) == expected:
                return data
        except IsADirectoryError:
            raise SecretError(f"{path} is a directory, not the job secret file rank 0 writes: remove it, "
                              f"or set {SECRET_ENV}") from None
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.2)


def job_secret(store, rank: int, run_dir: Path, multi_node: bool, env=os.environ,
               timeout_s: float = 300.0, file_wait_s: float = 30.0) -> bytes:
    """This rank's copy of the job's channel secret (every rank calls it once, rank 0 first
    publishes the fingerprint). Raises SecretError naming what is missing or different."""
    secret = secret_from_env(env)
    if rank == 0:
        secret = secret if secret is not None else write_secret_file(run_dir)
        store.set(_CHECK_KEY, fingerprint(secret))
        return secret
    try:
        store.wait([_CHECK_KEY], timedelta(seconds=timeout_s))
    except RuntimeError as e:  # DistStoreError is a RuntimeError
        raise SecretError(f"rank 0 published no secret fingerprint within {timeout_s}s ({e})") from None
    expected = store.get(_CHECK_KEY).decode()
    if secret is not None:
        if fingerprint(secret) != expected:
            raise SecretError(f"{SECRET_ENV} here differs from rank 0's (or rank 0's launcher has none): "
                              "set the same value on every launcher")
        return secret
    found = _read_matching(run_dir / SECRET_FILE, expected, file_wait_s)
    if found is None:
        where = ("a multi-node job needs the same value of HEXRL_SECRET on every launcher, or its --run-dir "
                 "on a filesystem every node shares" if multi_node else "is the run directory writable?")
        raise SecretError(f"no job secret: {run_dir / SECRET_FILE} is missing or is not the one rank 0 wrote "
                          f"within {file_wait_s:.0f}s, and {SECRET_ENV} is not set ({where}; docs/reliability.md)")
    return found
