"""CUDA graphs of the decode forward pass (embeddings -> layers -> lm_head), one per batch size.

A decode step of B sequences replays the graph of the smallest captured size >= B; the extra
rows are padding that attends to (and writes into) the pool's scratch page. Inputs are copied
into static tensors and the FlashInfer decode wrapper is re-planned into static buffers before
each replay. Weights must be updated in place (the graphs hold their addresses).

Memory: every graph writes its logits into one shared float32 [max size, V] buffer (a graph
keeping its own output would hold sum(sizes) x V floats: ~1.3 GB at V = 152k with the old
size list), and all graphs share one memory pool, one float and one int FlashInfer workspace.
Only one graph replays at a time, so sharing is safe.

A decode step replays three graphs of its size: the prologue (token ids = each slot's last sample,
positions = context lengths - 1 and the k/v slots gathered from the fixed-width page table, from
the step's one host-to-device copy of slots and lengths into `inputs`), the forward pass (into the
logits buffer), and a sampling head: argmax for all-greedy steps, else the sampler without or with
its top-k/top-p search (sampler.GREEDY / PLAIN / FILTERED), which also records each slot's new last
token. Padding rows use the sampling parameters' scratch slot and the table's padding row (the
scratch page). `run(meta, ids)` replays the forward pass alone, from given ids.
"""
from __future__ import annotations

import torch

from .attention_meta import StepMeta, build_meta, decode_slots
from .flashinfer_backend import GraphDecodeAttention
from .pages import PagePool
from .sampler import FILTERED, GREEDY, PLAIN, SlotParams


