"""FlashInfer paged attention: plan once per step, run once per layer.

flashinfer is imported lazily (a GPU-only extra). Two flavours share the k/v write of
`attention.write_kv` and the pool's NHD layout:
  * `FlashInferAttention`: eager; per step it plans the decode wrapper (every sequence has one
    new token) or the prefill wrapper (causal, aligned to the end of each context) for mixed steps;
  * `GraphDecodeAttention`: decode for one fixed batch size, with the page-table and slot
    tensors in static buffers, so a CUDA graph captured once can be re-planned and replayed.
"""
from __future__ import annotations

import torch

from .attention import StepMeta, write_kv
from .pages import PagePool

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace (split-kv partial results)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


def import_flashinfer():
    """The flashinfer module, or an ImportError that says what to do."""
    try:
        import flashinfer
    except ImportError as e:
        raise ImportError("attention='flashinfer' needs the flashinfer package (pip install -e '.[gpu]'); "
                          "use attention='torch' otherwise") from e
    return flashinfer


def flashinfer_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the FlashInfer backend can run here (CUDA, fp16/bf16, package importable)."""
    if device.type != "cuda" or dtype not in SUPPORTED_DTYPES:
        return False
    try:
        import_flashinfer()
    except ImportError:
        return False
    return True


def _use_tensor_cores(num_qo_heads: int, num_kv_heads: int) -> bool:
    return num_qo_heads // num_kv_heads >= 4  # large GQA groups decode faster as a tensor-core prefill


class FlashInferAttention:
    """Eager FlashInfer backend; `begin(meta)` plans a step and returns the attention callable."""

    def __init__(self, pool: PagePool, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 workspace: torch.Tensor):
        fi = import_flashinfer()
        self.pool, self.dtype = pool, pool.kv[0].dtype
        self.heads = (num_qo_heads, num_kv_heads, head_dim)
        tc = _use_tensor_cores(num_qo_heads, num_kv_heads)
        self.decode = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tc)
        self.prefill = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        self.meta: StepMeta | None = None
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
        self.meta = meta
        return self

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = self.pool.layer(layer)
        write_kv(cache, self.meta.slot_pages, self.meta.slot_offsets, k, v)
        return self._wrapper.run(q.contiguous(), cache)


class GraphDecodeAttention:
    """Decode attention for exactly `batch_size` sequences, planned into static buffers."""

    def __init__(self, pool: PagePool, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 workspace: torch.Tensor, batch_size: int):
        fi = import_flashinfer()
        dev = pool.kv[0].device
        self.pool, self.dtype, self.batch_size = pool, pool.kv[0].dtype, batch_size
        self.heads = (num_qo_heads, num_kv_heads, head_dim)
        self.indptr = torch.zeros(batch_size + 1, dtype=torch.int32, device=dev)
        self.indices = torch.zeros(pool.num_pages + batch_size, dtype=torch.int32, device=dev)
        self.last_page_len = torch.ones(batch_size, dtype=torch.int32, device=dev)
        self.slot_pages = torch.full((batch_size,), pool.scratch_page, dtype=torch.int64, device=dev)
        self.slot_offsets = torch.zeros(batch_size, dtype=torch.int64, device=dev)
        self.wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, use_tensor_cores=_use_tensor_cores(num_qo_heads, num_kv_heads),
            paged_kv_indptr_buffer=self.indptr, paged_kv_indices_buffer=self.indices,
            paged_kv_last_page_len_buffer=self.last_page_len,
        )

    def plan(self, meta: StepMeta) -> None:
        """Point the static buffers at this step's (padded) batch; call before replaying the graph."""
        if len(meta.q_lens) != self.batch_size or not meta.is_decode:
            raise ValueError(f"graph decode expects {self.batch_size} one-token rows, got q_lens={meta.q_lens}")
        csr = meta.csr()
        self.wrapper.plan(csr["kv_indptr"], csr["kv_indices"], csr["kv_last_page_len"], *self.heads,
                          meta.page_size, q_data_type=self.dtype, kv_data_type=self.dtype)
        self.slot_pages.copy_(meta.slot_pages, non_blocking=True)
        self.slot_offsets.copy_(meta.slot_offsets, non_blocking=True)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = self.pool.layer(layer)
        write_kv(cache, self.slot_pages, self.slot_offsets, k, v)
        return self.wrapper.run(q.contiguous(), cache)
