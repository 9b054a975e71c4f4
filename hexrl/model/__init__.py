"""The decoder model (Qwen2 / Llama family) and its Hugging Face checkpoint I/O."""
from .attention import AttentionBackend, CausalAttention
from .checkpoint import CheckpointError, load_pretrained, save_pretrained, save_state_dict
from .config import ModelConfig
from .decoder import Decoder
from .parallel import TPGroup

__all__ = [
    "AttentionBackend", "CausalAttention", "CheckpointError", "Decoder", "ModelConfig", "TPGroup",
    "load_pretrained", "save_pretrained", "save_state_dict",
]
