"""torchrun entry point: every rank reads the plan, takes its role and runs that role's loop.

    torchrun --nnodes N --nproc_per_node G [--max-restarts K] -m hexrl.main plan.json [--run-dir DIR] [--resume DIR]

Under `--nnodes MIN:MAX` with a dynamic rendezvous the plan given lists every node that may take
part, and each (re)start first agrees on a plan for the nodes present (`hexrl.runtime.elastic`).
The plan is checked against the torchrun world before any collective. After the default
group exists (its store carries failures to every node), each rank checks that torchrun put
it on the node the plan says (`hexrl.runtime.nodes`) and that every node read the same plan. Then every rank
creates the same process groups in the same order (the trainer grid, one weight-sync group
per pipeline stage, one TP group per rollout replica), starts the watchdog, and runs
`hexrl.train.trainer_rank.run_trainer` or `hexrl.rollout.rollout_rank.run_rollout`.
"""
from __future__ import annotations

import argparse
import functools
import os
import re
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from hexrl.comm.secret import SecretError, job_secret
from hexrl.comm.weights import source_receivers
from hexrl.preflight import Inputs, check_inputs
from hexrl.runtime import cpu_pinning, dist_rules, effective, elastic, errors
from hexrl.runtime.context import RankContext
from hexrl.runtime.files import set_run_umask
from hexrl.runtime.nodes import address_problems, node_label, node_rank_from_env, placement_problems, plan_digest
from hexrl.runtime.watchdog import Watchdog, describe_exception
from hexrl.schema import ConfigError, Plan, load_plan

COLLECTIVE_TIMEOUT = timedelta(minutes=30)
# On a shared GPU the weights go by CUDA IPC; HEXRL_COLOCATED_SYNC=gloo broadcasts them over the
# gloo group instead (through host memory), to compare the two
COLOCATED_SYNC_ENV = "HEXRL_COLOCATED_SYNC"  # long steps are fine; dead peers are the watchdog's job
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"  # set by torchrun: this attempt's number of restarts
MAX_RESTARTS_ENV = "TORCHELASTIC_MAX_RESTARTS"  # set by torchrun: its --max-restarts


@dataclass
class Groups:
    """Every process group of the job, as each rank creates them (in the same order)."""

    sync: list  # per pipeline stage, per source: (src rank, weight-sync group or None where not a member)
    replica: dict  # replica id -> its TP group (TP > 1 only)
    described: list[tuple[str, list[int], object]]  # (name, ranks, group) of every group, for effective_config
    sync_ipc: bool  # the sync groups' members share a GPU: weights go by CUDA IPC (hexrl/comm/weights.py)


def build_groups(plan: Plan, device_type: str = "cpu", grid_groups: list | None = None) -> Groups:
    """Weight-sync groups and rollout replica TP groups.

    Every rank calls new_group for every group in the same order (torch requires it); only
    members get a communicator. The first use of each is a collective of all its members (a
    broadcast; the engine's page-count agreement), never p2p. A group whose members share a GPU
    is gloo (rule 5; rules: hexrl/runtime/dist_rules.py). Weight sync: one group per trainer rank
    of each stage (its source) with the rollout ranks that take its pieces
    (hexrl/comm/weights.py `source_receivers`); colocated on GPUs (CUDA IPC), one group per stage
    from its (dp 0, tp 0) rank to every rollout rank.
    """
    devices = {x.rank: (x.node, x.device_index) for x in plan.ranks}

    def make(ranks: list[int]):
        g = dist.new_group(ranks, backend=dist_rules.group_backend([devices[r] for r in ranks]))
        return g if dist.get_rank() in ranks else None

    rollout, lay = plan.rollout_ranks(), plan.trainer
    described = [("world", list(range(plan.world_size)), dist.group.WORLD), *(grid_groups or [])]
    shared = any(dist_rules.group_backend([devices[r] for r in sorted([lay.rank(s, 0, 0), *rollout])]) is not None
                 for s in range(lay.pp))
    ipc = shared and device_type == "cuda" and os.environ.get(COLOCATED_SYNC_ENV, "cuda-ipc") != "gloo"
    replicas = [list(rep.ranks) for rep in plan.replicas]
    sync = []
    for stage in range(lay.pp):
        tp = lay.stages[stage].tp
        sources = [lay.rank(stage, 0, 0)] if ipc else [lay.rank(stage, d, t) for t in range(tp) for d in range(lay.dp)]
        sync.append([])
        for s, src in enumerate(sources):
            ranks = sorted([src, *(rollout if ipc else source_receivers(s, replicas))])
            sync[-1].append((src, make(ranks)))
            described.append((f"weight_sync/stage{stage}" + (f"/source{s}" if s else ""), ranks, sync[-1][-1][1]))
    replica_groups = {}
    for rep in plan.replicas:
        if rep.tp > 1:
            replica_groups[rep.id] = make(sorted(rep.ranks))
            described.append((f"replica{rep.id}/tp", sorted(rep.ranks), replica_groups[rep.id]))
    return Groups(sync, replica_groups, described, ipc)