def default_batch_sizes(max_running: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, then every multiple of 32 up to max_running (and max_running itself):
    a padded row costs little in a memory-bound decode step, a captured size costs capture time."""
    sizes = {s for s in (1, 2, 4, 8, 16) if s <= max_running} | set(range(32, max_running + 1, 32)) | {max_running}
    return sorted(sizes)


def batch_size_problems(sizes, max_running: int | None) -> list[str]:
    """What is wrong with a `graph_batch_sizes` setting (a non-empty collection of distinct
    positive integers, none above the running-batch limit)."""
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__") or not list(sizes):
        return [f"graph_batch_sizes must be a non-empty list of integers, got {sizes!r}"]
    sizes = list(sizes)
    p = []
    bad = [s for s in sizes if not isinstance(s, int) or isinstance(s, bool) or s < 1]
    if bad:
        p.append(f"graph_batch_sizes must be integers >= 1, got {bad}")
    elif len(set(sizes)) != len(sizes):
        p.append(f"graph_batch_sizes has duplicates: {sizes}")
    elif max_running is not None and max(sizes) > max_running:
        p.append(f"graph_batch_sizes {max(sizes)} exceeds the running-batch limit {max_running} "
                 "(min of max_running and max_batch_tokens)")
    return p


def pick_size(sizes: list[int], batch: int) -> int:
    """The smallest captured size that holds `batch` rows (sizes sorted ascending)."""
    for s in sizes:
        if s >= batch:
            return s
    raise ValueError(f"no captured graph holds {batch} rows (largest {sizes[-1]})")


class SharedGraphBuffers:
    """The buffers every captured size shares: token ids, positions and the float32 logits.
    Size `bs` uses the first `bs` rows of each (views, so one allocation serves all sizes)."""

    def __init__(self, max_batch: int, vocab: int, device: torch.device):
        self.ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.logits = torch.zeros(max_batch, vocab, dtype=torch.float32, device=device)
        self.tokens = torch.zeros(max_batch, dtype=torch.int64, device=device)  # sampling head outputs
        self.logprobs = torch.zeros(max_batch, dtype=torch.float32, device=device)
        # size bs: slots, then lengths, then the step's new page-table entries (a decode step grows each
        # row by at most one page: room for max_batch of them, so the step's one copy lands here)
        self.inputs = torch.zeros(4 * max_batch, dtype=torch.int64, device=device)

    def views(self, bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.ids[:bs], self.positions[:bs], self.logits[:bs]

    def load(self, ids: torch.Tensor, positions: torch.Tensor, bs: int) -> None:
        """Stage a step's B <= bs rows; the padding rows get token 0 at position 0."""
        b = len(ids)
        self.ids[:b].copy_(ids)
        self.ids[b:bs].zero_()
        self.positions[:b].copy_(positions)
        self.positions[b:bs].zero_()


class DecodeGraphs:
    """Captured decode graphs for a whole model (TP = 1) over one page pool."""

    def __init__(self, model: torch.nn.Module, pool: PagePool, heads: tuple[int, int, int],
                 workspace: torch.Tensor, int_workspace: torch.Tensor, batch_sizes: list[int], params: SlotParams,
                 table: torch.Tensor):
        """`table`: the engine's fixed-width page table (`pages.BlockTable.table`, with its padding row at
        `params.pad_slot`); the prologue gathers each step's k/v slots from it."""
        self.model, self.pool, self.heads, self.params, self.table = model, pool, heads, params, table
        self.workspace, self.int_workspace = workspace, int_workspace
        self.batch_sizes = sorted(set(batch_sizes))
        vocab = model.lm_head.weight.shape[0]  # this rank's vocab slice
        self.buffers = SharedGraphBuffers(self.max_batch, vocab, pool.kv[0].device)
        self.mempool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, tuple] = {}
        for bs in reversed(self.batch_sizes):  # largest first: the smaller ones reuse its memory
            self.graphs[bs] = self._capture(bs)

    @property
    def max_batch(self) -> int:
        return self.batch_sizes[-1]

    def _capture(self, bs: int) -> tuple:
        dev = self.pool.kv[0].device
        ids, positions, logits = self.buffers.views(bs)
        attn = GraphDecodeAttention(self.pool, *self.heads, self.workspace, self.int_workspace, bs)
        attn.plan(build_meta([([self.pool.scratch_page], 0, 1)] * bs, self.pool.page_size, dev))

        def forward() -> None:
            logits.copy_(self.model.logits(self.model.stage(ids, positions, attn), fp32=True))

        rows, kv_lens = self.buffers.inputs[:bs], self.buffers.inputs[bs:2 * bs]

        def prologue() -> None:
            ids.copy_(self.params.last_token[rows])
            decode_slots(self.table, rows, kv_lens, self.pool.page_size, positions, attn.slots.pages,
                         attn.slots.offsets)

        def head(mode: int):
            def sample() -> None:
                tokens, logprobs = self.params.sample(logits, rows, kv_lens, mode)
                self.buffers.tokens[:bs].copy_(tokens)
                self.buffers.logprobs[:bs].copy_(logprobs)
            return sample

        rows.fill_(self.params.pad_slot)  # warm-ups and capture sample into the scratch slot only
        kv_lens.fill_(1)
        heads = {mode: self._record(head(mode)) for mode in (GREEDY, PLAIN, FILTERED)}
        return self._record(forward), attn, self._record(prologue), heads

    def _record(self, fn) -> torch.cuda.CUDAGraph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the graph: lazy init, cuBLAS workspaces
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            fn()
        return graph

    def run(self, meta: StepMeta, ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, V_local] (float32, a view of the shared buffer: read before the next replay)
        for a decode step of B sequences with token ids `ids` [B]."""
        b = len(ids)
        bs = pick_size(self.batch_sizes, b)
        graph, attn, _, _ = self.graphs[bs]
        self.buffers.load(ids, meta.positions, bs)
        attn.plan(meta)
        graph.replay()
        return self.buffers.logits[:b]

    def plan(self, meta: StepMeta, bs: int) -> None:
        """Plan the attention of size bs's graph for this decode step (before `replay`, whose prologue
        writes the k/v slots)."""
        self.graphs[bs][1].plan(meta, slots=False)

    def replay(self, bs: int, b: int, mode: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A planned decode step of b <= bs sequences whose slots and lengths are already in
        `buffers.inputs` (padded to bs): (tokens [b], logprobs [b]), views of shared buffers (copy
        before the next replay)."""
        forward, _, prologue, heads = self.graphs[bs]
        prologue.replay()
        forward.replay()
        heads[mode].replay()
        return self.buffers.tokens[:b], self.buffers.logprobs[:b]
