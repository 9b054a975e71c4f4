"""The rollout engine: continuous batching over a paged KV cache, interruptible by weight updates.

    engine = Engine(model, EngineConfig(page_size=16), eos_ids=[eos])
    engine.add(Request("a", prompt_ids, max_new_tokens=128, temperature=1.0, seed=1))
    while engine.has_work():
        for out in engine.step():          # Finished(id, token_ids, logprobs, versions, ...)
            ...
    engine.update_weights(state_dict, version=7)   # between steps; unfinished sequences recompute

Episodes (multi-turn): a Request with `episode=True` comes out of `step()` at the end of each
turn (its stop string, EOS or the turn's token limit) but stays in the engine, parked with its
KV pages and no decode slot; `engine.extend(id, observation_ids, max_new_tokens)` appends the
environment's tokens and the sequence decodes on, prefilling only those; `engine.release(id)`
ends it. The scheduler frees a parked sequence's pages first when pages run short (it is then
recomputed on resuming), and a weight update drops them like every other page.

One step = the scheduler picks chunks (decodes, prefill chunks, admissions) -> the model runner
(`model_runner.py`) copies their inputs over, runs the forward pass and samples -> the loop
appends the tokens and finishes sequences. With `overlap` (the default), a decode step's tokens
are read back during the next `step()` call, after that call has scheduled and launched its own
step: the host schedules step n + 1 while the device runs step n. A token not yet read back is
PENDING on the host and the slot's last sample on the device (the next decode reads it there). A
sequence found finished when its tokens arrive has already been scheduled into the step in flight:
that row is dropped. Sequences that reach max_new_tokens are released at launch (their length is
known), so they never take such a row. Weight updates first wait for the step in flight.

Moving a sequence to another engine: `engine.withdraw(ids)` takes unfinished requests out and
returns what each generated so far (a `Prefix`: tokens, behaviour log-probs, versions); another
engine's `add(Request(..., prefix=prefix))` recomputes prompt + prefix and samples on. With the
same weights and seed the moved sequence samples the tokens it would have where it was.

Tensor parallelism: build the Decoder with `tp=TPGroup(...)`. TP rank 0 (the leader) takes
requests and calls `step()`/`update_weights()`/`shutdown()`; each call first broadcasts what
happens (new requests, or an update) to the other ranks, which sit in `follow()`. Every rank
then runs the same deterministic scheduler and samples from the same all-gathered logits with
the same per-request seeds, so all ranks stay in lockstep without shipping tokens around.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from hexrl.comm.weights import load_state
from hexrl.model.decoder import Decoder

from .model_runner import ModelRunner, Pending, StepInputs
from .pages import PagePool, page_bytes
from .sampler import request_mode
from .scheduler import Scheduler
from .sequence import PENDING, Finished, Prefix, Request, Sequence
from .tp import broadcast_from_leader, min_across

Weights = dict[str, torch.Tensor] | Callable[[Decoder], None]


@dataclass
class EngineConfig:
    """Engine knobs. The KV pool holds `max_pages` pages if given, else `gpu_memory_fraction` of
    the GPU memory still free after the model is loaded, or `cpu_kv_bytes` on CPU."""

    page_size: int = 16
    max_pages: int | None = None
    gpu_memory_fraction: float = 0.8
    cpu_kv_bytes: int = 256 << 20
    max_batch_tokens: int = 8192  # tokens per forward pass (prefill chunks + decodes)
    max_running: int = 256  # sequences in the running batch (at most max_batch_tokens)
    attention: str = "auto"  # "auto" (FlashInfer when usable, else torch) | "torch" | "flashinfer"
    cuda_graphs: bool = True  # decode graphs; GPU + FlashInfer, TP = 1 only
    graph_batch_sizes: tuple[int, ...] | None = None  # None: 1, 2, 4, 8, 16, 32, multiples of 32, max_running
    overlap: bool = True  # schedule decode step n + 1 before reading step n's tokens back

    def problems(self) -> list[str]:
        p = []
        for name in ("page_size", "max_batch_tokens", "max_running", "cpu_kv_bytes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                p.append(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.max_pages is not None and (not isinstance(self.max_pages, int) or self.max_pages < 1):
            p.append(f"max_pages must be None or an integer >= 1, got {self.max_pages!r}")
        if not 0 < self.gpu_memory_fraction <= 1:
            p.append(f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction!r}")
        for name in ("cuda_graphs", "overlap"):
            if not isinstance(getattr(self, name), bool):
                p.append(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.attention not in ("auto", "torch", "flashinfer"):
            p.append(f"attention must be 'auto', 'torch' or 'flashinfer', got {self.attention!r}")
        if self.graph_batch_sizes is not None:
            from .cuda_graph import batch_size_problems

            p += batch_size_problems(self.graph_batch_sizes, min(self.max_running, self.max_batch_tokens)
                                     if isinstance(self.max_running, int) and isinstance(self.max_batch_tokens, int)
                                     else None)
        return p


@dataclass
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0  # tokens run through the model without producing a sample (incl. recompute)
    generated_tokens: int = 0  # sampled at launch, less the rows of already finished sequences (overlap)
    preemptions: int = 0
    evictions: int = 0  # waiting episodes whose KV pages were taken for others (recomputed on resuming)
    interrupts: int = 0  # weight updates
    graph_steps: int = 0  # decode steps replayed from a CUDA graph
    mixed_steps: int = 0  # steps that prefilled (admissions, recompute) besides decoding
    seconds: float = 0.0  # wall time inside step(), host work and device sync included
    finished: dict[str, int] = field(default_factory=dict)  # finish_reason -> count


class Engine:
    """Continuous-batching generation for one (optionally TP-sharded) whole model. On CPU the model's
    fp32 linears are routed through oneDNN over prepacked weights (`cpu_linear.pack_linears`)."""

    def __init__(self, model: Decoder, config: EngineConfig | None = None, eos_ids: list[int] | int | None = None,
                 tokenizer=None, seed: int = 0):
        self.config = config or EngineConfig()
        problems = self.config.problems()
        if not (model.is_first and model.is_last):
            problems.append("the engine needs a whole model (all layers); pipeline stages are not supported")
        if problems:
            raise ValueError("invalid engine config: " + "; ".join(problems))
        if hasattr(model, "fuse"):  # q/k/v and gate/up as one weight each: 4 weight GEMMs per layer, not 7
            model.fuse()
        self.model, self.tokenizer, self.version = model.eval(), tokenizer, 0
        self.tp = model.tp if model.tp is not None and model.tp.size > 1 else None
        self.is_leader = self.tp is None or self.tp.rank == 0
        self.eos_ids = self._eos_ids(eos_ids)
        self.stats = EngineStats()
        self._rng = random.Random(seed)
        self._pending: list = []  # Requests added and ("extend"|"release", id, ...) ops, not yet applied
        self._parked: dict = {}  # id -> an episode's Sequence between turns (all TP ranks keep it)
        self._resuming: set = set()  # ids extended or released, not yet applied (leader)
        self._live: set = set()  # ids added and not yet finished
        self._inflight: InFlight | None = None  # the launched step whose tokens are not read yet
        self._ready: list[Finished] = []  # finished while waiting for a step in update_weights()
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        tp_size = self.tp.size if self.tp else 1
        cfg = model.cfg
        self.heads = (cfg.num_attention_heads // tp_size, cfg.num_key_value_heads // tp_size, cfg.head_dim)
        self.pool = PagePool(range(*model.layer_range), self._num_pages(), self.config.page_size,
                             self.heads[1], cfg.head_dim, self.dtype, self.device)
        self.scheduler = Scheduler(self.pool, self.config.max_batch_tokens, self.config.max_running,
                                   cfg.max_position_embeddings)
        self.runner = ModelRunner(model, self.pool, self.scheduler.tables, self.scheduler.max_running, self.config,
                                  self.tp, self.heads)

    @property
    def backend(self):
        return self.runner.backend

    @property
    def graphs(self):
        return self.runner.graphs

    @property
    def params(self):
        return self.runner.params

    @property
    def packed(self):
        return self.runner.packed

    # ------------------------------------------------------------------ setup

    def _eos_ids(self, eos_ids) -> set[int]:
        if eos_ids is None:  # the model's and the tokenizer's
            found = self.model.cfg.eos_token_id
            eos_ids = [found] if isinstance(found, int) else list(found or [])
            if self.tokenizer is not None:
                eos_ids += list(getattr(self.tokenizer, "stop_ids", [self.tokenizer.eos_id]))
        return {eos_ids} if isinstance(eos_ids, int) else set(eos_ids)

    def _num_pages(self) -> int:
        c = self.config
        per_page = page_bytes(self.model.layer_range[1] - self.model.layer_range[0], c.page_size,
                              self.heads[1], self.heads[2], self.dtype)
        if c.max_pages is not None:
            n = c.max_pages
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            n = int(free * c.gpu_memory_fraction) // per_page
        else:
            n = c.cpu_kv_bytes // per_page
        if self.tp:  # identical pools keep the ranks' schedulers identical
            n = min_across(n, self.tp, self.device)
        if n < 1:
            raise MemoryError(f"no room for a single KV page ({per_page} bytes); lower the model size or "
                              "raise gpu_memory_fraction / max_pages")
        return n

    # ------------------------------------------------------------------ public API

    @property
    def capacity_tokens(self) -> int:
        """The most tokens (prompt + completion) one sequence can ever hold."""
        return self.pool.num_pages * self.pool.page_size

    def add(self, request: Request) -> None:
        """Queue a request (leader only); it joins the running batch as soon as pages allow."""
        if not self.is_leader:
            raise RuntimeError("only TP rank 0 takes requests; the other ranks run follow()")
        p = request.problems(self.model.cfg.vocab_size)
        if request.id in self._live:
            p.append(f"request {request.id!r}: an unfinished request with this id is already queued")
        if request.stop_strings and self.tokenizer is None:
            p.append(f"request {request.id!r}: stop_strings need the engine to have a tokenizer")
        total = len(request.prompt_ids) + (request.max_new_tokens if isinstance(request.max_new_tokens, int) else 0)
        if total > self.capacity_tokens:
            p.append(f"request {request.id!r}: prompt + max_new_tokens = {total} tokens exceed the KV pool "
                     f"({self.capacity_tokens} tokens = {self.pool.num_pages} pages x {self.pool.page_size})")
        if total > self.model.cfg.max_position_embeddings:  # RoPE's cos/sin table ends there (FlashInfer)
            p.append(f"request {request.id!r}: prompt + max_new_tokens = {total} tokens exceed the model's "
                     f"max_position_embeddings ({self.model.cfg.max_position_embeddings})")
        stops = set(request.stop_ids) | (set() if request.ignore_eos else self.eos_ids)
        if request.prefix is not None and stops & set(request.prefix.token_ids):
            p.append(f"request {request.id!r}: prefix holds a stop or EOS id: that sequence had finished")
        if p:
            raise ValueError("; ".join(p))
        if request.seed is None:  # a concrete seed travels to the other TP ranks with the request
            request = replace(request, seed=self._rng.randrange(1 << 31))
        self._live.add(request.id)
        self._pending.append(request)

    def extend(self, id, token_ids: list[int], max_new_tokens: int) -> None:
        """Leader: append `token_ids` (an observation) to the parked episode `id`; it resumes from its
        cached KV and may generate up to `max_new_tokens` more. ValueError if it would not fit."""
        if not self.is_leader:
            raise RuntimeError("only TP rank 0 extends episodes; the other ranks run follow()")
        seq, p = self._parked.get(id), []
        if seq is None or id in self._resuming:
            raise ValueError(f"episode {id!r} is not parked between turns")
        if not token_ids or any(not isinstance(t, int) or not 0 <= t < self.model.cfg.vocab_size for t in token_ids):
            p.append(f"episode {id!r}: observation ids must be a non-empty list of ids in "
                     f"[0, {self.model.cfg.vocab_size})")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            p.append(f"episode {id!r}: max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        total = len(seq.tokens) + len(token_ids) + (max_new_tokens if isinstance(max_new_tokens, int) else 0)
        if total > self.max_sequence_tokens:
            p.append(f"episode {id!r}: {total} tokens would exceed the most a sequence can hold "
                     f"({self.max_sequence_tokens})")
        if p:
            raise ValueError("; ".join(p))
        self._resuming.add(id)
        self._pending.append(("extend", id, list(token_ids), max_new_tokens))

    def release(self, id) -> None:
        """Leader: end the parked episode `id` and free its pages."""
        if not self.is_leader:
            raise RuntimeError("only TP rank 0 releases episodes; the other ranks run follow()")
        if id not in self._parked or id in self._resuming:
            raise ValueError(f"episode {id!r} is not parked between turns")
        self._resuming.add(id)
        self._pending.append(("release", id))

    def withdraw(self, ids) -> dict:
        """Leader: take the requests `ids` out of this engine (between steps, e.g. at a weight update)
        and return id -> the `Prefix` each generated so far, for another engine to resume
        (`Request(..., prefix=...)`), or its `Finished` if it finished in the step in flight (it
        then no longer comes out of step()). Ids not held (finished earlier, unknown, episodes) are
        left out."""
        if not self.is_leader:
            raise RuntimeError("only TP rank 0 withdraws requests; the other ranks run follow()")
        if self.tp:
            broadcast_from_leader(("withdraw", list(ids)), self.tp)
        return self._withdraw(set(ids))

    def _withdraw(self, wanted: set) -> dict:
        """`withdraw` on every TP rank: all drain the step in flight, then drop the same sequences."""
        self._drain()  # the step in flight's tokens belong to the prefix
        taken: dict = {f.id: f for f in self._ready if f.id in wanted}
        self._ready = [f for f in self._ready if f.id not in wanted]
        for r in [r for r in self._pending if isinstance(r, Request) and r.id in wanted]:
            self._pending.remove(r)  # not started (and on the leader only: no other rank has it yet)
            taken[r.id] = r.prefix or Prefix([], [], [])
        for seq in self._unfinished(wanted - taken.keys()):
            taken[seq.req.id] = Prefix(seq.output, list(seq.logprobs), list(seq.versions))
            self.scheduler.finish(seq)
        self._live -= taken.keys()
        return taken

    def progress(self) -> dict:
        """Leader: id -> tokens generated so far, for every single-turn request not finished."""
        queued = {r.id: len(r.prefix.token_ids) if r.prefix else 0 for r in self._pending if isinstance(r, Request)}
        held = list(self.scheduler.running) + list(self.scheduler.waiting)
        return {**queued, **{s.req.id: len(s.tokens) - s.num_prompt for s in held if not s.done and not s.req.episode}}

    def _unfinished(self, ids: set) -> list[Sequence]:
        """The single-turn sequences with these ids still running or waiting (O(sequences held))."""
        held = list(self.scheduler.running) + list(self.scheduler.waiting)
        return [s for s in held if s.req.id in ids and not s.done and not s.req.episode]

    @property
    def max_sequence_tokens(self) -> int:
        """The most tokens one sequence may reach: the KV pool's and the model's positions' limit."""
        return min(self.capacity_tokens, self.model.cfg.max_position_embeddings)

    def has_work(self) -> bool:
        return bool(self._pending or self._ready) or self.scheduler.has_work() or self._inflight is not None

    def step(self) -> list[Finished]:
        """Run one batched forward pass; return the requests found finished in this call (with overlap,
        a decode step's finishes come out of the next call, when its tokens are read)."""
        if not self.is_leader:
            raise RuntimeError("step() is the leader's; the other TP ranks run follow()")
        if not self.has_work():
            return []
        new, self._pending = self._pending, []
        if self.tp:
            broadcast_from_leader(("step", new), self.tp)
        return self._step(new)

    def generate(self, requests: list[Request]) -> list[Finished]:
        """Add `requests`, step until all of them finish, and return their outputs in request order."""
        for r in requests:
            self.add(r)
        wanted, done = {r.id for r in requests}, {}
        while wanted - done.keys():
            for out in self.step():
                done[out.id] = out
        return [done[r.id] for r in requests]

    @torch.no_grad()
    def update_weights(self, weights: Weights, version: int) -> None:
        """Between steps: load new weights (a state dict of this rank's tensors, copied in place, or a
        callable that loads them into the model in place), drop every KV page, and re-queue each
        unfinished sequence as a prefill of prompt + tokens so far. Later tokens carry `version`.
        A step in flight is first completed on the old weights (its finishes come out of the next
        step()). Under TP the leader calls this; followers receive it in follow()."""
        if self.tp and self.is_leader:
            broadcast_from_leader(("update", version), self.tp)
        self._drain()  # the step in flight ran on the old weights: its tokens are theirs
        if callable(weights):
            weights(self.model)
        else:
            load_state(self.model, weights)
        self.runner.drop_packed()
        self.scheduler.drop_all_kv()
        self.version = version
        self.stats.interrupts += 1

    def follow(self, on_update: Callable[[int], Weights] | None = None) -> None:
        """Loop of a non-leader TP rank: mirror the leader's steps and weight updates until it calls
        shutdown(). `on_update(version)` returns this rank's new weights (it may join a collective)."""
        if self.is_leader:
            raise RuntimeError("follow() is for TP ranks other than 0")
        while True:
            kind, arg = broadcast_from_leader(None, self.tp)
            if kind == "step":
                self._step(arg)
            elif kind == "update":
                if on_update is None:
                    raise RuntimeError("the leader updated weights but follow() was given no on_update")
                self.update_weights(on_update(arg), arg)
            elif kind == "withdraw":
                self._withdraw(set(arg))
            else:
                return

    def shutdown(self) -> None:
        """Leader: release the followers from follow()."""
        if self.tp and self.is_leader:
            broadcast_from_leader(("stop", None), self.tp)

    # ------------------------------------------------------------------ one step

    @torch.no_grad()
    def _step(self, new: list[Request]) -> list[Finished]:
        """Schedule and launch a step, then read the previous one (overlap) or this one."""
        t0 = time.perf_counter()
        for r in new:
            if isinstance(r, Request):
                self.scheduler.add(self._sequence(r))
            else:
                self._apply(r)
        step = self._schedule()
        launched = self._launch(step) if step is not None else None
        finished, self._ready = self._ready, []
        if self._inflight is not None:
            finished += self._read(self._inflight)
            self._inflight = None
        if launched is not None:
            if self.config.overlap and step.last is None:  # a decode step: read it during the next call
                self._inflight = launched
            else:
                finished += self._read(launched)
        self.stats.seconds += time.perf_counter() - t0
        return finished

    def _apply(self, op: tuple) -> None:
        """An episode's "extend" or "release" (on every TP rank, in the leader's order)."""
        seq = self._parked.pop(op[1])
        self._resuming.discard(op[1])
        if op[0] == "release":
            self.scheduler.finish(seq)
            self._live.discard(op[1])
            return
        _, _, ids, max_new = op
        seq.tokens += ids
        seq.turn_start, seq.turn_logprobs = len(seq.tokens), len(seq.logprobs)
        seq.max_tokens = len(seq.tokens) + max_new
        self.scheduler.resume(seq)

    def _drain(self) -> None:
        """Wait for the step in flight and record its tokens (before anything needs them on the host)."""
        if self._inflight is not None:
            self._ready += self._read(self._inflight)
            self._inflight = None

    def _schedule(self) -> StepInputs | None:
        """This step's inputs: the decode-only fast path, or chunks of prefills, decodes and admissions."""
        decodes = self.scheduler.decode_only()
        if decodes is not None:
            return self.runner.prepare_decode(decodes) if decodes else None
        chunks = self.scheduler.schedule()
        if not chunks:
            if self.scheduler.has_work():  # requests are checked to fit the pool, so the oldest can always run
                raise RuntimeError("the scheduler made no progress with work queued (a bug)")
            return None
        step = self.runner.prepare(chunks, self.scheduler.admitted)
        self.stats.mixed_steps += step.last is not None
        for c in chunks:  # sampling sequences are marked cached at launch
            if c.start + c.n < len(c.seq.tokens):
                c.seq.num_cached = c.start + c.n
        return step

    def _sequence(self, r: Request) -> Sequence:
        stops = set(r.stop_ids) | (set() if r.ignore_eos else self.eos_ids)
        prefix = r.prefix or Prefix([], [], [])
        return Sequence(req=r, seed=r.seed, tokens=list(r.prompt_ids) + list(prefix.token_ids),
                        logprobs=list(prefix.logprobs), versions=list(prefix.versions), stop_ids=frozenset(stops),
                        max_tokens=len(r.prompt_ids) + r.max_new_tokens, mode=request_mode(r),
                        turn_start=len(r.prompt_ids))

    def _launch(self, step: StepInputs) -> "InFlight":
        """Run the step on the device; on the host, each sampling sequence gets a PENDING token. A
        sequence that thereby reaches its length limit is released now: whatever it samples, it ends."""
        pending = self.runner.launch(step)
        s = self.stats
        s.steps += 1
        s.graph_steps += step.graph_size > 0
        s.preemptions, s.evictions = self.scheduler.preemptions, self.scheduler.evictions
        s.prefill_tokens += step.meta.num_tokens - len(step.sampling)
        s.generated_tokens += len(step.sampling)  # less the rows dropped at read
        index = []
        for seq in step.sampling:
            seq.num_cached = len(seq.tokens)  # the sampled chunk ended at the last token
            seq.tokens.append(PENDING)
            index.append(len(seq.tokens) - 1)
            if len(seq.tokens) >= seq.max_tokens:
                self._end(seq)
        return InFlight(pending, step.sampling, index, self.version, [s.turn for s in step.sampling])

    def _end(self, seq: Sequence) -> None:
        """Release a finished sequence; an episode's turn only parks it (see Request)."""
        if seq.req.episode:
            self.scheduler.park(seq)
        else:
            self.scheduler.finish(seq)

    def _read(self, step: "InFlight") -> list[Finished]:
        """Record a launched step's tokens; finish the sequences that should stop (cheap test first).
        Rows of sequences that finished in an earlier step (their token index is gone) are dropped."""
        tokens, logprobs = step.pending.read() if step.pending is not None else ([], [])
        done = []
        for seq, i, token, lp, turn in zip(step.seqs, step.index, tokens, logprobs, step.turns):
            if i >= len(seq.tokens) or turn != seq.turn:  # the sequence (or its turn) finished in an earlier step
                self.stats.generated_tokens -= 1
                continue
            seq.tokens[i] = token
            seq.logprobs.append(lp)
            seq.versions.append(step.version)
            if token in seq.stop_ids or i + 1 >= seq.max_tokens or seq.req.stop_strings:
                reason = self._stop_reason(seq, token, i + 1)
                if reason is not None:
                    del seq.tokens[i + 1:]  # PENDING rows of a step launched after this one
                    self._end(seq)
                    self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
                    done.append(seq.finish(reason))
                    if seq.req.episode:
                        seq.turn += 1
                        self._parked[seq.req.id] = seq
                    else:
                        self._live.discard(seq.req.id)
        return done

    def _stop_reason(self, seq: Sequence, token: int, end: int) -> str | None:
        """Why `seq` stops at its token `end - 1` (`token`), or None."""
        req = seq.req
        if token in self.eos_ids and not req.ignore_eos:
            return "eos"
        if token in req.stop_ids:
            return "stop"
        if req.stop_strings:
            window = max(len(s) for s in req.stop_strings) + 8  # tokens: enough to hold any stop string
            tail = self.tokenizer.decode(seq.tokens[max(seq.turn_start, end - window):end])
            if any(s in tail for s in req.stop_strings):
                return "stop"
        if end >= seq.max_tokens:
            return "length"
        return None


@dataclass
class InFlight:
    """A launched step: its tokens' way back, the sequences that sample, where each token goes."""

    pending: Pending | None
    seqs: list[Sequence]
    index: list[int]  # position of each sequence's PENDING token
    version: int  # the weights that produce the tokens
    turns: list[int]  # each sequence's turn at launch