def publish_groups(ctx_store, rank: int, groups: Groups) -> None:
    """Each group's lowest rank records the backend torch gave it (effective_config.json)."""
    for name, ranks, g in groups.described:
        if ranks and ranks[0] == rank:
            weights = ("cuda-ipc" if groups.sync_ipc else "broadcast") if name.startswith("weight_sync") else None
            effective.publish_group(ctx_store, name, ranks, dist.get_backend(g), weights)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m hexrl.main", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("plan", help="plan.json written by `python -m hexrl.plan`")
    p.add_argument("--run-dir", default=None, help="metrics, checkpoints, final model (default: the job's out_dir)")
    p.add_argument("--resume", default=None, help="a checkpoint directory (or its parent) to continue from; "
                   "under torchrun --max-restarts K a restarted attempt resumes from RUN_DIR/checkpoints itself")
    p.add_argument("--steps", type=int, default=None, help="override rl.steps")
    p.add_argument("--node-name", default=None, help="this launcher's plan node (name or address in cluster.nodes); "
                   "checked against torchrun's node rank (default: the plan node's address must be this machine's)")
    return p.parse_args(argv)


def world_from_env() -> tuple[int, int, int, int]:
    missing = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE") if k not in os.environ]
    if missing:
        sys.exit(f"hexrl.main: {', '.join(missing)} not set; launch with torchrun "
                 "(e.g. torchrun --standalone --nproc_per_node 3 -m hexrl.main plan.json)")
    return tuple(int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))


def refuse(rank: int, why: str) -> None:
    """Exit 2 naming why. Every rank prints it: torchrun stops the others as soon as one exits,
    so a message left to rank 0 alone is lost whenever another rank gets there first. The same
    message is what torchrun's summary shows last (hexrl/runtime/errors.py)."""
    errors.refuse_with(f"hexrl.main (rank {rank}): {why}")
    sys.exit(2)


def load_checked_plan(path: str | dict, rank: int, world: int, local_world: int, steps: int | None,
                      resume: str | None = None) -> tuple[Plan, Inputs]:
    """The plan (a file, or an elastic round's plan as a dict) and the run's input files (tokenizer,
    every prompt, the checkpoint to resume), validated against this world before any collective;
    exits 2 with every problem."""
    try:
        plan = load_plan(path, world=(world, local_world))
        inputs = check_inputs(plan.job, resume, plan.trainer.to_dict())
        if problems := (address_problems(plan) + inputs.problems + cpu_pinning.core_problems(plan.job.cpu_affinity)):
            raise ConfigError(problems, "invalid plan")
    except (ConfigError, FileNotFoundError, ValueError) as e:
        refuse(rank, str(e))
    for note in inputs.notes if rank == 0 else []:
        print(f"hexrl.main: {note}", file=sys.stderr, flush=True)
    if steps is not None:
        plan.job.rl.steps = steps
    return plan, inputs


def elastic_hello(args, rank: int, launch: elastic.Launch, local_world: int) -> tuple[Plan, elastic.Hello]:
    """The job's plan (every node that may take part) and what this rank tells rank 0 about itself;
    exits 2 naming the flag or field when the launch or this launcher's node does not fit the job."""
    try:
        job_plan = load_plan(args.plan)
        shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        if problems := elastic.launch_problems(launch, job_plan, local_world, shared):
            raise ConfigError(problems, "invalid launch")
        node, problems = elastic.own_node(job_plan, args.node_name)
        if problems:
            raise ConfigError(problems, "invalid launch")
    except (ConfigError, FileNotFoundError, ValueError) as e:
        refuse(rank, str(e))
    return job_plan, elastic.Hello(rank, node_rank_from_env(), node, elastic.detected_gpu_type(), os.getpid(),
                                   plan_digest(args.plan, args.steps))


def elastic_round(args, rank: int, world: int, local_world: int) -> dict | None:
    """Under `torchrun --nnodes MIN:MAX` with a dynamic rendezvous, this round's plan (plan.json as a
    dict), made by rank 0 for the nodes present and agreed by every rank (hexrl/runtime/elastic.py);
    None for any other launch (the plan as given). Exits 2 naming what is missing when the round
    cannot run. Sets the attempt number (RESTART_ENV) to the job's round on every rank: a node that
    joined late has been restarted fewer times than the others, and every reader of it must agree."""
    launch = elastic.launcher_args()
    if launch is None or not launch.elastic:
        return None
    job_plan, hello = elastic_hello(args, rank, launch, local_world)
    store = torchrun_store(rank, world)
    run_dir = Path(args.run_dir or job_plan.job.out_dir)
    if rank == 0:
        plan_round = functools.partial(elastic.plan_round, job_plan, hello.job, run_dir)
        round_no, result = elastic.lead(store, hello, world, elastic.next_round(run_dir / "plans"), plan_round)
    else:
        round_no, result = elastic.follow(store, hello)
    if "error" in result:
        refuse(rank, result["error"])
    os.environ[RESTART_ENV] = str(round_no)
    if rank == 0:
        errors.say(f"hexrl.main: elastic {result['reason']}; its plan: {run_dir / 'plans' / f'{round_no}.json'}")
    return result["plan"]


def restart_count() -> int:
    """How many times torchrun has restarted this job's workers (`--max-restarts K`; 0: first attempt).
    ValueError naming the variable unless it is a whole number >= 0: a restart renames the run's
    metrics and resumes, so a count that only looks like one must not start either."""
    raw = os.environ.get(RESTART_ENV) or "0"
    if not re.fullmatch(r"[0-9]{1,9}", raw):
        raise ValueError(f"{RESTART_ENV}={raw[:40]!r}: not a restart count (a whole number >= 0, set by torchrun)")
    return int(raw)


def restarts_left() -> int:
    """The restarts torchrun still allows this job (--max-restarts less those used): a switch of plans
    (hexrl/train/replanning.py) needs one. Read before an elastic round renumbers the attempt."""
    raw = os.environ.get(MAX_RESTARTS_ENV) or "0"
    return max(0, int(raw) - restart_count()) if re.fullmatch(r"[0-9]{1,9}", raw) else 0


def recorded_plan(args, rank: int) -> dict | None:
    """After a torchrun restart of a launch that is not elastic, the run's newest recorded plan
    (RUN_DIR/plans/<round>.json, where a switch of plans records the plan it restarts into); None on a
    first attempt, or when none is recorded (the plan as given). Says so on rank 0."""
    if restart_count() == 0:
        return None
    try:
        job = load_plan(args.plan, check_paths=False).job  # the checks that follow name a missing path
        run_dir = Path(args.run_dir or job.out_dir)
        found = elastic.newest_plan(run_dir / "plans", job)
    except (ConfigError, FileNotFoundError, ValueError) as e:  # ValueError: a recorded plan that is not this job's
        refuse(rank, str(e))
    if found is None:
        return None
    round_no, plan = found
    if rank == 0:
        why = elastic.recorded(plan, "reason", "no reason recorded")
        errors.say(f"hexrl.main: torchrun restart {restart_count()}: the run's newest recorded plan, "
                   f"{run_dir / 'plans' / f'{round_no}.json'} ({why})")
    return plan


