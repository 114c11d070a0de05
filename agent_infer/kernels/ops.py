"""Kernel entry points. Each picks the Triton kernel for CUDA tensors (when Triton is
importable) and the PyTorch reference otherwise, so the same model code runs on CPU
and GPU. Triton is imported only when a CUDA tensor first needs it."""

from __future__ import annotations

import functools

import torch

from agent_infer.kernels import reference


@functools.cache
def triton_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and triton_available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _use_triton(x):
        from agent_infer.kernels.triton import norm

        return norm.rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual). The Triton version works in place:
    x receives the normalised output and residual the sum."""
    if _use_triton(x):
        from agent_infer.kernels.triton import norm

        return norm.fused_add_rms_norm(x, residual, weight, eps)
    return reference.fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if _use_triton(x):
        from agent_infer.kernels.triton import activation

        return activation.silu_and_mul(x)
    return reference.silu_and_mul(x)


def apply_rotary_qk(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, H, D] and k [T, Hkv, D]; the Triton version rotates in place."""
    if _use_triton(q):
        from agent_infer.kernels.triton import rotary

        return rotary.apply_rotary_qk(positions, q, k, cos_sin_cache, is_neox)
    return (
        reference.apply_rotary(positions, q, cos_sin_cache, is_neox),
        reference.apply_rotary(positions, k, cos_sin_cache, is_neox),
    )


def gumbel_sample(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor
) -> torch.Tensor:
    """argmax(logits / T - log(-log u)) per row, u hashed from (seed, step, token); T = 0: argmax."""
    if _use_triton(logits) and logits.stride(-1) == 1:
        from agent_infer.kernels.triton import sampling

        return sampling.gumbel_sample(logits, temperature, seeds, steps)
    return reference.gumbel_sample(logits, temperature, seeds, steps)
