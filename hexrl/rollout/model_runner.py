"""The model runner: turns a scheduled step into device inputs, runs the forward pass and the
sampler, and hands the sampled tokens back (as nano-vllm's model_runner.py; the scheduler decides,
the engine loop appends).

A step's host inputs, with the page table's new entries, go over in one int64 host-to-device copy
through a pinned buffer. Everything derived from them is computed on the device: positions, token ids
of decodes (each slot's last sample, never read back), the table update and its page-index gathers,
sampling offsets and per-row sampling parameters. On a CUDA-graph decode
step that arithmetic is itself captured (`cuda_graph.DecodeGraphs`): prologue, forward and
sampling head are three graph replays. `launch` returns at once with a `Pending` result whose
device-to-host copy is in flight; `Pending.read()` waits for it, so the engine can schedule the
next step while the device works.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from hexrl.model.decoder import Decoder

from .attention_meta import StepMeta, step_meta
from .cpu_linear import pack_linears
from .pages import PagePool
from .sampler import GREEDY, SlotParams, sampling_mode
from .scheduler import Chunk
from .sequence import PENDING, Sequence
from .torch_paged import TorchPagedBackend
from .tp import gather_vocab


@dataclass
class StepInputs:
    """One step's device inputs: tokens, attention metadata, and which rows sample."""

    meta: StepMeta
    ids: torch.Tensor  # [T] token ids
    sampling: list[Sequence]  # the sequences that sample this step (their chunk ends at their last token)
    rows: torch.Tensor  # [S] slot of each sampling chunk
    kv_lens: torch.Tensor  # [S] tokens of each sampling sequence (its sampling offset + prompt)
    last: torch.Tensor | None  # [S] token index of each sampling row; None: every token samples (decode)
    mode: int = GREEDY  # sampler.GREEDY / PLAIN / FILTERED: the cheapest sampler serving every row
    graph_size: int = 0  # > 0: a decode step replayed from the graph of this batch size