def restart_resume(args, rank: int) -> str | None:
    """What a restarted attempt continues from: the run directory's newest complete checkpoint, so
    metrics, trajectory accounting and the staleness gate go on as after a manual --resume. With no
    checkpoint yet, the --resume it was given, else a fresh start (the failed attempt's metrics.jsonl,
    eval.jsonl and lengths.jsonl set aside as *.attemptN.jsonl by rank 0). Says so on rank 0."""
    attempt = restart_count()
    if attempt == 0:
        return args.resume
    run_dir = Path(args.run_dir) if args.run_dir else None
    if run_dir is None:
        try:
            run_dir = Path(load_plan(args.plan).job.out_dir)
        except (ConfigError, FileNotFoundError, ValueError):
            return args.resume  # the checks that follow refuse it, naming why
    root = run_dir / "checkpoints"
    if (root / "latest").is_file():
        from hexrl.train.checkpoint import resolve_complete

        step, _ = resolve_complete(root)
        if rank == 0:
            errors.say(f"hexrl.main: torchrun restart {attempt}: resuming from {root} (its newest complete "
                f"checkpoint, {step.name})")
        return str(root)
    if rank == 0 and args.resume is None:
        for name in ("metrics.jsonl", "eval.jsonl", "lengths.jsonl"):
            if (run_dir / name).exists():
                os.replace(run_dir / name, run_dir / name.replace(".jsonl", f".attempt{attempt - 1}.jsonl"))
    if rank == 0:
        errors.say(f"hexrl.main: torchrun restart {attempt}: no checkpoint in {root} yet; starting "
            + (f"again from --resume {args.resume}" if args.resume else "afresh"))
    return args.resume


def check_run_dir(run_dir: Path, resume: str | None, rank: int) -> None:
    """Refuse to start a fresh run on top of an old one (metrics would interleave); exits 2.
    A restarted attempt continues its own run (`restart_resume`): nothing to refuse."""
    if resume is None and restart_count() == 0 and (run_dir / "metrics.jsonl").exists():
        refuse(rank, f"{run_dir} already holds a run (metrics.jsonl); continue it with "
                     f"--resume {run_dir / 'checkpoints'}, or pass another --run-dir")


@functools.cache
def torchrun_store(rank: int, world: int) -> dist.Store:
    """torchrun's store (env://), connected once: where rank 0 itself hosts it
    (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), a second connection would host it twice."""
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=COLLECTIVE_TIMEOUT))
    return store


def attempt_store(rank: int, world: int) -> dist.Store:
    """torchrun's store (env://), under a prefix of this attempt's own: a restarted attempt reuses the
    agent's store, where the failed attempt's keys (gloo's addresses, the watchdog's failure) remain."""
    return dist.PrefixStore(f"hexrl/attempt{restart_count()}", torchrun_store(rank, world))


