"""Kernel entry points. Each picks the Triton kernel for CUDA tensors (when Triton is
importable) and the PyTorch reference otherwise, so the same model code runs on CPU
and GPU. Triton is imported only when a CUDA tensor first needs it."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

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


def norm_rope_store(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
    cos_sin_cache: torch.Tensor, is_neox: bool,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q [T, H, D] and k [T, Hkv, D] (skipped when the weights are
    None), RoPE on both, then k and v into the paged caches at slot_mapping (-1 = skip).
    Returns (q, k); the Triton version is one kernel working in place."""
    if _use_triton(q):
        from agent_infer.kernels.triton import rope_store

        return rope_store.norm_rope_store(
            positions, q, k, v, q_weight, k_weight, eps, cos_sin_cache, is_neox, k_cache, v_cache, slot_mapping
        )
    if q_weight is not None:
        q, k = reference.rms_norm(q, q_weight, eps), reference.rms_norm(k, k_weight, eps)
    q = reference.apply_rotary(positions, q, cos_sin_cache, is_neox)
    k = reference.apply_rotary(positions, k, cos_sin_cache, is_neox)
    reference.store_kv(k, v, k_cache, v_cache, slot_mapping)
    return q, k


def _gemv_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Batch-1 projections go through the Triton GEMV (reads the weight faster than
    cuBLAS at M = 1, see docs/PERFORMANCE.md); everything else through F.linear."""
    return (
        _use_triton(x) and x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous() and weight.is_contiguous()
        and x.dtype == weight.dtype and x.shape[1] % 16 == 0
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias)."""
    if _gemv_ok(x, weight):
        from agent_infer.kernels.triton import gemv

        return gemv.linear_m1(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu_and_mul(linear(x, weight, bias)) for a [gate | up] weight [2N, K] -> [M, N];
    one kernel on the batch-1 GEMV path."""
    if _gemv_ok(x, weight):
        from agent_infer.kernels.triton import gemv

        return gemv.linear_m1(x, weight, bias, silu_mul=True)
    return silu_and_mul(F.linear(x, weight, bias))


def gumbel_sample(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor
) -> torch.Tensor:
    """argmax(logits / T - log(-log u)) per row, u hashed from (seed, step, token); T = 0: argmax."""
    if _use_triton(logits) and logits.stride(-1) == 1:
        from agent_infer.kernels.triton import sampling

        return sampling.gumbel_sample(logits, temperature, seeds, steps)
    return reference.gumbel_sample(logits, temperature, seeds, steps)
