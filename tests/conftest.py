import os
import shutil

# Triton kernels run in the interpreter on CPU machines (no nvidia-smi: no GPU to compile for).
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Every torch.distributed call made by tests, spawned worlds and torchrun jobs they start is
# checked against the NCCL rules (hexrl/runtime/dist_rules.py); a test may set it to 0 to opt out.
os.environ.setdefault("HEXRL_STRICT_COLLECTIVES", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Tiny models on a 2-core machine: one intra-op thread avoids oversubscription, which made
# tiny-model steps tens of times slower when several test processes share the cores.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def one_thread():
    """Every test starts with one thread, whatever the one before it set (restored after)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