def init_distributed(rank: int, world: int, plan: Plan) -> torch.device:
    """The process group, and this rank's compute device declared to hexrl.runtime.dist_rules (whose strict
    mode, under HEXRL_STRICT_COLLECTIVES=1, checks every collective against the NCCL rules)."""
    if torch.cuda.is_available():
        index = plan.ranks[rank].device_index
        torch.cuda.set_device(index)
        limit_memory(plan, rank, index)
        devices = [(x.node, x.device_index) for x in plan.ranks]
        # NCCL for CUDA tensors (every collective of the run); gloo only for the teardown barrier,
        # and for all of a world whose ranks share a GPU (rule 5 of dist_rules)
        backend = dist_rules.group_backend(devices) or "cpu:gloo,cuda:nccl"
        dist.init_process_group(backend, store=attempt_store(rank, world), rank=rank, world_size=world,
                                timeout=COLLECTIVE_TIMEOUT)
        device = torch.device("cuda", index)
    else:
        dist.init_process_group("gloo", store=attempt_store(rank, world), rank=rank, world_size=world,
                                timeout=COLLECTIVE_TIMEOUT)
        device = torch.device("cpu")
    dist_rules.maybe_install(device)
    return device


def limit_memory(plan: Plan, rank: int, index: int) -> None:
    """On a shared GPU each role's allocator may use only its planned share of the device."""
    col = plan.job.colocate
    if col is not None:
        share = col.train_fraction if plan.ranks[rank].role == "train" else col.rollout_fraction
        torch.cuda.set_per_process_memory_fraction(share, index)


def same_plan_problems(store, rank: int, digest: str, describe: dict[int, str]) -> list[str]:
    """Every node must run the same plan (and --steps): compare this rank's digest with rank 0's."""
    store.set(f"hexrl/plan/{rank}", digest)
    store.wait(["hexrl/plan/0"], timedelta(minutes=5))
    first = store.get("hexrl/plan/0").decode()
    if first == digest:
        return []
    return [f"rank {rank} ({describe[rank]}) read a plan different from rank 0's ({describe[0]}): digest "
            f"{digest} vs {first}; give every node the same plan.json, the same hexrl.main flags and the same "
            "run directory (a restarted attempt runs the newest plan in RUN_DIR/plans)"]


def check_placement(args, plan: Plan, store, rank: int, local_rank: int, watchdog: Watchdog,
                    running: dict | None = None) -> None:
    """End the job (exit 2, every rank told why) if this rank is not where the plan puts it, or another
    rank runs another plan (`running`: the plan this attempt runs, where it is not plan.json)."""
    digest = plan_digest(args.plan, args.steps, running)
    problems = placement_problems(plan, rank, local_rank, node_rank_from_env(), args.node_name)
    if not problems:
        problems = same_plan_problems(store, rank, digest, watchdog.describe)
    if problems:
        errors.refuse_with("hexrl.main: " + "\n  ".join(problems))
        watchdog.report_failure("; ".join(problems))
        os._exit(2)


def is_peer_loss(e: BaseException) -> bool:
    """A collective broken from the other side (a peer's process or node died), not a bug here."""
    text = str(e)
    return isinstance(e, RuntimeError) and any(
        k in text for k in ("Connection closed by peer", "Connection reset by peer", "Broken pipe"))


