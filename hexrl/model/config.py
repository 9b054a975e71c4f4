"""Model configuration: the one parser of a Hugging Face `config.json` (importable without torch).

The planner (through hexrl.schema) and the model both read a checkpoint's shape from here, so a
model the decoder cannot build is refused when the job is planned, not under torchrun.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from hexrl.input_files import read_json

if TYPE_CHECKING:  # torch is imported where it is needed: the planner reads configs without it
    import torch

SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM")
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass
class ModelConfig:
    """Shape and numerics of a Qwen2/Llama-family decoder."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    max_position_embeddings: int = 32768
    architecture: str = "Qwen2ForCausalLM"
    eos_token_id: int | list[int] | None = None
    bos_token_id: int | None = None
    hf: dict = field(default_factory=dict, repr=False)  # the original dict, written back on save

    @staticmethod
    def problems(d: dict) -> list[str]:
        """Every reason `d` (a parsed HF config.json) cannot be built, each naming its field."""
        archs = d.get("architectures") or []
        arch = archs[0] if archs else _arch_from_model_type(d.get("model_type"))
        out = []
        if arch not in SUPPORTED_ARCHITECTURES:
            out.append(f"architectures: unsupported architecture {arch!r} "
                       f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        for key in _REQUIRED:
            v = d.get(key)
            if v is None:
                out.append(f"{key}: missing")
            elif not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                out.append(f"{key}: expected a positive integer, got {v!r}")
        for key in ("num_key_value_heads", "head_dim"):
            v = d.get(key)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                out.append(f"{key}: expected a positive integer, got {v!r}")
        if out:
            return out
        heads = d["num_attention_heads"]
        kv = d.get("num_key_value_heads") or heads
        if heads % kv:
            out.append(f"num_key_value_heads: {kv} does not divide num_attention_heads {heads}")
        if "head_dim" not in d and d["hidden_size"] % heads:
            out.append(f"hidden_size: {d['hidden_size']} not divisible by num_attention_heads {heads}")
        return out

    @classmethod
    def from_hf(cls, d: dict) -> "ModelConfig":
        """Build from a parsed HF config.json, raising ValueError listing every problem."""
        problems = cls.problems(d)
        if problems:
            raise ValueError("invalid model config: " + "; ".join(problems))
        archs = d.get("architectures") or []
        arch = archs[0] if archs else _arch_from_model_type(d.get("model_type"))
        heads = d["num_attention_heads"]
        kv_heads = d.get("num_key_value_heads") or heads
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        rope = d.get("rope_parameters") or {}  # transformers >= 5 nests rope settings here
        theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        is_qwen = arch == "Qwen2ForCausalLM"
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=True if is_qwen else bool(d.get("attention_bias", False)),
            o_bias=False if is_qwen else bool(d.get("attention_bias", False)),
            mlp_bias=False if is_qwen else bool(d.get("mlp_bias", False)),
            max_position_embeddings=d.get("max_position_embeddings", 32768), architecture=arch,
            eos_token_id=d.get("eos_token_id"), bos_token_id=d.get("bos_token_id"), hf=dict(d),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        """Read `config.json` from a checkpoint directory."""
        file = Path(path) / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"{file}: missing (a Hugging Face checkpoint directory needs config.json)")
        d = read_json(file, "config.json")  # InputFileError (a ValueError) names the file
        if not isinstance(d, dict):
            raise ValueError(f"{file}: must hold a JSON object of Hugging Face config fields")
        try:
            return cls.from_hf(d)
        except ValueError as e:
            raise ValueError(f"{file}: {e}") from None

    def to_hf(self) -> dict:
        """The HF config dict, with our fields written over the original ones."""
        d = dict(self.hf)
        d.update(
            architectures=[self.architecture], model_type=_model_type(self.architecture),
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
            tie_word_embeddings=self.tie_word_embeddings, max_position_embeddings=self.max_position_embeddings,
        )
        if self.rope_scaling:
            d["rope_scaling"] = self.rope_scaling
        if self.architecture == "LlamaForCausalLM":
            d["attention_bias"], d["mlp_bias"] = self.qkv_bias, self.mlp_bias
        for key in ("eos_token_id", "bos_token_id"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        return d

    def layer_params(self) -> int:
        """Parameters of one decoder layer: attention, SwiGLU MLP, two norms, and the family's biases."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        n = 2 * h * q + 2 * h * kv + 3 * h * i + 2 * h
        biases = (q + 2 * kv if self.qkv_bias else 0) + (h if self.o_bias else 0) + (2 * i + h if self.mlp_bias else 0)
        return n + biases

    def embed_params(self) -> int:
        """Input embedding plus (if untied) the output head, plus the final norm."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2) + self.hidden_size

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        return self.num_hidden_layers * self.layer_params() + self.embed_params()

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V cache bytes for one token over all layers (whole model, not per TP rank)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes


def _model_type(arch: str) -> str:
    return {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}.get(arch, "unknown")


def _arch_from_model_type(model_type: str | None) -> str:
    return {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}.get(model_type or "", str(model_type))


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies, with Llama-3 style scaling when the config asks for it."""
    import torch

    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = cfg.rope_scaling
    if not s:
        return inv
    kind = s.get("rope_type", s.get("type"))
    if kind == "linear":
        return inv / s["factor"]
    if kind != "llama3":
        raise ValueError(f"config.rope_scaling: rope_type {kind!r} is not supported (supported: linear, llama3)")
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_ctx = s.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(is_mid, mid, scaled)
