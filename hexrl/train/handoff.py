"""The trainer hand-off: the controller rank's batch becomes each trainer rank's share of the step.

What crosses the wire, and why:
- The controller rank, slot (stage 0, dp 0, tp 0), holds the step's batch. It checks it and plans
  the step (`Trainer.plan`: advantages, filtering, which sequences each DP rank trains in which
  micro-batch; from rewards and lengths, per-sequence work only), then packs each DP rank's
  sequences into flat arrays (`RankShare`: one copy per field, in the order they are trained).
- DP rank d gets only its share: scattered over the DP group of slot (stage 0, tp 0) to the
  replica's leader (0, d, 0), which broadcasts it over its replica's group (pipeline group, else
  TP group). Every TP and PP rank of a replica trains the same micro-batches (stage 0 embeds the
  ids, the last stage needs targets and log-probs, every stage the shapes and positions), so they
  all get the same bytes. The controller rank's link carries the batch once, not once per rank.
- Every rank builds its own micro-batch tensors from its arrays, in parallel with the others.
- A bad batch: every rank receives the same error and raises it, as when each checked the batch.
- A stop (the job switches plans at this step boundary; hexrl/train/replanning.py): every rank gets
  the same `Stop` in place of a share, and none trains the step.

The payload is msgpack: ints, lists of ints and raw little-endian arrays (bytes of a dtype fixed
per field, never pickle). `decode_share` checks every size against the others and refuses a bad
payload with one error naming each field.
"""
from __future__ import annotations

from dataclasses import dataclass

import msgpack
import numpy as np

from hexrl.comm.store import broadcast_bytes, scatter_bytes
from hexrl.trajectory import Trajectory

from .packing import BatchSummary, Packed, RankShare

VERSION = 1
ARRAYS = {"index": "<i8", "prompt_lens": "<i8", "completion_lens": "<i8", "generated": "<i8", "adv": "<f4",
          "tokens": "<i8", "mask": "|b1", "logprobs": "<f4", "versions": "<i8"}  # Packed's fields
SUMMARY = ("sequences", "groups", "groups_filtered")


@dataclass(frozen=True)
class Stop:
    """In place of a batch: every trainer rank leaves the step loop at this boundary, for `reason`."""

    reason: str


def encode_share(share: RankShare) -> bytes:
    """One DP rank's share as msgpack bytes."""
    p, s = share.packed, share.summary
    arrays = {k: getattr(p, k) for k in ARRAYS}
    msg = {k: None if a is None else memoryview(np.ascontiguousarray(a, dtype=ARRAYS[k])).cast("B")
           for k, a in arrays.items()}
    versions = sorted(s.version_tokens)
    msg.update(v=VERSION, counts=share.counts, num_loss_tokens=share.num_loss_tokens,
               summary={**{k: getattr(s, k) for k in SUMMARY}, "oldest_version": s.oldest_version,
                        "versions": versions, "version_tokens": [s.version_tokens[v] for v in versions]})
    return msgpack.packb(msg)


def encode_error(error: str) -> bytes:
    """A bad batch: what every rank raises."""
    return msgpack.packb({"v": VERSION, "error": error})


def encode_stop(stop: Stop) -> bytes:
    """A stop: what every rank returns in place of its share."""
    return msgpack.packb({"v": VERSION, "stop": stop.reason})


def _ints(value, depth: int = 1, lo: int = 0) -> bool:
    """A list of ints >= lo (depth 2: a list of such lists)."""
    if not isinstance(value, list):
        return False
    if depth > 1:
        return all(_ints(x, depth - 1, lo) for x in value)
    return all(type(x) is int and x >= lo for x in value)


def _arrays(msg: dict, problems: list[str]) -> dict:
    """The raw arrays, each whole elements of its field's dtype."""
    out = {}
    for k, dtype in ARRAYS.items():
        raw = msg.get(k)
        if raw is None and k == "mask":
            out[k] = None
        elif not isinstance(raw, bytes):
            problems.append(f"hand-off.{k}: must be raw bytes, got {type(raw).__name__}")
        elif len(raw) % np.dtype(dtype).itemsize:
            problems.append(f"hand-off.{k}: {len(raw)} bytes is not a whole number of {np.dtype(dtype).name}")
        else:
            out[k] = np.frombuffer(raw, dtype=dtype)
    return out


def _size_problems(a: dict, counts: list[list[int]]) -> list[str]:
    """Each array's length against the per-sequence lengths, and the micro-batches against the sequences."""
    n = len(a["index"])
    problems = [f"hand-off.{k}: {len(a[k])} values for {n} sequences"
                for k in ("prompt_lens", "completion_lens", "generated", "adv") if len(a[k]) != n]
    if problems:
        return problems
    if sum(map(sum, counts)) != n:
        problems.append(f"hand-off.counts: {sum(map(sum, counts))} sequences in micro-batches, {n} sent")
    want = {"tokens": int(a["prompt_lens"].sum() + a["completion_lens"].sum()),
            "mask": int(a["completion_lens"].sum()), "logprobs": int(a["generated"].sum()),
            "versions": int(a["generated"].sum())}
    problems += [f"hand-off.{k}: {len(a[k])} values, the sequences' lengths say {m}"
                 for k, m in want.items() if a[k] is not None and len(a[k]) != m]
    return problems