@record  # torch's error file for what escapes main; failures main catches write it themselves
def main(argv=None) -> None:
    args = parse_args(argv)
    rank, world, local_rank, local_world = world_from_env()
    try:
        restarts = restarts_left()  # before an elastic round renumbers the attempt
        agreed = elastic_round(args, rank, world, local_world) or recorded_plan(args, rank)  # None: as given
        args.resume = restart_resume(args, rank)
    except (ValueError, FileNotFoundError) as e:  # the restart count, or the run's checkpoints/latest
        refuse(rank, str(e))
    plan, inputs = load_checked_plan(agreed or args.plan, rank, world, local_world, args.steps, args.resume)
    set_run_umask(plan.job.share_run_dir)  # before this rank writes anything
    pinning = cpu_pinning.pin(plan.job.cpu_affinity, local_rank, local_world)  # before any thread or child starts
    print(cpu_pinning.describe(rank, plan.ranks[rank].role, pinning), flush=True)
    check_run_dir(Path(args.run_dir or plan.job.out_dir), args.resume, rank)
    device = init_distributed(rank, world, plan)
    store = dist.distributed_c10d._get_default_store()  # the job-wide store torchrun set up
    describe = {r.rank: f"{r.role} on {node_label(plan, r.node)}, local rank {r.local_rank}" for r in plan.ranks}
    nodes = {r.rank: node_label(plan, r.node) for r in plan.ranks}
    watchdog = Watchdog(store, rank, world, describe, nodes=nodes).start()
    check_placement(args, plan, store, rank, local_rank, watchdog, agreed)
    role, leaving = plan.ranks[rank].role, False
    try:
        from hexrl.train.grid import build_grid

        grid_groups: list = []
        grid = build_grid(plan.trainer, tied_embeddings=plan.job.model.config.tie_word_embeddings,
                          created=grid_groups)
        groups = build_groups(plan, device.type, grid_groups)
        publish_groups(store, rank, groups)
        info = plan.ranks[rank]
        run_dir = Path(args.run_dir or plan.job.out_dir)
        secret = job_secret(store, rank, run_dir, multi_node=len(plan.job.cluster.nodes) > 1)
        ctx = RankContext(plan=plan, rank=rank, local_rank=local_rank, device=device, run_dir=run_dir,
                          resume=Path(args.resume) if args.resume else None, store=store, layout=plan.trainer,
                          sync_groups=groups.sync,
                          replica_group=groups.replica.get(info.replica) if role == "rollout" else None,
                          watchdog=watchdog, train_prompts=inputs.train, heldout_prompts=inputs.heldout,
                          sync_ipc=groups.sync_ipc, groups=[name for name, _, _ in groups.described], secret=secret,
                          restarts_left=restarts)
        if role == "train":
            from hexrl.train.trainer_rank import run_trainer

            leaving = run_trainer(ctx, grid) is not None  # the trainer ranks left to switch plans
        else:
            from hexrl.rollout.rollout_rank import run_rollout

            run_rollout(ctx)
        cpu_pinning.write_usage(run_dir, rank, role, pinning)
    except BaseException as e:  # noqa: BLE001 - any failure must end the whole job, named
        cause = describe_exception(e)
        # a collective broken by a lost peer: name the ranks that went silent, not this one
        lost = watchdog.lost_peers() if is_peer_loss(e) else None
        refused = isinstance(e, (ConfigError, SecretError))  # bad input, not a bug here
        print(f"[hexrl] rank {rank} ({describe[rank]}) failed: {cause}\n{'' if refused else traceback.format_exc()}"
              + (f"[hexrl] because {lost}\n" if lost else ""), file=sys.stderr, flush=True)
        if lost or refused:  # the reason, without a traceback
            errors.record_message(f"[hexrl] rank {rank} ({describe[rank]}) failed: "
                                  + (f"because {lost}" if lost else str(e)))
        else:
            errors.record_traceback(e)
        watchdog.report_failure(cause)
        os._exit(1)  # skip destructors that could block in a collective
    # Every rank done with its collectives before any tears gloo down (else it can SIGABRT); a CPU
    # all-reduce is a barrier that goes through gloo even where CUDA tensors use NCCL. Its sum tells
    # every rank whether the trainer ranks left to switch plans: then all exit for torchrun to restart them.
    with dist_rules.host_collective():
        switching = torch.tensor([float(leaving)])
        dist.all_reduce(switching)
    if switching.item() > 0:
        errors.record_message(f"hexrl.main (rank {rank}): left to switch plans into the newest RUN_DIR/plans; "
                              "torchrun restarts the workers into it (launch with --max-restarts K)")
    watchdog.finish()
    dist.destroy_process_group()
    # Skip interpreter finalization: a gloo worker thread may still be dropping its last finished
    # work, whose tensors need the GIL, and a thread taking the GIL while Python finalizes aborts
    # the process (SIGABRT after a successful job; seen in about 3 of 1,000 exits on a 2-core machine).
    # Every resource was closed above, so there is nothing left for finalization to do.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(elastic.SWITCH_EXIT if switching.item() > 0 else 0)


if __name__ == "__main__":
    main()
