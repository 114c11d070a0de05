"""Triton kernels for the CUDA path. Importing this package imports triton, so only
`agent_infer.kernels.ops` and the attention backend do it, and only for CUDA tensors.

Each kernel's plain-PyTorch twin lives in `agent_infer/kernels/reference.py`; the tests
compare the two (on CPU through Triton's interpreter, on the GPU at real sizes).
"""
