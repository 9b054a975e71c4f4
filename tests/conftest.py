import os

# Triton kernels run in the interpreter on CPU machines.
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

# Tiny models on a 2-core machine: one intra-op thread avoids oversubscription, which made
# tiny-model steps tens of times slower when several test processes share the cores.
torch.set_num_threads(1)
