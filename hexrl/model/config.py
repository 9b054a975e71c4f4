"""Model configuration: the one parser of a Hugging Face `config.json` (importable without torch).

The planner (through hexrl.schema) and the model both read a checkpoint's shape from here, so a
model the decoder cannot build is refused when the job is planned, not under torchrun.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from hexrl.input_files import read_json
from hexrl.ranges import number_problem

if TYPE_CHECKING:  # torch is imported where it is needed: the planner reads configs without it
    import torch

SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM")
ARCH = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}  # model_type -> architecture
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


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
        return read_hf(d)[1]

    @classmethod
    def from_hf(cls, d: dict) -> "ModelConfig":
        """Build from a parsed HF config.json, raising ValueError listing every problem."""
        v, problems = read_hf(d)
        if problems:
            raise ValueError("invalid model config: " + "; ".join(problems))
        is_qwen = v["architecture"] == "Qwen2ForCausalLM"
        return cls(
            vocab_size=v["vocab_size"], hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
            num_hidden_layers=v["num_hidden_layers"], num_attention_heads=v["num_attention_heads"],
            num_key_value_heads=v["num_key_value_heads"], head_dim=v["head_dim"], rms_norm_eps=v["rms_norm_eps"],
            rope_theta=v["rope_theta"], rope_scaling=v["rope_scaling"], tie_word_embeddings=v["tie_word_embeddings"],
            qkv_bias=True if is_qwen else v["attention_bias"], o_bias=False if is_qwen else v["attention_bias"],
            mlp_bias=False if is_qwen else v["mlp_bias"], max_position_embeddings=v["max_position_embeddings"],
            architecture=v["architecture"], eos_token_id=v["eos_token_id"], bos_token_id=v["bos_token_id"],
            hf=dict(d),
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

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of a whole checkpoint of this config, by HF name, with its shape (the
        decoder's own parameters; `lm_head.weight` may be absent when the embeddings are tied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
                 "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
                 "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
                 "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)}
        if self.qkv_bias:
            layer |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
        if self.o_bias:
            layer["self_attn.o_proj.bias"] = (h,)
        if self.mlp_bias:
            layer |= {"mlp.gate_proj.bias": (i,), "mlp.up_proj.bias": (i,), "mlp.down_proj.bias": (h,)}
        out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
        for n in range(self.num_hidden_layers):
            out |= {f"model.layers.{n}.{k}": s for k, s in layer.items()}
        return out

    def checkpoint_problems(self, shapes: dict[str, tuple[int, ...]], where: str) -> list[str]:
        """Why a checkpoint holding tensors `shapes` (name -> shape) is not this config's model:
        a missing tensor, a shape the config does not give, or layers past num_hidden_layers
        (a config claiming fewer layers than its checkpoint holds). At most 5, naming `where`."""
        out = []
        for name, shape in self.expected_shapes().items():
            if name not in shapes:
                if not (name == "lm_head.weight" and self.tie_word_embeddings):
                    out.append(f"{where}: lacks tensor {name}")
            elif tuple(shapes[name]) != shape:
                out.append(f"{where}: tensor {name} has shape {list(shapes[name])}, config.json gives {list(shape)}")
        extra = sorted({int(m.group(1)) for n in shapes if (m := _LAYER.match(n))} - set(range(self.num_hidden_layers)))
        if extra:
            out.insert(0, f"{where}: holds layers {extra[:5]}{' ...' if len(extra) > 5 else ''} but config.json says "
                          f"num_hidden_layers {self.num_hidden_layers}")
        return out[:5] + ([f"{where}: and {len(out) - 5} more mismatches"] if len(out) > 5 else [])

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V cache bytes for one token over all layers (whole model, not per TP rank)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes


# ----------------------------------------------------------------------------- the typed reader

# field -> (lo, hi) of a positive integer; the ranges bound what the model allocates from them
_SHAPE = {"vocab_size": 1 << 22, "hidden_size": 1 << 16, "intermediate_size": 1 << 18, "num_hidden_layers": 1024,
          "num_attention_heads": 1024}
_OPTIONAL_SHAPE = {"num_key_value_heads": 1024, "head_dim": 1024}
MAX_POSITIONS = 1 << 21  # the rotary table holds every position: 2M x head_dim floats at most
ROPE_TYPES = ("default", "linear", "llama3")
_FLAGS = ("tie_word_embeddings", "attention_bias", "mlp_bias")


def read_hf(d) -> tuple[dict, list[str]]:
    """(the typed values hexrl uses, every problem naming its field) of a parsed HF config.json:
    the one reader of config fields, for the planner, hexrl.main and hexrl.generate alike. Each
    field has its type and a finite range (hexrl.ranges); a field of the wrong type is named,
    never coerced (`"false"` is not False)."""
    if not isinstance(d, dict):
        return {}, [f"config: must be an object of Hugging Face config fields, got {type(d).__name__}"]
    v, out = {}, []

    def get(key, default, check):
        x = d.get(key, default)
        why = check(x)
        if why:
            out.append(f"{key}: {why}")
        v[key] = x if not why else default
        return v[key]

    archs = d.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        out.append(f"architectures: must be a list of architecture names, got {archs!r}"[:200])
        archs = None
    model_type = d.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        out.append(f"model_type: must be a string, got {model_type!r}"[:200])
        model_type = None
    arch = archs[0] if archs else _arch_from_model_type(model_type)
    if arch not in SUPPORTED_ARCHITECTURES:
        out.append(f"architectures: unsupported architecture {arch!r} "
                   f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    v["architecture"] = arch
    for key, hi in _SHAPE.items():
        get(key, None, lambda x, hi=hi: "missing" if x is None else number_problem(x, 1, hi, integer=True))
    for key, hi in _OPTIONAL_SHAPE.items():
        get(key, None, lambda x, hi=hi: None if x is None else number_problem(x, 1, hi, integer=True))
    get("rms_norm_eps", 1e-6, lambda x: number_problem(x, 0, 1, lo_open=True))
    get("max_position_embeddings", 32768, lambda x: number_problem(x, 1, MAX_POSITIONS, integer=True))
    for key in _FLAGS:
        get(key, False, lambda x: None if isinstance(x, bool) else f"must be true or false, got {x!r}"[:200])
    rope = get("rope_parameters", None, lambda x: None if x is None or isinstance(x, dict)
               else f"must be an object or null, got {type(x).__name__}") or {}  # transformers >= 5 nests rope here
    theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
    if why := number_problem(theta, 0, 1e12, lo_open=True):
        out.append(f"rope_theta: {why}")
    v["rope_theta"] = float(theta) if not why else 10000.0
    scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    out += [f"rope_scaling: {p}" for p in _rope_scaling_problems(scaling)]
    v["rope_scaling"] = scaling if isinstance(scaling, dict) and _rope_type(scaling) != "default" else None
    get("eos_token_id", None, lambda x: _token_id_problem(x, v.get("vocab_size"), lists=True))
    get("bos_token_id", None, lambda x: _token_id_problem(x, v.get("vocab_size"), lists=False))
    for key in (*_SHAPE, *_OPTIONAL_SHAPE, "max_position_embeddings"):  # 4096.0 is read as 4096
        v[key] = int(v[key]) if v.get(key) is not None else v.get(key)
    if not out:
        heads = v["num_attention_heads"]
        v["num_key_value_heads"] = v["num_key_value_heads"] or heads
        if heads % v["num_key_value_heads"]:
            out.append(f"num_key_value_heads: {v['num_key_value_heads']} does not divide num_attention_heads {heads}")
        if v["head_dim"] is None and v["hidden_size"] % heads:
            out.append(f"hidden_size: {v['hidden_size']} not divisible by num_attention_heads {heads}")
        v["head_dim"] = v["head_dim"] or v["hidden_size"] // heads
    return v, out


def _rope_type(s: dict):
    return s.get("rope_type", s.get("type", "default"))


def _rope_scaling_problems(s) -> list[str]:
    """Why a rope_scaling object cannot be applied (rope_inv_freq reads exactly these fields)."""
    if s is None:
        return []
    if not isinstance(s, dict):
        return [f"must be an object or null, got {type(s).__name__}"]
    kind = _rope_type(s)
    if kind not in ROPE_TYPES:
        return [f"rope_type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})"[:200]]
    if kind == "default":
        return []
    fields = {"factor": (None, 0, 1e6)}
    if kind == "llama3":
        fields.update(low_freq_factor=(1.0, 0, 1e6), high_freq_factor=(4.0, 0, 1e6),
                      original_max_position_embeddings=(8192, 0, MAX_POSITIONS))
    out = []
    for key, (default, lo, hi) in fields.items():
        x = s.get(key, default)
        why = "missing" if x is None else number_problem(x, lo, hi, lo_open=True,
                                                           integer=key.startswith("original"))
        if why:
            out.append(f"{key}: {why}")
    if kind == "llama3" and not out and s.get("high_freq_factor", 4.0) <= s.get("low_freq_factor", 1.0):
        out.append("high_freq_factor must be > low_freq_factor")
    return out


def _token_id_problem(x, vocab: int | None, lists: bool) -> str | None:
    """A token id (or, for eos, a list of them) inside the vocabulary; None is allowed."""
    ids = x if lists and isinstance(x, list) else [x]
    if x is None or (lists and x == []):
        return None
    for i in ids:
        if why := number_problem(i, 0, (vocab - 1) if vocab else None, integer=True):
            return why
    return None


def _model_type(arch: str) -> str:
    return {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}.get(arch, "unknown")


def _arch_from_model_type(model_type: str | None) -> str:
    return ARCH.get(model_type or "", str(model_type))


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


def tiny_config(arch: str = "qwen2", vocab: int = 64, hidden: int = 64, layers: int = 4, heads: int = 4,
                kv_heads: int = 2, intermediate: int = 128, tie: bool = True, rope_theta: float = 10000.0) -> dict:
    """An HF config dict for a tiny decoder (GQA when kv_heads < heads); its defaults are the CPU demo's
    model (`hexrl.model.tiny.make_tiny_model`) and the job preset "tiny"."""
    return {
        "architectures": [ARCH[arch]], "model_type": arch, "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": hidden // heads, "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta, "tie_word_embeddings": tie, "max_position_embeddings": 4096,
        "attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
    }
