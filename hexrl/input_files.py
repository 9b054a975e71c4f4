"""The one way hexrl opens a file a user gave it: the guard against files that are not what they claim.

Every input file (job and plan files, a model's config.json, safetensors headers and index,
tokenizer files, datasets, checkpoint metadata) is opened here, so each of these holds for all:
  * only a regular file is read: a FIFO, socket, device or directory named like one is refused
    before anything blocks on it (opened non-blocking, checked with fstat on the open descriptor);
  * JSON is UTF-8, nests no deeper than MAX_DEPTH and holds no NaN or Infinity (Python's json
    reads those; no hexrl field may be one);
  * a gzip file that ends early or is corrupt is named, not a raw EOFError.
Errors are `InputFileError` (a ValueError) naming the file. Stdlib only (the planner reads files
without torch).
"""
from __future__ import annotations

import gzip
import io
import json
import os
import re
import stat
import zlib
from itertools import accumulate
from pathlib import Path

MAX_DEPTH = 100  # no hexrl input nests deeper; a deeper one would meet recursion in our own code
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_MAX_TEXT = 1 << 30  # a JSON file larger than this (1 GiB) is not a config file


class InputFileError(ValueError):
    """An input file that cannot be read as what it claims to be; the message names it."""


class TooDeepError(InputFileError):
    """JSON nested deeper than MAX_DEPTH: built to break parsers, not a slip, so a reader that skips a
    bad record refuses the whole file for this one."""


def open_input(path: str | os.PathLike, what: str = "file"):
    """`path` opened for binary reading, only if it is a regular file (never blocks on a FIFO)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise InputFileError(f"{path}: cannot read {what} ({e.strerror or e})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode)
                    else "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                    else "not a regular file")
            raise InputFileError(f"{path}: is {kind}, not a regular {what}")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: str | os.PathLike, what: str = "file", limit: int = _MAX_TEXT) -> bytes:
    """The whole of a regular file, at most `limit` bytes (InputFileError beyond)."""
    with open_input(path, what) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise InputFileError(f"{path}: larger than {limit} bytes, too large for a {what}")
    return data


_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")  # the escape of a UTF-16 surrogate (half of a pair, or a lone one)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number hexrl accepts")


def _depth(text: str) -> int:
    """How deep brackets nest in JSON text (strings skipped), at C speed: checked before parsing,
    so nothing recurses that far."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(accumulate(1 if c in "[{" else -1 for c in brackets), default=0)


def loads_json(text: str | bytes, where: str, what: str = "JSON"):
    """Parse JSON under the guard's rules; InputFileError naming `where` otherwise."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputFileError(f"{where}: not UTF-8 text (a binary file?): byte {e.start} is "
                                 f"{e.object[e.start:e.start + 1]!r}") from None
    if _depth(text) > MAX_DEPTH:
        raise TooDeepError(f"{where}: nested too deeply to be a {what} (more than {MAX_DEPTH} levels)")
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise InputFileError(f"{where}: invalid JSON: {e}") from None
    except ValueError as e:  # NaN, Infinity
        raise InputFileError(f"{where}: {e}") from None
    except RecursionError:
        raise TooDeepError(f"{where}: nested too deeply to be a {what}") from None
    if _SURROGATE.search(text):  # only a \u escape makes one; the check below re-encodes everything
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            raise InputFileError(f"{where}: a \\u escape names half a surrogate pair ({e.object[e.start]!r}): "
                                 "not Unicode text") from None
    return value


def read_json(path: str | os.PathLike, what: str = "JSON file"):
    """A JSON file read and parsed under the guard (regular file, UTF-8, depth, no NaN)."""
    return loads_json(read_bytes(path, what), str(path), what)


def text_lines(path: str | os.PathLike, what: str = "file"):
    """The binary lines of a regular file, or of a gzip file (`.gz`): a truncated or corrupt gzip
    stream raises InputFileError naming the file, never EOFError."""
    f = open_input(path, what)
    if not str(path).endswith(".gz"):
        with f:
            yield from f
        return
    try:
        with f, gzip.GzipFile(fileobj=f) as z:
            yield from io.BufferedReader(z)
    except (EOFError, gzip.BadGzipFile, zlib.error, OSError) as e:
        raise InputFileError(f"{path}: truncated or corrupt gzip {what} ({type(e).__name__}: {e})") from None