class Pending:
    """A step's sampled tokens and log-probs on their way to the host."""

    def __init__(self, tokens: torch.Tensor, logprobs: torch.Tensor, pinned: torch.Tensor | None):
        self.n, self._tokens, self._logprobs = len(tokens), tokens, logprobs
        self._pinned, self._event = pinned, None
        if pinned is not None:  # CUDA: one async copy of both into a contiguous pinned slice, then an event
            packed = torch.stack([tokens.to(torch.int32), logprobs.view(torch.int32)])
            self._pinned = pinned = pinned[:2 * self.n].view(2, self.n)
            pinned.copy_(packed, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def read(self) -> tuple[list[int], list[float]]:
        """(tokens, logprobs) as host lists; waits for the device if it is still working."""
        if self._pinned is None:
            return self._tokens.tolist(), self._logprobs.tolist()
        self._event.synchronize()
        host = self._pinned.numpy()
        return host[0].tolist(), host[1].view(np.float32).tolist()


class ModelRunner:
    """Owns the attention backend, the decode graphs, the per-slot sampling parameters and the pinned
    staging buffers of one (optionally TP-sharded) whole model over one page pool."""

    def __init__(self, model: Decoder, pool: PagePool, tables, max_running: int, config, tp,
                 heads: tuple[int, int, int]):
        self.model, self.pool, self.tables, self.config, self.tp, self.heads = model, pool, tables, config, tp, heads
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.max_running = max_running
        self.params = SlotParams(max_running, self.device)  # one more slot: the padding rows' scratch slot
        self._pinned_in = self._h2d_done = self._plan_done = None
        self._pinned_out: list[torch.Tensor] = []  # two buffers: one step's copy in flight while one is read
        self._out_turn = 0
        self.uploads = 0  # host-to-device copies of step inputs made so far (one per step)
        self.backend, self.graphs = self._make_backend()
        # on CPU, linears run through oneDNN over prepacked weights, faster than F.linear's BLAS call
        self.packed = pack_linears(model) if self.device.type == "cpu" else []

    def _make_backend(self):
        """(attention backend, decode graphs or None). On CUDA a missing or broken FlashInfer is an
        error for attention='flashinfer' and a loud warning naming the fallback for 'auto'."""
        from .flashinfer_backend import FlashInferAttention, flashinfer_problem, float_workspace_bytes

        kind, cuda = self.config.attention, self.device.type == "cuda"
        problem = flashinfer_problem(self.device, self.dtype, self.heads[2]) if kind != "torch" else None
        if kind == "flashinfer" and problem:
            raise ValueError(f"attention='flashinfer' needs a CUDA model in fp16/bf16 and the flashinfer package: "
                             f"{problem}")
        if kind == "auto" and problem and cuda:
            warnings.warn(f"FlashInfer unusable ({problem}): falling back to torch paged attention WITHOUT CUDA "
                          "graphs, many times slower; set attention='torch' to silence this", RuntimeWarning,
                          stacklevel=4)
        if kind == "torch" or problem:
            return TorchPagedBackend(self.pool), None
        workspace = torch.zeros(float_workspace_bytes(*self.heads, self.max_running), dtype=torch.uint8,
                                device=self.device)
        backend = FlashInferAttention(self.pool, *self.heads, workspace)
        graphs = None
        if self.config.cuda_graphs and self.tp is not None:
            warnings.warn("CUDA graphs are off for TP > 1 (the all-reduce inside a captured graph is not yet "
                          "covered by a GPU test): decode runs eagerly", RuntimeWarning, stacklevel=4)
        elif self.config.cuda_graphs:
            from .cuda_graph import DecodeGraphs, default_batch_sizes

            sizes = self.config.graph_batch_sizes or default_batch_sizes(self.max_running)
            with torch.no_grad():
                graphs = DecodeGraphs(self.model, self.pool, self.heads, workspace, backend.int_workspace,
                                      list(sizes), self.params, self.tables.table)
        return backend, graphs

    def drop_packed(self) -> None:
        """The weights changed in place: the CPU packed copies must be remade."""
        for linear in self.packed:
            linear.drop()

    # ------------------------------------------------------------------ inputs

    def prepare_decode(self, seqs: list[Sequence], admitted: list[Sequence] = ()) -> StepInputs:
        """A decode step's inputs: slots, lengths, the page table's new entries and the sampling parameters of
        sequences admitted this step in one host-to-device copy (padded to the graph's batch size when one
        will replay it); ids, positions and page indices are derived on the device."""
        b, kv_lens = len(seqs), [len(s.tokens) for s in seqs]
        mode = sampling_mode(seqs)
        size = self._graph_size(b)
        pad = max(size - b, 0)
        entries, admission = self.tables.take(), self.params.admission(admitted) if admitted else []
        host = [s.slot for s in seqs] + [self.params.pad_slot] * pad + kv_lens + [1] * pad + entries + admission
        dev = self._h2d(host, self.graphs.buffers.inputs if size else None)
        rows_d, kv_d = dev[:b], dev[b + pad:2 * b + pad]
        table = self.tables.apply(dev[2 * (b + pad):2 * (b + pad) + len(entries)])
        self.params.admit_from(dev[len(host) - len(admission):])
        meta = step_meta(self.pool.page_size, [1] * b, kv_lens, table, rows_d, kv_d - 1, seq_lens=kv_d)
        ids = None if size else self.params.last_token[rows_d]
        return StepInputs(meta, ids, seqs, rows_d, kv_d, None, mode, size)

    def prepare(self, chunks: list[Chunk], admitted: list[Sequence] = ()) -> StepInputs:
        """Any step's inputs from its chunks, with the page table's new entries and the sampling parameters
        of the sequences `admitted` this step (host lists -> one host-to-device copy). A token not yet
        read back (PENDING, the last of its sequence) is its slot's last sample, already on the device."""
        if all(c.n == 1 and c.start + 1 == len(c.seq.tokens) for c in chunks):
            return self.prepare_decode([c.seq for c in chunks], admitted)
        b, ns = len(chunks), [c.n for c in chunks]
        kv_lens = [c.start + c.n for c in chunks]
        ids, positions = [], []
        for c in chunks:
            ids += c.seq.tokens[c.start:c.start + c.n]
            positions += range(c.start, c.start + c.n)
        picks = [i for i, c in enumerate(chunks) if c.start + c.n == len(c.seq.tokens)]
        t = len(ids)
        entries, admission = self.tables.take(), self.params.admission(admitted) if admitted else []
        host = ids + positions + [c.seq.slot for c in chunks] + ns + kv_lens + picks + entries + admission
        ids_d, pos_d, rows_d, ns_d, kv_d, picks_d, entries_d, admission_d = self._h2d(host).split(
            [t, t, b, b, b, len(picks), len(entries), len(admission)])
        self.params.admit_from(admission_d)
        token_rows = torch.repeat_interleave(rows_d, ns_d, output_size=t)
        if PENDING in ids:  # a decode chunk of a sequence whose last token is still on the device
            ids_d = torch.where(ids_d == PENDING, self.params.last_token[token_rows], ids_d)
        meta = step_meta(self.pool.page_size, ns, kv_lens, self.tables.apply(entries_d), rows_d, pos_d, token_rows,
                         kv_d)
        last = (torch.cumsum(ns_d, 0) - 1)[picks_d]  # each sampling chunk's last token
        sampling = [chunks[i].seq for i in picks]
        return StepInputs(meta, ids_d, sampling, rows_d[picks_d], kv_d[picks_d], last, sampling_mode(sampling))

    def _graph_size(self, b: int) -> int:
        if self.graphs is None or b > self.graphs.max_batch:
            return 0
        from .cuda_graph import pick_size

        return pick_size(self.graphs.batch_sizes, b)

    def _h2d(self, values: list[int], into: torch.Tensor | None = None) -> torch.Tensor:
        """One int64 host-to-device copy (through a reused pinned buffer on CUDA), into `into` if given."""
        host = torch.from_numpy(np.array(values, dtype=np.int64))
        self.uploads += 1
        if self.device.type != "cuda":
            return host
        if self._pinned_in is None or len(self._pinned_in) < len(values):
            self._pinned_in = torch.empty(max(2 * len(values), 4096), dtype=torch.int64, pin_memory=True)
        elif self._h2d_done is not None:
            self._h2d_done.synchronize()  # the last copy out of the buffer has finished
        buf = self._pinned_in[:len(values)]
        buf.copy_(host)
        fits = into is not None and len(into) >= len(values)
        out = into[:len(values)] if fits else torch.empty_like(buf, device=self.device)
        out.copy_(buf, non_blocking=True)
        if into is not None and not fits:  # rare: more new pages than `into` has room for
            into.copy_(out[:len(into)])
        self._h2d_done = torch.cuda.Event()
        self._h2d_done.record()
        return out

    # ------------------------------------------------------------------ run

    def launch(self, step: StepInputs) -> Pending | None:
        """Enqueue the step's forward pass and sampling; the sampled tokens (also written to each
        slot's last token on the device) come back through the returned `Pending`."""
        if step.graph_size:
            self._plan(lambda: self.graphs.plan(step.meta, step.graph_size))
            tokens, logprobs = self.graphs.replay(step.graph_size, len(step.sampling), step.mode)
        else:
            logits = self._forward(step)
            if not step.sampling:
                return None
            tokens, logprobs = self.params.sample(logits, step.rows, step.kv_lens, step.mode)
        return Pending(tokens, logprobs, self._out_buffer() if self.device.type == "cuda" else None)

    def _forward(self, step: StepInputs) -> torch.Tensor:
        """Logits [S, V] (full vocab, float32) of the last token of each sampling chunk."""
        meta = step.meta
        ids = step.ids if step.ids is not None else self.params.last_token[step.rows]
        hidden = self.model.stage(ids, meta.positions, self._plan(lambda: self.backend.begin(meta)))
        if not step.sampling:
            return hidden.new_empty(0, 0)
        logits = self.model.logits(hidden if step.last is None else hidden[step.last], fp32=True)
        return gather_vocab(logits, self.tp) if self.tp else logits

    def _plan(self, plan: Callable):
        """Run an attention plan. FlashInfer writes its plan into a pinned host buffer and copies it
        over asynchronously: with overlap, wait until the last plan's copy has left that buffer."""
        if self._plan_done is not None:
            self._plan_done.synchronize()
        out = plan()
        if self.device.type == "cuda":
            self._plan_done = torch.cuda.Event()
            self._plan_done.record()
        return out

    def _out_buffer(self) -> torch.Tensor:
        """Alternate between two pinned [2 x max_running] int32 buffers: with overlap, step n + 1's copy
        is enqueued before step n's is read."""
        if not self._pinned_out:
            self._pinned_out = [torch.empty(2 * self.max_running, dtype=torch.int32, pin_memory=True)
                                for _ in range(2)]
        self._out_turn ^= 1
        return self._pinned_out[self._out_turn]
