"""FlashInfer paged attention: plan once per step, run once per layer.

flashinfer is imported lazily (a GPU-only extra). Two flavours share the k/v write
(`hexrl.model.ops.append_kv`: FlashInfer's `append_paged_kv_cache`) and the pool's NHD layout:
  * `FlashInferAttention`: eager; per step it plans the decode wrapper (every sequence has one
    new token) or the prefill wrapper (causal, aligned to the end of each context) for mixed steps;
  * `GraphDecodeAttention`: decode for one fixed batch size, with the page-table and slot
    tensors in static buffers, so a CUDA graph captured once can be re-planned and replayed.
"""
from __future__ import annotations

import torch

from hexrl.model.ops import KVSlots, append_kv, head_dim_problem

from .attention_meta import StepMeta
from .pages import PagePool

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace (split-kv partial results)
INT_WORKSPACE_BYTES = 8 << 20  # FlashInfer's own default for the int (plan) workspace
MAX_KV_SPLITS = 32  # split-kv chunks per sequence we size the float workspace for
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


def float_workspace_bytes(num_qo_heads: int, num_kv_heads: int, head_dim: int, max_running: int) -> int:
    """The float workspace for split-kv partial outputs and log-sum-exps of up to `max_running`
    sequences: at least FlashInfer's 128 MiB, more for wide models at large batch (a 14B model
    overflows 128 MiB above ~310 sequences)."""
    per_seq = num_qo_heads * (head_dim + 1) * 4 * MAX_KV_SPLITS  # fp32 output + lse per split
    return max(WORKSPACE_BYTES, max_running * per_seq)


def import_flashinfer():
    """The flashinfer module, or an ImportError that says what to do."""
    try:
        import flashinfer
    except ImportError as e:
        raise ImportError("attention='flashinfer' needs the flashinfer package (pip install -e '.[gpu]'); "
                          "use attention='torch' otherwise") from e
    return flashinfer


