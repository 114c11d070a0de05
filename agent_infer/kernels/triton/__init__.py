"""Triton kernels for the CUDA path. Importing this package imports triton, so only
`agent_infer.kernels.ops` and the attention backend do it, and only for CUDA tensors.

Each kernel's plain-PyTorch twin lives in `agent_infer/kernels/reference.py`; the tests
compare the two (on CPU through Triton's interpreter, on the GPU at real sizes).
"""

import os

# The kernels are written for fused multiply-adds (their speed, and their rounding in the
# tests' tolerances), Triton's default up to 3.9; from 3.10 the default is to leave them
# unfused unless asked. A setting of the user's own wins.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
