"""gpu_check.sh's machine-readable results: `$OUT/gpu_results.json`, updated after every stage.

    python tools/device/gpu_results.py init RESULTS --call N [--rehearse]
    python tools/device/gpu_results.py stage RESULTS NAME STATUS SECONDS LOG   # parse one stage's log into its fields

Each stage's figures are read from the lines its tool prints (the parsers below name them), so a stage
cut off by the deadline still leaves the figures of the stages before it. Fields: gpu, versions,
trainer (MFU and peak GiB per config), decode_ms ("BxC": ms per step), sampling_us ("kernel/B"),
rollout_tok_s (end-to-end tok/s per batch), e2e (held-out before/after, wall s, log-prob mismatch),
pytest (counts), stages (name, status, seconds, in order).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

NUM = r"([-+]?[0-9][0-9,]*\.?[0-9]*(?:e[-+]?[0-9]+)?|nan|inf)"


def _num(s: str) -> float:
    return float(s.replace(",", ""))


def versions(text: str) -> dict:
    """show_versions: 'torch X cuda Y triton Z', 'device NAME', '<module> <version> import ok'."""
    out: dict = {}
    if m := re.search(r"^torch (\S+) cuda (\S+) triton (\S+)", text, re.M):
        out["versions"] = {"torch": m[1], "cuda": m[2], "triton": m[3]}
        out["versions"].update({k: v for k, v in re.findall(r"^(\w+) (\S+) import ok", text, re.M)})
    if m := re.search(r"^device (.+)$", text, re.M):
        out["gpu"] = m[1].strip()
    return out


def trainer(text: str) -> dict:
    """bench_train: '[cfg] ... peak mem X GiB' and '[cfg] MFU ... = Y%'."""
    rows: dict = {}
    for name, mem in re.findall(r"^\[([\w+]+)\] .*?tokens/step.*?peak mem ([0-9.]+) GiB", text, re.M):
        rows.setdefault(name, {})["peak_gib"] = float(mem)
    for name, tf, pct in re.findall(rf"^\[([\w+]+)\] MFU\s+{NUM} TFLOP/s .*= {NUM}%", text, re.M):
        rows.setdefault(name, {}).update(tflops=_num(tf), mfu=_num(pct) / 100)
    return {"trainer": rows} if rows else {}


def decode(text: str) -> dict:
    """bench_kernels: 'decode batch B context C: X ms/step'."""
    points = re.findall(r"decode batch (\d+) context (\d+): ([0-9.]+) ms/step", text)
    got = {f"{b}x{c}": float(ms) for b, c, ms in points}
    return {"decode_ms": got} if got else {}


def sampling(text: str) -> dict:
    """bench_sampling's table: a 24-wide case name, B, old us, new us, ... (µs of the new kernel)."""
    got = {f"{case.strip()}/{b}": _num(new) for case, b, _old, new in
           re.findall(rf"^(.{{24}})\s*(\d+)\s+{NUM}\s+{NUM}\s", text, re.M) if case.strip() != "case"}
    return {"sampling_us": got} if got else {}


def rollout(text: str) -> dict:
    """bench_rollout's table: 'batch prompt output tok/s ...' rows."""
    got = {b: _num(tok) for b, _p, _o, tok in re.findall(rf"^\s+(\d+)\s+(\d+)\s+(\d+)\s+{NUM}\s", text, re.M)}
    return {"rollout_tok_s": got} if got else {}


def e2e(text: str) -> dict:
    """gpu_e2e.sh: the summary's held-out line, its total seconds and the mismatch line."""
    out: dict = {}
    if m := re.search(r"held-out accuracy: ([0-9.]+) at step \d+ -> ([0-9.]+) at step", text):
        out.update(heldout_before=float(m[1]), heldout_after=float(m[2]))
    if m := re.search(r"^gpu_e2e: (\d+) s in all", text, re.M):
        out["wall_s"] = int(m[1])
    if m := re.search(rf"lag-0 tokens: mean {NUM}, p99 <= {NUM}", text):
        out.update(logprob_mismatch_mean=_num(m[1]), logprob_mismatch_p99=_num(m[2]))
    return {"e2e": out} if out else {}


def pytest_counts(text: str) -> dict:
    """pytest's closing line: 'N passed, M failed, K skipped, D deselected, E error(s) in S s'."""
    lines = [ln for ln in text.splitlines()
             if re.search(r"\d+ (passed|failed|error|skipped|deselected)|tests? collected", ln)]
    if not lines:
        return {}
    counts = {k.rstrip("s"): int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected)",
                                                           lines[-1])}
    if m := re.search(r"(\d+)(?:/\d+)? tests? collected", lines[-1]):  # --collect-only (a rehearsal)
        counts["collected"] = int(m[1])
    return {"pytest": counts}


PARSERS = {"versions": versions, "bench_train": trainer, "bench_kernels": decode, "bench_sampling": sampling,
           "e2e": e2e, "pytest": pytest_counts, "bench_rollout": rollout}


def update(path: Path, name: str, status: str, seconds: int, log: Path) -> dict:
    """Add one stage's outcome and the fields its log holds to the results file (atomically)."""
    res = json.loads(path.read_text())
    text = log.read_text(errors="replace") if log.is_file() else ""
    parser = PARSERS.get(name.split()[0])
    for key, value in (parser(text) if parser else {}).items():
        res[key] = {**res[key], **value} if isinstance(value, dict) and isinstance(res.get(key), dict) else value
    res["stages"].append({"name": name, "status": status, "seconds": seconds})
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1) + "\n")
    tmp.replace(path)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("init")
    i.add_argument("results", type=Path)
    i.add_argument("--call", type=int, required=True)
    i.add_argument("--rehearse", action="store_true")
    s = sub.add_parser("stage")
    s.add_argument("results", type=Path)
    s.add_argument("name")
    s.add_argument("status")
    s.add_argument("seconds", type=int)
    s.add_argument("log", type=Path)
    a = p.parse_args(argv)
    if a.cmd == "init":
        a.results.write_text(json.dumps({"call": a.call, "rehearsal": a.rehearse, "gpu": None, "versions": {},
                                         "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                         "stages": []}, indent=1) + "\n")
    else:
        update(a.results, a.name, a.status, a.seconds, a.log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