def flashinfer_problem(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the FlashInfer backend cannot run here (None when it can)."""
    if device.type != "cuda":
        return f"the model is on {device}, FlashInfer needs CUDA"
    if dtype not in SUPPORTED_DTYPES:
        return f"the model is {dtype}, FlashInfer needs float16 or bfloat16"
    if problem := head_dim_problem(head_dim):
        return problem
    try:
        import_flashinfer()
    except Exception as e:  # ImportError, or a broken install failing at import
        return f"importing flashinfer failed: {e}"
    return None


def _use_tensor_cores(num_qo_heads: int, num_kv_heads: int) -> bool:
    return num_qo_heads // num_kv_heads >= 4  # large GQA groups decode faster as a tensor-core prefill


def attention_modules(num_qo_heads: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype) -> list[tuple[str, tuple]]:
    """The FlashInfer JIT modules our plans load for a model, as (kind, the arguments FlashInfer's
    `gen_batch_{kind}_module` takes): the fa2 prefill (mixed steps, and decode with tensor cores), else
    also the decode kernel. q, kv and out in `dtype`, int32 indptr, no RoPE in the kernel, no sliding
    window, no soft cap (and no fp16 qk reduction for prefill): what `plan(...)` passes for our calls.
    tools/device/flashinfer_aot.py builds these ahead of time."""
    common = (dtype, dtype, dtype, torch.int32, head_dim, head_dim, 0, False, False)
    mods = [("prefill", ("fa2", *common, False))]
    if not _use_tensor_cores(num_qo_heads, num_kv_heads):
        mods.append(("decode", common))
    return mods


class FlashInferAttention:
    """Eager FlashInfer backend; `begin(meta)` plans a step and returns the attention callable.
    Its int workspace is shared with the CUDA-graph wrappers (only one plan is live at a time)."""

    name = "flashinfer"

    def __init__(self, pool: PagePool, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 workspace: torch.Tensor):
        fi = import_flashinfer()
        self.pool, self.dtype = pool, pool.kv[0].dtype
        self.heads = (num_qo_heads, num_kv_heads, head_dim)
        self.int_workspace = torch.zeros(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=workspace.device)
        tc = _use_tensor_cores(num_qo_heads, num_kv_heads)
        self.decode = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tc)
        # fa2 explicitly: "auto" picks FA3 on H100, a second long JIT build for no gain at our sizes
        self.prefill = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
        for w in (self.decode, self.prefill):
            w.reset_workspace_buffer(workspace, self.int_workspace)
        self.meta: StepMeta | None = None
        self.slots: KVSlots | None = None
        self._wrapper = None

    def begin(self, meta: StepMeta) -> "FlashInferAttention":
        csr = meta.csr()
        kw = dict(q_data_type=self.dtype, kv_data_type=self.dtype)
        if meta.is_decode:
            self.decode.plan(csr["kv_indptr"], csr["kv_indices"], csr["kv_last_page_len"], *self.heads,
                             meta.page_size, **kw)
            self._wrapper = self.decode
        else:
            self.prefill.plan(csr["qo_indptr"], csr["kv_indptr"], csr["kv_indices"], csr["kv_last_page_len"],
                              *self.heads, meta.page_size, causal=True, **kw)
            self._wrapper = self.prefill
        self.meta, self.slots = meta, KVSlots.of(meta.slot_pages, meta.slot_offsets)
        return self

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = self.pool.layer(layer)
        append_kv(cache, k, v, self.slots)
        return self._wrapper.run(q.contiguous(), cache)


class GraphDecodeAttention:
    """Decode attention for exactly `batch_size` sequences, planned into static buffers."""

    def __init__(self, pool: PagePool, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 workspace: torch.Tensor, int_workspace: torch.Tensor, batch_size: int):
        fi = import_flashinfer()
        dev = pool.kv[0].device
        self.pool, self.dtype, self.batch_size = pool, pool.kv[0].dtype, batch_size
        self.heads = (num_qo_heads, num_kv_heads, head_dim)
        self.indptr = torch.zeros(batch_size + 1, dtype=torch.int32, device=dev)
        self.indices = torch.zeros(pool.num_pages + batch_size, dtype=torch.int32, device=dev)
        self.last_page_len = torch.ones(batch_size, dtype=torch.int32, device=dev)
        scratch = torch.full((batch_size,), pool.scratch_page, dtype=torch.int64, device=dev)
        self.slots = KVSlots.of(scratch, torch.zeros_like(scratch))  # static: the graph holds their addresses
        self.wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, use_tensor_cores=_use_tensor_cores(num_qo_heads, num_kv_heads),
            paged_kv_indptr_buffer=self.indptr, paged_kv_indices_buffer=self.indices,
            paged_kv_last_page_len_buffer=self.last_page_len,
        )
        self.wrapper.reset_workspace_buffer(workspace, int_workspace)

    def plan(self, meta: StepMeta, slots: bool = True) -> None:
        """Point the static buffers at this step's decode batch (B <= batch_size rows; the rest are
        padding on the pool's scratch page); call before replaying the graph. `slots=False`: the graph's
        prologue writes the k/v slots itself (`attention.decode_slots`)."""
        b = len(meta.q_lens)
        if b > self.batch_size or not meta.is_decode:
            raise ValueError(f"graph decode expects <= {self.batch_size} one-token rows, got q_lens={meta.q_lens}")
        # the page indices are gathered on the device straight into the wrapper's buffer, so its plan's
        # copy of them is a no-op (same memory); indptr and last_page_len are host arrays its plan reads
        csr = pad_csr(meta.csr(self.indices), self.batch_size, self.pool.scratch_page, self.indices)
        self.wrapper.plan(csr["kv_indptr"], csr["kv_indices"], csr["kv_last_page_len"], *self.heads,
                          meta.page_size, q_data_type=self.dtype, kv_data_type=self.dtype)
        if slots:
            self.slots.pages[:b].copy_(meta.slot_pages, non_blocking=True)
            self.slots.pages[b:].fill_(self.pool.scratch_page)
            self.slots.offsets[:b].copy_(meta.slot_offsets, non_blocking=True)
            self.slots.offsets[b:].zero_()

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = self.pool.layer(layer)
        append_kv(cache, k, v, self.slots)
        return self.wrapper.run(q.contiguous(), cache)


def pad_csr(csr: dict[str, torch.Tensor], batch_size: int, scratch_page: int,
            indices_buf: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Extend a decode step's page-table arrays to `batch_size` rows; each padding row attends to one
    token on the scratch page (what it computes is never read). With `indices_buf` (holding kv_indices
    at its start) the padding indices are written after them in place."""
    pad = batch_size - len(csr["kv_last_page_len"])
    if pad <= 0:
        return csr
    indptr, indices = csr["kv_indptr"], csr["kv_indices"]
    if indices_buf is not None:
        indices_buf[len(indices):len(indices) + pad].fill_(scratch_page)
        indices = indices_buf[:len(indices) + pad]
    else:
        indices = torch.cat([indices, indices.new_full((pad,), scratch_page)])
    return dict(qo_indptr=torch.arange(batch_size + 1, dtype=torch.int32),
                kv_indptr=torch.cat([indptr, indptr[-1] + torch.arange(1, pad + 1, dtype=indptr.dtype)]),
                kv_indices=indices,
                kv_last_page_len=torch.cat([csr["kv_last_page_len"], torch.ones(pad, dtype=torch.int32)]))
