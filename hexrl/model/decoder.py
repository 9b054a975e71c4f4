"""The Qwen2 / Llama decoder in plain torch, split-able into pipeline stages and TP shards.

Tokens are processed flattened (`[T, hidden]`) with explicit positions, so packed training
batches, paged decode steps and plain `[batch, seq]` calls share one code path. Module names
match Hugging Face's (`model.layers.7.self_attn.q_proj.weight`), layers are kept in a
ModuleDict keyed by their *global* index so a pipeline stage holding layers [i, j) still
has HF names.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import ops
from .attention import AttentionBackend, CausalAttention
from .config import ModelConfig
from .fp32_linear import fp32_linear
from .fused import fuse_linears
from .parallel import TPGroup, column_linear, copy_to_tp, embedding, row_linear
from .rotary import Rotary


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.torch_rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup | None, rotary: Rotary):
        super().__init__()
        tp_size = tp.size if tp else 1
        self.layer, self.head_dim = layer, cfg.head_dim
        self.num_heads = cfg.num_attention_heads // tp_size
        self.num_kv_heads = cfg.num_key_value_heads // tp_size
        h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self.q_proj = column_linear(h, q, cfg.qkv_bias, tp, "num_attention_heads*head_dim")
        self.k_proj = column_linear(h, kv, cfg.qkv_bias, tp, "num_key_value_heads*head_dim")
        self.v_proj = column_linear(h, kv, cfg.qkv_bias, tp, "num_key_value_heads*head_dim")
        self.o_proj = row_linear(q, h, cfg.o_bias, tp)
        self.rotary = rotary  # shared by all layers
        self.qkv_proj: nn.Linear | None = None  # q, k, v as one weight once fuse() ran (the rollout engine)

    def fuse(self) -> None:
        """Replace q_proj, k_proj, v_proj by one qkv_proj (in place; each TP rank stacks its own shards)."""
        self.qkv_proj = fuse_linears(self, ("q_proj", "k_proj", "v_proj"))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        if self.qkv_proj is None:
            q = self.rotary(self.q_proj(x).view(t, self.num_heads, self.head_dim), positions)
            k = self.rotary(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim), positions)
            v = self.v_proj(x)
        else:  # one GEMM; RoPE in place on the q and k views of its output (FlashInfer on CUDA)
            q, k, v = self.qkv_proj(x).split([rows for _, rows in self.qkv_proj.parts], dim=-1)
            q, k = ops.rope(q, k, positions, self.rotary, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        return self.o_proj(attn(self.layer, q, k, v).reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup | None):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = column_linear(h, i, cfg.mlp_bias, tp, "intermediate_size")
        self.up_proj = column_linear(h, i, cfg.mlp_bias, tp, "intermediate_size")
        self.down_proj = row_linear(i, h, cfg.mlp_bias, tp, "intermediate_size")
        self.gate_up_proj: nn.Linear | None = None  # gate and up as one weight once fuse() ran

    def fuse(self) -> None:
        """Replace gate_proj and up_proj by one gate_up_proj (in place)."""
        self.gate_up_proj = fuse_linears(self, ("gate_proj", "up_proj"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup | None, rotary: Rotary):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, tp, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, attn)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_residual(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                         attn: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused model's form of `forward`: the residual stream travels apart, so each residual add
        fuses with the norm after it. (h, residual) in, (mlp output, residual) out; the layer's output
        is their sum. residual=None: h is the layer's input (the first layer)."""
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        if residual is None:
            residual, h = h, ops.rms_norm(h, ln1.weight, ln1.eps)
        else:
            h, residual = ops.add_rms_norm(h, residual, ln1.weight, ln1.eps)
        h, residual = ops.add_rms_norm(self.self_attn(h, positions, attn), residual, ln2.weight, ln2.eps)
        return self.mlp(h), residual


class Backbone(nn.Module):
    """HF's `model.*` namespace: embeddings (first stage), layers, final norm (last stage)."""

    def __init__(self, cfg: ModelConfig, layers: range, first: bool, last: bool, tp: TPGroup | None):
        super().__init__()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size, tp) if first else None
        rotary = Rotary(cfg)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i, tp, rotary) for i in layers})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if last else None


