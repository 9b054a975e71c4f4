"""Rotary position embedding, shared by every layer of a decoder (`hexrl.model.ops.rope` applies it)."""
from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig, rope_inv_freq


class Rotary(nn.Module):
    """Rotary position embedding (non-interleaved halves, as in HF Llama/Qwen2).

    One instance serves every layer of a model: cos/sin are computed once per forward pass
    (`reset()` at its start) for the positions tensor in use, not twice per layer."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.max_positions = cfg.max_position_embeddings
        self._key: tuple | None = None
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
        self._cache: torch.Tensor | None = None

    def reset(self) -> None:
        """Forget the cached cos/sin (a new forward pass; positions may have changed in place)."""
        self._key = self._cos_sin = None

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self._key is None or self._key[0] is not positions or self._key[1] != dtype:
            freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
            emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]  # [T, 1, D]
            self._key, self._cos_sin = (positions, dtype), (emb.cos().to(dtype), emb.sin().to(dtype))
        return self._cos_sin

    def cos_sin_cache(self, device: torch.device) -> torch.Tensor:
        """[max_positions, head_dim] float32: cos of every position's angles, then their sin (FlashInfer's
        layout), made once, with the same fp32 products as `cos_sin`."""
        if self._cache is None or self._cache.device != device:
            pos = torch.arange(self.max_positions, device=device, dtype=torch.float32)
            freqs = pos[:, None] * self.inv_freq.to(device).float()[None, :]
            self._cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        return self._cache

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos_sin(positions, x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin
