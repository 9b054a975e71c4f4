"""The rollout engine: continuous batching over a paged KV cache, interruptible by weight updates.

    engine = Engine(model, EngineConfig(page_size=16), eos_ids=[eos])
    engine.add(Request("a", prompt_ids, max_new_tokens=128, temperature=1.0, seed=1))
    while engine.has_work():
        for out in engine.step():          # Finished(id, token_ids, logprobs, versions, ...)
            ...
    engine.update_weights(state_dict, version=7)   # between steps; unfinished sequences recompute

One step = schedule chunks (decodes, prefill chunks, admissions) -> one forward pass over their
tokens -> lm_head on the last token of each sequence that samples -> sample -> append, finish.

Tensor parallelism: build the Decoder with `tp=TPGroup(...)`. TP rank 0 (the leader) takes
requests and calls `step()`/`update_weights()`/`shutdown()`; each call first broadcasts what
happens (new requests, or an update) to the other ranks, which sit in `follow()`. Every rank
then runs the same deterministic scheduler and samples from the same all-gathered logits with
the same per-request seeds, so all ranks stay in lockstep without shipping tokens around.
"""
from __future__ import annotations

import random
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import torch

from hexrl.model.decoder import Decoder
from hexrl.weights import load_state

from .attention import StepMeta, step_meta
from .cpu_linear import pack_linears
from .pages import PagePool, page_bytes
from .sampler import SlotParams, is_greedy
from .scheduler import Chunk, Scheduler
from .sequence import Finished, Request, Sequence
from .torch_paged import TorchPagedBackend
from .tp import broadcast_from_leader, gather_vocab, min_across

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

    def problems(self) -> list[str]:
        p = []
        for name in ("page_size", "max_batch_tokens", "max_running", "cpu_kv_bytes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                p.append(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.max_pages is not None and (not isinstance(self.max_pages, int) or self.max_pages < 1):
            p.append(f"max_pages must be None or an integer >= 1, got {self.max_pages!r}")
        if not 0 < self.gpu_memory_fraction <= 1:
            p.append(f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction!r}")
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
    generated_tokens: int = 0
    preemptions: int = 0
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
        self._pending: list[Request] = []
        self._live: set = set()  # ids added and not yet finished
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        tp_size = self.tp.size if self.tp else 1
        cfg = model.cfg
        self.heads = (cfg.num_attention_heads // tp_size, cfg.num_key_value_heads // tp_size, cfg.head_dim)
        self.pool = PagePool(range(*model.layer_range), self._num_pages(), self.config.page_size,
                             self.heads[1], cfg.head_dim, self.dtype, self.device)
        self.scheduler = Scheduler(self.pool, self.config.max_batch_tokens, self.config.max_running)
        self.params = SlotParams(self.scheduler.max_running, self.device)
        self._pinned_in = self._pinned_out = self._h2d_done = None
        self.backend, self.graphs = self._make_backend()
        # on CPU, linears run through oneDNN over prepacked weights, faster than F.linear's BLAS call
        self.packed = pack_linears(model) if self.device.type == "cpu" else []

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

    def _make_backend(self):
        """(attention backend, decode graphs or None). On CUDA a missing or broken FlashInfer is an
        error for attention='flashinfer' and a loud warning naming the fallback for 'auto'."""
        from .flashinfer_backend import FlashInferAttention, flashinfer_problem, float_workspace_bytes

        kind, cuda = self.config.attention, self.device.type == "cuda"
        problem = flashinfer_problem(self.device, self.dtype) if kind != "torch" else None
        if kind == "flashinfer" and problem:
            raise ValueError(f"attention='flashinfer' needs a CUDA model in fp16/bf16 and the flashinfer package: "
                             f"{problem}")
        if kind == "auto" and problem and cuda:
            warnings.warn(f"FlashInfer unusable ({problem}): falling back to torch paged attention WITHOUT CUDA "
                          "graphs, many times slower; set attention='torch' to silence this", RuntimeWarning,
                          stacklevel=3)
        if kind == "torch" or problem:
            return TorchPagedBackend(self.pool), None
        workspace = torch.zeros(float_workspace_bytes(*self.heads, self.scheduler.max_running), dtype=torch.uint8,
                                device=self.device)
        backend = FlashInferAttention(self.pool, *self.heads, workspace)
        graphs = None
        if self.config.cuda_graphs and self.tp is not None:
            warnings.warn("CUDA graphs are off for TP > 1 (the all-reduce inside a captured graph is not yet "
                          "covered by a GPU test): decode runs eagerly", RuntimeWarning, stacklevel=3)
        elif self.config.cuda_graphs:
            from .cuda_graph import DecodeGraphs, default_batch_sizes

            sizes = self.config.graph_batch_sizes or default_batch_sizes(self.scheduler.max_running)
            with torch.no_grad():
                graphs = DecodeGraphs(self.model, self.pool, self.heads, workspace, backend.int_workspace,
                                      list(sizes))
        return backend, graphs

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
        if p:
            raise ValueError("; ".join(p))
        if request.seed is None:  # a concrete seed travels to the other TP ranks with the request
            request = replace(request, seed=self._rng.randrange(1 << 31))
        self._live.add(request.id)
        self._pending.append(request)

    def has_work(self) -> bool:
        return bool(self._pending) or self.scheduler.has_work()

    def step(self) -> list[Finished]:
        """Run one batched forward pass; return the requests that finished in it."""
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
        Under TP the leader calls this; followers receive it in follow()."""
        if self.tp and self.is_leader:
            broadcast_from_leader(("update", version), self.tp)
        if callable(weights):
            weights(self.model)
        else:
            load_state(self.model, weights)
        for linear in self.packed:
            linear.drop()
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
            else:
                return

    def shutdown(self) -> None:
        """Leader: release the followers from follow()."""
        if self.tp and self.is_leader:
            broadcast_from_leader(("stop", None), self.tp)

    # ------------------------------------------------------------------ one step

    @torch.no_grad()
    def _step(self, new: list[Request]) -> list[Finished]:
        t0 = time.perf_counter()
        for r in new:
            self.scheduler.add(self._sequence(r))
        decodes = self.scheduler.decode_only()
        step = self._decode_inputs(decodes) if decodes is not None else self._schedule()
        if step is None:
            return []
        tokens, logprobs = self._sample(step)
        finished = self._append(step.sampling, tokens, logprobs)
        s = self.stats
        s.steps += 1
        s.mixed_steps += decodes is None
        s.preemptions = self.scheduler.preemptions
        s.prefill_tokens += step.meta.num_tokens - len(step.sampling)
        s.generated_tokens += len(step.sampling)
        s.seconds += time.perf_counter() - t0
        return finished

    def _schedule(self) -> "StepInputs | None":
        """The general step: chunks of prefills, decodes and admissions."""
        chunks = self.scheduler.schedule()
        if not chunks:
            if self.scheduler.has_work():  # requests are checked to fit the pool, so the oldest can always run
                raise RuntimeError("the scheduler made no progress with work queued (a bug)")
            return None
        if self.scheduler.admitted:
            self.params.admit(self.scheduler.admitted)
        step = self._inputs(chunks)
        for c in chunks:  # sampling sequences are marked cached in _append
            if c.start + c.n < len(c.seq.tokens):
                c.seq.num_cached = c.start + c.n
        return step

    def _sequence(self, r: Request) -> Sequence:
        stops = set(r.stop_ids) | (set() if r.ignore_eos else self.eos_ids)
        return Sequence(req=r, seed=r.seed, tokens=list(r.prompt_ids), stop_ids=frozenset(stops),
                        max_tokens=len(r.prompt_ids) + r.max_new_tokens)

    def _decode_inputs(self, seqs: list[Sequence]) -> "StepInputs | None":
        """A decode step's inputs: slots and lengths in one host-to-device copy; the tokens are each
        slot's last sample, already on the device; the page table is the scheduler's device table."""
        if not seqs:
            return None
        b, kv_lens = len(seqs), [len(s.tokens) for s in seqs]
        rows_d, kv_d = self._h2d([s.slot for s in seqs] + kv_lens).split([b, b])
        meta = step_meta(self.pool.page_size, [1] * b, kv_lens, self.scheduler.tables.flush(), rows_d, kv_d - 1)
        return StepInputs(meta, self.params.last_token[rows_d], seqs, rows_d, kv_d, None, all_greedy(seqs))

    def _inputs(self, chunks: list[Chunk]) -> "StepInputs":
        """Any step's inputs from its chunks (host lists -> one host-to-device copy)."""
        if all(c.n == 1 and c.start + 1 == len(c.seq.tokens) for c in chunks):
            return self._decode_inputs([c.seq for c in chunks])
        b, ns = len(chunks), [c.n for c in chunks]
        kv_lens = [c.start + c.n for c in chunks]
        ids, positions = [], []
        for c in chunks:
            ids += c.seq.tokens[c.start:c.start + c.n]
            positions += range(c.start, c.start + c.n)
        picks = [i for i, c in enumerate(chunks) if c.start + c.n == len(c.seq.tokens)]
        t = len(ids)
        host = ids + positions + [c.seq.slot for c in chunks] + ns + kv_lens + picks
        ids_d, pos_d, rows_d, ns_d, kv_d, picks_d = self._h2d(host).split([t, t, b, b, b, len(picks)])
        token_rows = torch.repeat_interleave(rows_d, ns_d, output_size=t)
        meta = step_meta(self.pool.page_size, ns, kv_lens, self.scheduler.tables.flush(), rows_d, pos_d, token_rows)
        last = (torch.cumsum(ns_d, 0) - 1)[picks_d]  # each sampling chunk's last token
        sampling = [chunks[i].seq for i in picks]
        return StepInputs(meta, ids_d, sampling, rows_d[picks_d], kv_d[picks_d], last, all_greedy(sampling))

    def _h2d(self, values: list[int]) -> torch.Tensor:
        """One int64 host-to-device copy (through a reused pinned buffer on CUDA)."""
        host = torch.from_numpy(np.array(values, dtype=np.int64))
        if self.device.type != "cuda":
            return host
        if self._pinned_in is None or len(self._pinned_in) < len(values):
            self._pinned_in = torch.empty(max(2 * len(values), 4096), dtype=torch.int64, pin_memory=True)
        elif self._h2d_done is not None:
            self._h2d_done.synchronize()  # the last copy out of the buffer has finished
        buf = self._pinned_in[:len(values)]
        buf.copy_(host)
        out = buf.to(self.device, non_blocking=True)
        self._h2d_done = torch.cuda.Event()
        self._h2d_done.record()
        return out

    def _graphed(self, step: "StepInputs") -> bool:
        return self.graphs is not None and step.last is None and len(step.sampling) <= self.graphs.max_batch

    def _forward(self, step: "StepInputs") -> torch.Tensor:
        """Logits [S, V] (full vocab, float32) of the last token of each sampling chunk."""
        meta, n = step.meta, len(step.sampling)
        if self._graphed(step):
            logits = self.graphs.run(meta, step.ids)
            self.stats.graph_steps += 1
        else:
            hidden = self.model.stage(step.ids, meta.positions, self.backend.begin(meta))
            if not n:
                return hidden.new_empty(0, 0)
            logits = self.model.logits(hidden if step.last is None else hidden[step.last], fp32=True)
        if self.tp:
            logits = gather_vocab(logits, self.tp)
        return logits

    def _sample(self, step: "StepInputs") -> tuple[list[int], list[float]]:
        """Forward, then the sampled tokens and their behaviour log-probs, read back in one copy.
        An all-greedy step takes an argmax (inside the decode graph when replayed), never the sampler."""
        if step.greedy and step.sampling and self._graphed(step):
            tokens, logprobs = self.graphs.run_greedy(step.meta, step.ids)
            self.stats.graph_steps += 1
        else:
            logits = self._forward(step)
            if not step.sampling:
                return [], []
            tokens, logprobs = self.params.sample(logits, step.rows, step.kv_lens, step.greedy)
        self.params.last_token[step.rows] = tokens  # the next decode step's input, without a host round trip
        if self.device.type != "cuda":
            return tokens.tolist(), logprobs.tolist()
        packed = torch.stack([tokens.to(torch.int32), logprobs.view(torch.int32)])
        if self._pinned_out is None or self._pinned_out.shape[1] < packed.shape[1]:
            self._pinned_out = torch.empty(2, max(packed.shape[1], self.scheduler.max_running), dtype=torch.int32,
                                           pin_memory=True)
        out = self._pinned_out[:, :packed.shape[1]]
        out.copy_(packed, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        host = out.numpy()
        return host[0].tolist(), host[1].view(np.float32).tolist()

    def _append(self, seqs: list[Sequence], tokens: list[int], logprobs: list[float]) -> list[Finished]:
        """Record the sampled tokens; finish the sequences that should stop (cheap test first)."""
        done, version = [], self.version
        for seq, token, lp in zip(seqs, tokens, logprobs):
            seq.num_cached = len(seq.tokens)  # the sampled chunk ended at the last token
            seq.tokens.append(token)
            seq.logprobs.append(lp)
            seq.versions.append(version)
            if token in seq.stop_ids or len(seq.tokens) >= seq.max_tokens or seq.req.stop_strings:
                reason = self._stop_reason(seq, token)
                if reason is not None:
                    self.scheduler.finish(seq)
                    self._live.discard(seq.req.id)
                    self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
                    done.append(seq.finish(reason))
        return done

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        req = seq.req
        if token in self.eos_ids and not req.ignore_eos:
            return "eos"
        if token in req.stop_ids:
            return "stop"
        if req.stop_strings:
            window = max(len(s) for s in req.stop_strings) + 8  # tokens: enough to hold any stop string
            tail = self.tokenizer.decode(seq.tokens[max(seq.num_prompt, len(seq.tokens) - window):])
            if any(s in tail for s in req.stop_strings):
                return "stop"
        if len(seq.tokens) >= seq.max_tokens:
            return "length"
        return None


@dataclass
class StepInputs:
    """One step's device inputs: tokens, attention metadata, and which rows sample."""

    meta: StepMeta
    ids: torch.Tensor  # [T] token ids
    sampling: list[Sequence]  # the sequences that sample this step (their chunk ends at their last token)
    rows: torch.Tensor  # [S] slot of each sampling chunk
    kv_lens: torch.Tensor  # [S] tokens of each sampling sequence (its sampling offset + prompt)
    last: torch.Tensor | None  # [S] token index of each sampling row; None: every token samples (decode)
    greedy: bool = False  # every sampling sequence is greedy: an argmax, no sampling kernel


def all_greedy(seqs: list[Sequence]) -> bool:
    return all(is_greedy(s.req) for s in seqs)
