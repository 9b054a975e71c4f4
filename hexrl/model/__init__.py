"""The decoder model (Qwen2 / Llama family) and its Hugging Face checkpoint I/O.

Import from the submodules (`hexrl.model.decoder`, `.hf_checkpoint`, ...): this package imports
nothing itself, so `hexrl.model.config` (the HF config parser) loads without torch.
"""
