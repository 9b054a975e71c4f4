"""Reading typed fields out of parsed JSON, collecting every problem instead of stopping at the first."""

import difflib
from pathlib import Path

from hexrl.ranges import DEFAULT_MAX, number_problem


def plural(n: int, noun: str) -> str:
    """"1 node", "2 nodes": a count and its noun, for messages."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


class ConfigError(ValueError):
    """An invalid job or plan; `problems` lists every problem, each naming its field."""

    def __init__(self, problems: list[str], header: str = "invalid job"):
        self.problems = list(problems)
        lines = [f"{header}: {len(self.problems)} problem(s)"] + [f"  - {p}" for p in self.problems]
        super().__init__("\n".join(lines))


# ----------------------------------------------------------------------------- reading

def unknown_field(name: str, known) -> str:
    """'unknown field (did you mean 'x'? known: ...)': the closest known name when one is close."""
    close = difflib.get_close_matches(str(name), sorted(known), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown field ({hint}known: {', '.join(sorted(known))})"


class Reader:
    """Reads typed fields from nested dicts, collecting problems instead of raising."""

    def __init__(self):
        self.problems: list[str] = []

    def bad(self, where: str, msg: str):
        self.problems.append(f"{where}: {msg}")

    def section(self, d, where: str, known: set[str], required: bool = False,
                renamed: dict[str, str] | None = None) -> dict:
        """The object `d` at `where`; reports each field not in `known` (and an old name in `renamed`
        by its new one)."""
        if d is None:
            if required:
                self.bad(where, "missing (required section)")
            return {}
        if not isinstance(d, dict):
            self.bad(where, f"must be an object, got {type(d).__name__}")
            return {}
        for k in d:
            if renamed and k in renamed:
                self.bad(f"{where}.{k}", f"renamed to {where}.{renamed[k]}; rename it in the job file")
            elif k not in known:
                self.bad(f"{where}.{k}", unknown_field(k, known))
        return d

    def num(self, d: dict, key: str, where: str, default=None, *, integer=False, lo=None,
            hi=DEFAULT_MAX, lo_open=False, none_ok=False, required=False):
        """A number field, finite and in [lo, hi] (hexrl.ranges: a field that gives no `hi` is
        bounded by DEFAULT_MAX); reports the problem and returns `default` otherwise."""
        name = f"{where}.{key}"
        if key not in d:
            if required:
                self.bad(name, "missing (required)")
            return default
        v = d[key]
        if v is None and none_ok:
            return None
        why = number_problem(v, lo, hi, integer=integer, lo_open=lo_open)
        if why:
            self.bad(name, why)
            return default
        return int(v) if integer else v

    def boolean(self, d: dict, key: str, where: str, default: bool) -> bool:
        v = d.get(key, default)
        if not isinstance(v, bool):
            self.bad(f"{where}.{key}", f"must be true or false, got {v!r}")
            return default
        return v

    def choice(self, d: dict, key: str, where: str, options, default=None, required=False):
        if key not in d:
            if required:
                self.bad(f"{where}.{key}", f"missing (one of: {', '.join(options)})")
            return default
        v = d[key]
        if v not in options:
            self.bad(f"{where}.{key}", f"must be one of {', '.join(options)}, got {v!r}")
            return default
        return v

    def text(self, d: dict, key: str, where: str, default=None, required=False):
        if key not in d:
            if required:
                self.bad(f"{where}.{key}", "missing (required)")
            return default
        v = d[key]
        if not isinstance(v, str) or not v:
            self.bad(f"{where}.{key}", f"must be a non-empty string, got {v!r}")
            return default
        return v



def resolve(base: Path, p) -> Path:
    """A path from a config file, relative to that file's directory."""
    p = Path(str(p)).expanduser()
    return p if p.is_absolute() else (base / p).resolve()


def short(xs: list, n: int = 8) -> str:
    """The first n items of a list, and how many there are in all if more."""
    return ", ".join(map(str, xs[:n])) + (f", ... ({len(xs)} in all)" if len(xs) > n else "")