class Decoder(nn.Module):
    """A causal LM, or one pipeline stage of it (layers [start, end), TP shard `tp`).

    `model(ids)` with `ids` of shape [batch, seq] returns [batch, seq, vocab] logits (full model).
    Stages call `stage(x, positions, attn)` on flattened tokens instead.
    """

    def __init__(self, cfg: ModelConfig, layers: tuple[int, int] | None = None, tp: TPGroup | None = None):
        super().__init__()
        start, end = layers or (0, cfg.num_hidden_layers)
        if not 0 <= start < end <= cfg.num_hidden_layers:
            raise ValueError(f"layers [{start}, {end}) outside the model's {cfg.num_hidden_layers} layers")
        self.cfg, self.tp, self.layer_range = cfg, tp, (start, end)
        self.fused = False  # q/k/v and gate/up stored fused (fuse()); parameter names differ from HF's then
        self.is_first, self.is_last = start == 0, end == cfg.num_hidden_layers
        self.model = Backbone(cfg, range(start, end), self.is_first, self.is_last, tp)
        self.lm_head = None
        if self.is_last:  # vocab-sharded under TP: each rank produces its slice of the logits
            self.lm_head = column_linear(cfg.hidden_size, cfg.vocab_size, False, tp, "vocab_size")
            if cfg.tie_word_embeddings and self.is_first:
                self.lm_head.weight = self.model.embed_tokens.weight

    def stage(self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """Token ids [T] (first stage) or hidden [T, H] -> hidden [T, H], normed on the last stage."""
        self.reset_rotary()
        h = self.model.embed_tokens(x) if self.is_first else x
        if self.fused:  # the rollout: fused add+norm kernels (ops), the residual stream kept apart
            return self._stage_residual(h, positions, attn)
        for layer in self.model.layers.values():
            h = layer(h, positions, attn)
        return self.model.norm(h) if self.is_last else h

    def _stage_residual(self, h: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        if not self.is_first:
            h = h.clone()  # it becomes the residual stream, which the fused kernels update in place
        residual = None
        for layer in self.model.layers.values():
            h, residual = layer.forward_residual(h, residual, positions, attn)
        if not self.is_last:
            return h + residual
        norm = self.model.norm
        return ops.add_rms_norm(h, residual, norm.weight, norm.eps)[0]

    def fuse(self) -> "Decoder":
        """Store q/k/v and gate/up as one weight each, in place (the rollout's layout: four weight GEMMs
        per layer instead of seven). Idempotent. `hexrl.model.fused.hf_tensors` maps HF names onto it."""
        if not self.fused:
            for layer in self.model.layers.values():
                layer.self_attn.fuse()
                layer.mlp.fuse()
            self.fused = True
            if next(self.parameters()).is_cuda:
                torch.cuda.empty_cache()  # the split tensors' blocks: a KV pool sized from free memory counts them
        return self

    def reset_rotary(self) -> None:
        """Start of a forward pass: drop the shared rotary cos/sin cache."""
        next(iter(self.model.layers.values())).self_attn.rotary.reset()

    def logits(self, hidden: torch.Tensor, fp32: bool = False) -> torch.Tensor:
        """Normed hidden states -> logits (this rank's vocab slice under TP). fp32=True returns float32
        logits whatever the weights' dtype: bf16 inputs, fp32 accumulation, no rounding of the output,
        so behaviour (rollout) and trainer log-probs differ by computation order, not bf16 steps."""
        if not fp32 or hidden.dtype == torch.float32:
            out = self.lm_head(hidden)
            return out.float() if fp32 else out
        x = copy_to_tp(hidden, self.tp)  # the column-parallel input's backward all-reduce, as lm_head does
        return fp32_linear(x, self.lm_head.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """[batch, seq] token ids -> [batch, seq, vocab] logits (full, unsharded model only)."""
        if not (self.is_first and self.is_last):
            raise RuntimeError("forward(ids) needs the whole model; pipeline stages use stage()")
        b, s = ids.shape
        positions = torch.arange(s, device=ids.device).repeat(b)
        h = self.stage(ids.reshape(-1), positions, CausalAttention([s] * b))
        return self.logits(h).view(b, s, -1)

    def init_weights(self, std: float = 0.02, seed: int | None = None) -> None:
        """Random init as HF does (normal(0, std) linears/embeddings, ones for norms)."""
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight") or "layernorm" in name:
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * std)
