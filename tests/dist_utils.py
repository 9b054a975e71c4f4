"""Run a function in a small gloo world of spawned processes (CPU tests of distributed code).

    results = run_world(my_worker, 4, arg1, arg2)   # my_worker(rank, world_size, arg1, arg2)

The worker must be a module-level function (spawned children import it by name). Each child
uses one intra-op thread: on a small shared machine, threads of several processes spinning
against each other are slower by orders of magnitude. A failing rank's traceback is raised
in the parent; a hung world is killed after `timeout` seconds.
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import socket
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from hexrl.runtime.dist_rules import maybe_install


class WorldError(RuntimeError):
    """A rank of a spawned world failed, died or timed out."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank: int, world_size: int, port: int, results, args) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=120))
        maybe_install(torch.device("cpu"))  # strict collectives (HEXRL_STRICT_COLLECTIVES, set by conftest)
        value = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(value, buf)  # as bytes: queued tensors would otherwise be shared-memory handles
        results.put((rank, True, buf.getvalue()))  # that die with this process
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(fn, world_size: int, *args, timeout: float = 180.0) -> list:
    """fn(rank, world_size, *args) on every rank of a fresh gloo world; returns results by rank."""
    spawn = mp.get_context("spawn")
    results = spawn.Queue()
    port = free_port()
    procs = [spawn.Process(target=_entry, args=(fn, r, world_size, port, results, args), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out, errors, waited = {}, [], 0.0
    try:
        while len(out) + len(errors) < world_size:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                waited += 1.0
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in out]
                if dead:
                    raise WorldError(f"rank(s) {dead} died (exit codes {[procs[i].exitcode for i in dead]})") from None
                if waited > timeout:
                    raise WorldError(f"world of {world_size} timed out after {timeout:.0f}s; "
                                     f"finished: {sorted(out)}") from None
                continue
            if ok:
                out[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
                break  # the others are probably blocked on the failed rank
        if errors:
            raise WorldError("a rank failed:\n" + "\n".join(errors))
        return [out[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