def _value_problems(a: dict, vocab_size: int | None) -> list[str]:
    """Values the micro-batches would index with, or count, wrongly."""
    problems = []
    if len(a["index"]) and (a["index"].min() < 0 or len(np.unique(a["index"])) != len(a["index"])):
        problems.append("hand-off.index: batch indices must be distinct and >= 0")
    t = a["tokens"]
    if vocab_size is not None and len(t) and (t.min() < 0 or t.max() >= vocab_size):
        problems.append(f"hand-off.tokens: ids outside [0, {vocab_size})")
    if len(a["index"]) and (a["prompt_lens"].min() < 1 or a["completion_lens"].min() < 1):
        return problems + ["hand-off.prompt_lens/completion_lens: every sequence needs >= 1 of each"]
    mask = a["mask"]
    if mask is not None and len(mask) and mask.view(np.uint8).max() > 1:
        return problems + ["hand-off.mask: values must be 0 (environment) or 1 (model)"]
    sampled = a["completion_lens"]
    if mask is not None and len(mask):
        sampled = np.add.reduceat(mask.view(np.uint8), np.cumsum(sampled) - sampled, dtype=np.int64)
    if not np.array_equal(sampled, a["generated"]):
        problems.append("hand-off.generated: does not match the completions and their mask")
    return problems


def _summary(s, problems: list[str]) -> BatchSummary | None:
    ok = (isinstance(s, dict) and all(type(s.get(k)) is int and s[k] >= 0 for k in SUMMARY)
          and (s.get("oldest_version") is None or type(s.get("oldest_version")) is int)
          and _ints(s.get("versions")) and _ints(s.get("version_tokens"))
          and len(s["versions"]) == len(s["version_tokens"]))
    if not ok:
        problems.append("hand-off.summary: must hold sequences, groups, groups_filtered, oldest_version and "
                        "versions/version_tokens (equal-length lists of ints >= 0)")
        return None
    return BatchSummary(*(s[k] for k in SUMMARY), s["oldest_version"], dict(zip(s["versions"], s["version_tokens"])))


def decode_share(raw: bytes, vocab_size: int | None = None) -> RankShare | Stop:
    """A share from `encode_share`'s bytes (a Stop from `encode_stop`'s); raises ValueError naming every
    bad field (the sender's error, as sent, for a bad batch)."""
    try:
        msg = msgpack.unpackb(raw)
    except Exception as e:  # noqa: BLE001 - any malformed msgpack is one refusal
        raise ValueError(f"hand-off: not a msgpack payload ({type(e).__name__}: {e})") from None
    if not isinstance(msg, dict) or msg.get("v") != VERSION:
        raise ValueError(f"hand-off: not a version {VERSION} map")
    if isinstance(msg.get("error"), str):
        raise ValueError(msg["error"])
    if isinstance(msg.get("stop"), str):
        return Stop(msg["stop"])
    problems = []
    counts, loss_tokens = msg.get("counts"), msg.get("num_loss_tokens")
    if not _ints(counts, depth=2, lo=1):
        problems.append("hand-off.counts: must be a list (per mini-batch) of lists of sequence counts >= 1")
    if not (_ints(loss_tokens) and isinstance(counts, list) and len(loss_tokens) == len(counts)):
        problems.append("hand-off.num_loss_tokens: must be one int >= 0 per mini-batch")
    summary = _summary(msg.get("summary"), problems)
    arrays = _arrays(msg, problems)
    problems = problems or _size_problems(arrays, counts)
    problems = problems or _value_problems(arrays, vocab_size)
    if problems:
        raise ValueError(f"{len(problems)} problem(s) in the hand-off payload:\n  " + "\n  ".join(problems))
    return RankShare(Packed(**arrays), counts, loss_tokens, summary)


def share_batch(batch: list[Trajectory] | Stop | None, trainer) -> list[Trajectory] | RankShare | Stop:
    """This trainer rank's share of the step (collective over the trainer ranks): the controller rank
    passes the batch (or a Stop), every other rank None. A single trainer rank keeps what it passed."""
    g = trainer.grid
    if g.trainer_group is None:
        return batch
    L, device = g.layout, trainer.device
    src, leader = L.rank(0, 0, 0), L.rank(0, g.dp_rank, 0)
    payloads, own, error = {}, None, None
    if isinstance(batch, Stop):
        own, payloads = batch, {L.rank(0, d, 0): encode_stop(batch) for d in range(L.dp)}
    elif batch is not None:
        try:
            plan = trainer.plan(batch)
            own = plan.share(batch, 0)
            payloads = {L.rank(0, d, 0): encode_share(plan.share(batch, d)) for d in range(1, L.dp)}
        except ValueError as e:  # every rank raises it
            error = e
            payloads = {L.rank(0, d, 0): encode_error(str(e)) for d in range(L.dp)}
    replica = g.pp_group if L.pp > 1 else g.groups.get("tp")
    raw = None
    if g.rank == leader and L.dp > 1:  # each replica's leader gets its replica's share
        raw = scatter_bytes({src: b"", **payloads} if batch is not None else None, src, g.dp_group, device)
    if replica is not None:  # and hands it to the rest of its replica
        if g.rank == src:
            raw = payloads[src] if error is not None or isinstance(own, Stop) else encode_share(own)
        raw = broadcast_bytes(raw if g.rank == leader else None, leader, replica, device)
    if error is not None:
        raise error
    return own if own is not None else decode_share(raw, trainer.model_cfg.vocab_size)
