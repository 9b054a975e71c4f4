from setuptools import find_packages, setup

setup(
    name="hexrl",
    version="0.1.0",
    description="Asynchronous GRPO trainer for language models on heterogeneous GPU clusters",
    packages=find_packages(include=["hexrl", "hexrl.*", "kernels", "kernels.*"]),
    python_requires=">=3.10",
    # torch is deliberately unpinned-from-above: CI installs the local CPU build first.
    install_requires=[
        "torch>=2.4",
        "numpy",
        "pyzmq",
        "msgpack",
        "highspy",
        "triton",
        "safetensors",  # HF checkpoint format: a well-kept, tiny, zero-copy reader beats writing one
        "tokenizers",  # HF tokenizer.json: BPE/merges handling is not worth re-implementing
    ],
    extras_require={
        "gpu": ["flashinfer-python"],
        "dev": ["pytest", "pytest-timeout", "transformers"],
        "plot": ["matplotlib"],
    },
)
