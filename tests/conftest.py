import os

# Triton kernels run in the interpreter on CPU machines.
os.environ.setdefault("TRITON_INTERPRET", "1")
