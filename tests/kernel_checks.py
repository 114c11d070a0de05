"""Checks of the Triton kernels against `agent_infer/kernels/reference.py` (the paged
attention ones in tests/attention_checks.py), shared by
tests/test_triton_interpreter.py (CPU tensors through Triton's interpreter, small sizes)
and tests/gpu/test_kernels.py (CUDA, real sizes).

Inputs are random (never zeros). Every `torch.empty` made during a kernel call is filled
with NaN (`poisoned_empty`), so an output element or scratch slot a kernel forgets to
write shows up as a failure. In-place kernels are checked over whole tensors, so stray
or missing writes show too. Errors are ||out - ref|| / ||ref||.
"""

from __future__ import annotations

import math
import os
from contextlib import contextmanager
from typing import Iterator

import torch

from agent_infer.kernels import reference

# Relative-error bounds. The interpreter rounds fp32 -> bf16 by truncation (the GPU
# rounds to nearest), so bf16 gets a little more room.
TOLERANCE = {
    torch.float32: 2e-5,
    torch.float16: 1e-2,
    torch.bfloat16: 2e-2 if os.environ.get("TRITON_INTERPRET") == "1" else 1e-2,
    # An fp8 cache written from slightly different K (the kernel's RoPE against the
    # reference's) may round a few elements to the neighbouring e4m3 value (6 % apart).
    torch.float8_e4m3fn: 2e-2,
}
FP8 = torch.float8_e4m3fn


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical (torch.equal has no fp8 kernel on every device)."""
    if a.dtype.itemsize == 1 and a.dtype.is_floating_point:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def fp8_values(x: torch.Tensor) -> torch.Tensor:
    """x rounded to values an e4m3 cache holds exactly, kept in x's dtype. Storing them is
    exact, so a cache write can be compared bit for bit even where Triton's interpreter
    rounds fp32 -> fp8 wrongly (it does near powers of two)."""
    return reference.to_cache_dtype(x, FP8).to(x.dtype)


def kv_cache_randn(*shape: int, dtype: torch.dtype, cache_dtype: torch.dtype | None, device, seed: int) -> torch.Tensor:
    """Random cache contents in the cache's dtype (the model's when `cache_dtype` is None)."""
    x = randn(*shape, dtype=dtype, device=device, seed=seed)
    return x if cache_dtype in (None, dtype) else reference.to_cache_dtype(x, cache_dtype)


@contextmanager
def poisoned_empty() -> Iterator[None]:
    """torch.empty returns NaN-filled floats (and int max) while inside."""
    was_on = torch.are_deterministic_algorithms_enabled()
    was_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill
        torch.use_deterministic_algorithms(was_on, warn_only=was_warn)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, what: str, dtype: torch.dtype | None = None) -> None:
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{what}: non-finite values (an unwritten element?)"
    err = rel_err(out, ref)
    tol = TOLERANCE[dtype or ref.dtype]
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:g}"


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def randn(*shape: int, dtype: torch.dtype, device: str | torch.device, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(dtype=dtype, device=device)


def capture_graph(forward):
    """A CUDA graph of `forward` and what the captured call returned; a first call on a
    side stream compiles and warms up outside the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
    return graph, out


def patch_interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter turns a scalar into a Python int with int(ndarray of
    shape (1,)), which numpy >= 2.4 refuses, so loops with device-valued bounds fail
    (triton-lang/triton#9171, fixed upstream). Use .item() instead; interpreter only."""
    from triton.runtime import interpreter as _interpreter

    original = getattr(_interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_agent_infer_patched", False):
        return  # a triton whose interpreter is organised differently (or already patched)

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patched._agent_infer_patched = True
    _interpreter._patch_lang_tensor = patched


def patch_interpreter_device_calls() -> None:
    """Triton's interpreter patches triton.language for a launch, and then again at every
    call of a @triton.jit helper inside it (a scan of every module member, ~2 ms), though
    the launch's patch is still in place: in the whole-model checks that was a third of the
    time. Inside a launch, a helper whose language modules are patched already skips the
    repeat; one that sees another module (triton's own helpers see triton.language.core)
    is patched as before. Launches never nest. Interpreter only."""
    from triton.runtime import interpreter as _interpreter

    original = getattr(_interpreter, "_patch_lang", None)
    if original is None or getattr(original, "_agent_infer_patched", False):
        return
    patched_now: set[int] = set()  # ids of the modules patched during the launch in progress
    launching = [False]

    class _Nothing:
        def restore(self) -> None:
            pass

    def patched(fn):
        langs = {id(v) for v in fn.__globals__.values() if v is _interpreter.tl or v is _interpreter.tl.core}
        if launching[0]:  # a helper called inside a launch: its scope is never restored
            if langs and langs <= patched_now:
                return _Nothing()
            patched_now.update(langs)
            return original(fn)
        scope = original(fn)
        launching[0] = True
        patched_now.update(langs)
        restore = scope.restore

        def restore_and_end() -> None:
            restore()
            patched_now.clear()
            launching[0] = False

        scope.restore = restore_and_end
        return scope

    patched._agent_infer_patched = True
    _interpreter._patch_lang = patched


# ---- norms, activation, rotary ----------------------------------------------------------


def check_rms_norm(device, dtype: torch.dtype, tokens: int, heads: int | None, dim: int, strided: bool) -> None:
    """x is [tokens, dim], or [tokens, heads, dim] taken as a strided view of a wider
    merged-QKV-like buffer when `strided`."""
    from agent_infer.kernels.triton import norm

    lead = (tokens,) if heads is None else (tokens, heads)
    if strided:
        width = math.prod(lead[1:]) * dim
        buf = randn(tokens, width + 3 * dim, dtype=dtype, device=device, seed=1)
        x = buf[:, dim : dim + width].view(*lead, dim)
    else:
        x = randn(*lead, dim, dtype=dtype, device=device, seed=1)
    w = randn(dim, dtype=dtype, device=device, seed=2, scale=0.5) + 1
    before = x.clone()
    with poisoned_empty():
        out = norm.rms_norm(x, w, 1e-6)
    assert_close(out, reference.rms_norm(x, w, 1e-6), "rms_norm")
    assert torch.equal(x, before), "rms_norm modified its input"


def check_fused_add_rms_norm(device, dtype: torch.dtype, tokens: int, dim: int) -> None:
    from agent_infer.kernels.triton import norm

    x = randn(tokens, dim, dtype=dtype, device=device, seed=3)
    r = randn(tokens, dim, dtype=dtype, device=device, seed=4)
    w = randn(dim, dtype=dtype, device=device, seed=5, scale=0.5) + 1
    ref_out, ref_res = reference.fused_add_rms_norm(x, r, w, 1e-6)
    with poisoned_empty():
        out, res = norm.fused_add_rms_norm(x, r, w, 1e-6)
    assert out is x and res is r, "fused_add_rms_norm must work in place and return its inputs"
    assert_close(res, ref_res, "fused_add_rms_norm residual")
    assert_close(out, ref_out, "fused_add_rms_norm output")


def check_silu_and_mul(device, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    from agent_infer.kernels.triton import activation

    x = randn(*shape, dtype=dtype, device=device, seed=6, scale=2.0)
    with poisoned_empty():
        out = activation.silu_and_mul(x)
    assert_close(out, reference.silu_and_mul(x), "silu_and_mul")


def check_norm_rope_store(
    device, dtype: torch.dtype, tokens: int, heads: int, kv_heads: int, head_dim: int, rot_dim: int,
    is_neox: bool, qk_norm: bool, block_size: int = 16, group: int | None = None,
    cache_dtype: torch.dtype | None = None, kv_scales: tuple[float, float] = (1.0, 1.0),
    k_cache_tol: float | None = None,
) -> None:
    """The fused per-head q/k RMSNorm + RoPE + K/V cache write against the three
    reference ops: q, k (strided views of a merged QKV buffer, rewritten in place) and
    both whole caches, with padding rows (slot -1) that must leave the caches alone.
    `group`: heads per program (default: the kernel's choice for the shape); `kv_scales`:
    an fp8 cache's scales, which the stores divide by; `k_cache_tol` overrides the K
    cache's relative tolerance (its dtype's)."""
    from agent_infer.kernels.triton.rope_store import norm_rope_store

    max_pos = 4 * tokens + 50
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = randn(tokens, q_size + 2 * kv_size, dtype=dtype, device=device, seed=21)
    q = qkv[:, :q_size].view(tokens, heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(tokens, kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(tokens, kv_heads, head_dim)
    if cache_dtype == FP8:  # V stored exactly (times its scale), so its cache compares bit for bit
        v.copy_(fp8_values(v) * kv_scales[1])
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)
    positions = torch.randint(0, max_pos, (tokens,), generator=_gen(22)).to(device)
    q_w = randn(head_dim, dtype=dtype, device=device, seed=23, scale=0.5) + 1 if qk_norm else None
    k_w = randn(head_dim, dtype=dtype, device=device, seed=24, scale=0.5) + 1 if qk_norm else None
    num_blocks = -(-2 * tokens // block_size) + 2
    slots = torch.randperm(num_blocks * block_size, generator=_gen(25))[:tokens]
    slots[torch.arange(tokens) % 3 == 2] = -1
    slots = slots.to(device)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = kv_cache_randn(*shape, dtype=dtype, cache_dtype=cache_dtype, device=device, seed=26)
    v_cache = kv_cache_randn(*shape, dtype=dtype, cache_dtype=cache_dtype, device=device, seed=27)
    ref_kc, ref_vc = k_cache.clone(), v_cache.clone()
    ref_q, ref_k = (reference.rms_norm(q, q_w, 1e-6), reference.rms_norm(k, k_w, 1e-6)) if qk_norm else (q, k)
    ref_q = reference.apply_rotary(positions, ref_q, cache, is_neox)
    ref_k = reference.apply_rotary(positions, ref_k, cache, is_neox)
    reference.store_kv(ref_k, v, ref_kc, ref_vc, slots, *kv_scales)
    v_before = v.clone()
    with poisoned_empty():
        out_q, out_k = norm_rope_store(positions, q, k, v, q_w, k_w, 1e-6, cache, is_neox, k_cache, v_cache, slots,
                                       heads=group, k_scale=kv_scales[0], v_scale=kv_scales[1])
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr(), "must work in place"
    assert_close(q, ref_q, "norm_rope_store q")
    assert_close(k, ref_k, "norm_rope_store k")
    assert torch.equal(v, v_before), "v must be left as it was"
    assert same(v_cache, ref_vc), "V cache differs from the reference (a copy or one cast, so exact)"
    if k_cache_tol is None:
        assert_close(k_cache.float(), ref_kc.float(), "norm_rope_store K cache", k_cache.dtype)
    else:
        err = rel_err(k_cache.float(), ref_kc.float())
        assert err <= k_cache_tol, f"norm_rope_store K cache: relative error {err:.3g} > {k_cache_tol:g}"
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=device)
    untouched[slots[slots >= 0]] = False
    flat, ref_flat = k_cache.view(-1, kv_heads, head_dim), ref_kc.view(-1, kv_heads, head_dim)
    assert same(flat[untouched], ref_flat[untouched]), "K cache written outside the step's slots"


def fp8_weight(w: torch.Tensor, fp8) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, int] | None, torch.Tensor]:
    """(weight, scale, block, the values it stands for in fp32) for a GEMV test: w as it
    is (fp8 None), or quantized per block (`fp8` a (rows, columns) pair) or per row
    (`fp8` "channel")."""
    from agent_infer.quantization import fp8 as F

    if fp8 is None:
        return w, None, None, w.float()
    block = None if fp8 == "channel" else tuple(fp8)
    q, scale = F.quantize_channel(w.float()) if block is None else F.quantize_block(w.float(), block)
    scale = scale.to(w.device)
    return q, scale, block, reference.fp8_linear(torch.eye(w.shape[1], device=w.device), q, scale, block).t()


def check_gemv_m1(device, dtype: torch.dtype, n: int, k: int, bias: bool, silu_mul: bool, config=None,
                  fp8=None) -> None:
    """The batch-1 GEMV (optionally with the SiLU-and-mul epilogue over [gate | up] rows)
    against F.linear (and the reference silu_and_mul on its rounded output); `fp8` (see
    fp8_weight): the weight in e4m3 with its scales, against its dequantized values."""
    from agent_infer.kernels.triton.gemv import linear_m1

    rows = 2 * n if silu_mul else n
    x = randn(1, k, dtype=dtype, device=device, seed=31)
    w, scale, block, w_ref = fp8_weight(randn(rows, k, dtype=dtype, device=device, seed=32, scale=k**-0.5), fp8)
    b = randn(rows, dtype=dtype, device=device, seed=33) if bias else None
    ref = torch.nn.functional.linear(x.float(), w_ref, None if b is None else b.float())
    if silu_mul:
        ref = reference.silu_and_mul(ref.to(dtype)).float()
    with poisoned_empty():
        out = linear_m1(x, w, b, silu_mul=silu_mul, config=config, scale=scale, block=block)
    assert out.dtype == dtype and out.shape == (1, n)
    assert_close(out.float(), ref, f"gemv M=1 N={n} K={k} silu_mul={silu_mul} {config} fp8={fp8}", dtype)


def check_gemv_rows(device, dtype: torch.dtype, m: int, n: int, k: int, bias: bool, config=None,
                    epilogue: str = "plain") -> None:
    """The few-row GEMV on the tensor cores (1-16 rows) against F.linear in fp32, x's rows
    strided (a view into a wider buffer, as a verify step's hidden rows may be).
    `epilogue` "silu": a [gate; up] weight of 2n rows ending in SiLU-and-mul (against the
    reference's silu_and_mul of the rounded projection)."""
    from agent_infer.kernels.triton.gemv_rows_mma import linear_rows_mma

    silu = epilogue == "silu"
    w = randn(2 * n if silu else n, k, dtype=dtype, device=device, seed=35, scale=k**-0.5)
    b = randn(w.shape[0], dtype=dtype, device=device, seed=36) if bias else None
    x = randn(m, k + 8, dtype=dtype, device=device, seed=34)[:, 3:k + 3]
    ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    if silu:
        ref = reference.silu_and_mul(ref.to(dtype)).float()
    with poisoned_empty():
        out = linear_rows_mma(x, w, b, silu_mul=silu, config=config)
    assert out.dtype == dtype and out.shape == (m, n)
    assert_close(out.float(), ref, f"gemv rows M={m} N={n} K={k} bias={bias} {epilogue} {config}", dtype)


def check_gemv_m1_rows_invariant(device, dtype: torch.dtype, m: int, n: int, k: int, bias: bool, epilogue: str,
                                 config=None, fp8=None) -> None:
    """The batch-1 GEMV launched for m rows at once (the batch-invariant mode's
    projections, x's rows strided) gives each row bitwise what a launch for that row alone
    gives: plain, with the SiLU-and-mul epilogue, or with the add + RMSNorm (one counter
    per row, all re-armed). The one-row launches are checked against F.linear by
    check_gemv_m1 and check_gemv_m1_add_norm."""
    from agent_infer.kernels.triton.gemv import linear_m1, linear_m1_add_rms_norm

    silu_mul = epilogue == "silu"
    rows = 2 * n if silu_mul else n
    x = randn(m, k + 8, dtype=dtype, device=device, seed=41)[:, 5:k + 5]
    w, scale, block, _ = fp8_weight(randn(rows, k, dtype=dtype, device=device, seed=42, scale=k**-0.5), fp8)
    b = randn(rows, dtype=dtype, device=device, seed=43) if bias else None
    label = f"gemv rows as M=1 M={m} N={n} K={k} {epilogue} {config} fp8={fp8}"
    if epilogue == "add_norm":
        norm_w = (1.0 + 0.1 * randn(n, dtype=torch.float32, device=device, seed=44)).to(dtype)
        residual = randn(m, n, dtype=dtype, device=device, seed=45)
        alone = [linear_m1_add_rms_norm(x[i:i + 1], w, b, residual[i:i + 1].clone(), norm_w, 1e-6,
                                        torch.zeros(1, dtype=torch.int32, device=device), config=config,
                                        scale=scale, block=block) for i in range(m)]
        counters = torch.zeros(m + 3, dtype=torch.int32, device=device)
        with poisoned_empty():
            out, res = linear_m1_add_rms_norm(x, w, b, residual, norm_w, 1e-6, counters, config=config, scale=scale,
                                              block=block)
        assert not counters.any(), f"{label}: counters left {counters.tolist()}"
        assert torch.equal(res, torch.cat([r for _, r in alone])), f"{label}: residual rows differ"
        assert torch.equal(out, torch.cat([o for o, _ in alone])), f"{label}: normed rows differ"
        return
    alone = torch.cat([linear_m1(x[i:i + 1], w, b, silu_mul=silu_mul, config=config, scale=scale, block=block)
                       for i in range(m)])
    with poisoned_empty():
        out = linear_m1(x, w, b, silu_mul=silu_mul, config=config, scale=scale, block=block)
    assert out.shape == (m, n) and torch.equal(out, alone), f"{label}: rows differ from their own launches"


def check_gemv_m1_every_e4m3_value(device, config=None) -> None:
    """The fp8 GEMV converts e4m3 bytes with integer operations (gemv_fp8.py): every one
    of the 254 finite values (both zeros, the subnormals, +-448), in every byte position
    of its word, must come out as the value torch's conversion gives, in fp32."""
    from agent_infer.kernels.triton.gemv import linear_m1

    finite = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)
    k = 512
    rows = []
    for shift in range(4):  # each value at each byte position of its word
        rows.append(finite.roll(shift).repeat(k // len(finite) + 1)[:k])
        rows.append(finite.flip(0).roll(shift).repeat(k // len(finite) + 1)[:k])
    w = torch.stack(rows).view(torch.float8_e4m3fn).to(device)
    scale = (0.5 + torch.rand(w.shape[0], 1, generator=torch.Generator().manual_seed(7))).to(device)
    x = randn(1, k, dtype=torch.float32, device=device, seed=71)
    ref = x.double() @ (w.double() * scale.double()).t()
    out = linear_m1(x, w, scale=scale, config=config)
    err = ((out.double() - ref).abs() / ref.abs().clamp(min=1e-3)).max().item()
    assert err < 1e-5, f"fp8 GEMV over every e4m3 value: relative error {err:.2e}"


def check_gemv_m1_add_norm(device, dtype: torch.dtype, n: int, k: int, bias: bool, config=None, calls: int = 3,
                           fp8=None) -> None:
    """The batch-1 GEMV with the residual add + RMSNorm done by its last program, against
    F.linear then the reference fused_add_rms_norm, several calls in a row on one counter
    (which must come back to zero each time: the next call, or graph replay, relies on it).
    `fp8` as in check_gemv_m1."""
    from agent_infer.kernels.triton.gemv import linear_m1_add_rms_norm

    w, scale, block, w_ref = fp8_weight(randn(n, k, dtype=dtype, device=device, seed=34, scale=k**-0.5), fp8)
    b = randn(n, dtype=dtype, device=device, seed=35) if bias else None
    norm_w = (1.0 + 0.1 * randn(n, dtype=torch.float32, device=device, seed=36)).to(dtype)
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    residual = randn(1, n, dtype=dtype, device=device, seed=37)
    ref_res = residual.clone()
    for i in range(calls):
        x = randn(1, k, dtype=dtype, device=device, seed=38 + i)
        y = torch.nn.functional.linear(x.float(), w_ref, None if b is None else b.float()).to(dtype)
        ref_out, ref_res = reference.fused_add_rms_norm(y, ref_res, norm_w, 1e-6)
        with poisoned_empty():
            out, res = linear_m1_add_rms_norm(x, w, b, residual, norm_w, 1e-6, counter, config=config, scale=scale,
                                              block=block)
        assert res.data_ptr() == residual.data_ptr(), "the residual must be updated in place"
        assert out.dtype == dtype and out.shape == (1, n)
        assert int(counter.item()) == 0, "the last program must re-arm the counter"
        label = f"gemv+add+norm N={n} K={k} call {i} {config}"
        # The projection's bf16 rounding may differ by one ulp from F.linear's; after that
        # both sides add and normalise identically, so the tolerance is the GEMV's.
        assert_close(residual.float(), ref_res.float(), label + " residual", dtype)
        assert_close(out.float(), ref_out.float(), label + " normed", dtype)
        residual = res


# ---- skinny GEMM -----------------------------------------------------------------------


def check_gemv(device, dtype: torch.dtype, m: int, n: int, k: int, bias: bool, config=None) -> None:
    from agent_infer.kernels.triton.gemv import linear

    x = randn(m, k, dtype=dtype, device=device, seed=13)
    w = randn(n, k, dtype=dtype, device=device, seed=14, scale=k**-0.5)
    b = randn(n, dtype=dtype, device=device, seed=15) if bias else None
    ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    with poisoned_empty():
        out = linear(x, w, b, config)
    assert out.dtype == dtype
    assert_close(out.float(), ref, f"gemv M={m} N={n} K={k} {config}", dtype)


def check_gemv_invariant(device, dtype: torch.dtype, n: int, k: int, bias: bool, row_counts: tuple[int, ...],
                         epilogue: str = "plain") -> None:
    """The batch-invariant mode's GEMM (gemv_rows_mma.linear_rows_mma, as ops.linear's
    `invariant_rows` runs it): for each row count, x's rows (strided) in one launch give
    bitwise what each row's own launch gives, across tiles of rows (17, 40, 72 rows), and
    the rows are F.linear's (then, by `epilogue`, SiLU-and-mul on a [gate; up] weight of
    2n rows, or the residual add and RMSNorm kernel after it, the residual updated in
    place) within the dtype's tolerance."""
    from agent_infer.kernels.triton.gemv_rows_mma import linear_rows_mma
    from agent_infer.kernels.triton.norm import fused_add_rms_norm

    silu_mul, add_norm = epilogue == "silu", epilogue == "add_norm"
    rows = 2 * n if silu_mul else n
    w = randn(rows, k, dtype=dtype, device=device, seed=51, scale=k**-0.5)
    b = randn(rows, dtype=dtype, device=device, seed=52) if bias else None
    norm_w = (1.0 + 0.1 * randn(n, dtype=torch.float32, device=device, seed=54)).to(dtype)

    def run(x, residual=None):
        y = linear_rows_mma(x, w, b, silu_mul=silu_mul)
        return fused_add_rms_norm(y, residual, norm_w, 1e-6)[0] if add_norm else y

    for m in row_counts:
        x = randn(m, k + 8, dtype=dtype, device=device, seed=53 + m)[:, 3:k + 3]
        residual = randn(m, n, dtype=dtype, device=device, seed=55 + m)
        label = f"invariant GEMM M={m} N={n} K={k} bias={bias} {epilogue}"
        ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
        if silu_mul:
            ref = reference.silu_and_mul(ref.to(dtype)).float()
        if add_norm:
            ref_out, ref_res = reference.fused_add_rms_norm(ref.to(dtype), residual.clone(), norm_w, 1e-6)
            alone_res = [residual[i:i + 1].clone() for i in range(m)]
        with poisoned_empty():
            out = run(x, residual)
        assert out.dtype == dtype and out.shape == (m, n), label
        alone = torch.cat([run(x[i:i + 1], alone_res[i] if add_norm else None) for i in range(m)])
        assert torch.equal(out, alone), f"{label}: rows differ from their own launches"
        if add_norm:
            assert torch.equal(residual, torch.cat(alone_res)), f"{label}: residual rows differ from their own launches"
            # y's rounding may differ by one ulp from F.linear's; the add and the norm then
            # round alike, so the tolerance is the GEMM's.
            assert_close(residual.float(), ref_res.float(), label + " residual", dtype)
            assert_close(out.float(), ref_out.float(), label + " normed", dtype)
        else:
            assert_close(out.float(), ref, label, dtype)


def check_gumbel_sample(device, dtype: torch.dtype, rows: int, vocab: int) -> None:
    """The one-pass sampler picks the same tokens as the PyTorch formula: same hash, same
    scores (up to rounding), greedy rows take the argmax."""
    from agent_infer.kernels.triton.sampling import gumbel_sample

    gen = torch.Generator().manual_seed(rows * 1000 + vocab)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype).to(device)
    temperature = torch.tensor([0.0 if i % 3 == 0 else 0.5 + i / rows for i in range(rows)], device=device)
    seeds = torch.randint(-(2**62), 2**62, (rows,), generator=gen).to(device)  # negative seeds too
    steps = torch.randint(0, 5000, (rows,), generator=gen).to(device)
    got = gumbel_sample(logits, temperature, seeds, steps)
    want = reference.gumbel_sample(logits, temperature, seeds, steps)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got.cpu(), want.cpu()), f"{got.tolist()} != {want.tolist()}"
    greedy = temperature == 0.0
    assert torch.equal(got[greedy].cpu(), logits.float().argmax(-1)[greedy].cpu())


def check_argmax(device, dtype: torch.dtype, rows: int, vocab: int) -> None:
    """The two-pass greedy argmax equals torch.argmax, including ties (first index wins:
    the maximum is planted twice, in different slices) and -inf entries (masked logits)."""
    from agent_infer.kernels.triton.tokens import argmax

    gen = torch.Generator().manual_seed(rows * 7 + vocab)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    for r in range(rows):
        if r % 2 == 0:  # a tie across slices: the earlier one must win
            a, b = sorted(torch.randperm(vocab, generator=gen)[:2].tolist())
            logits[r, a] = logits[r, b] = logits[r].max() + 1.0
        if r % 3 == 1:
            logits[r, : vocab // 2] = float("-inf")
    logits = logits.to(dtype).to(device)
    got = argmax(logits)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got.cpu(), logits.cpu().float().argmax(-1)), f"{got.tolist()}"


def check_fill_placeholders(device, n: int) -> None:
    """Rows with prev_index >= 0 take that previous sample, the others keep their id."""
    from agent_infer.kernels.triton.tokens import fill_placeholders

    gen = torch.Generator().manual_seed(n)
    ids = torch.randint(0, 1000, (n,), generator=gen)
    prev_tokens = torch.randint(1000, 2000, (max(1, n // 2),), generator=gen)
    prev_index = torch.randint(-1, prev_tokens.numel(), (n,), generator=gen)
    want = torch.where(prev_index >= 0, prev_tokens[prev_index.clamp(min=0)], ids)
    got = fill_placeholders(ids.to(device), prev_index.to(device), prev_tokens.to(device))
    assert torch.equal(got.cpu(), want)


def check_lookup_drafts(device, max_k: int, min_n: int, max_n: int, block: int) -> None:
    """Rows drafted behind a row in flight get `propose_ngram`'s drafts on their real
    history (the known tokens, the drafts the row in flight accepted, its sample after
    them) in their draft slots, and keep their other ids; rows that look up nothing stay
    as they were. Histories of a small alphabet (matches of every length, ties between
    ends; the alphabet shrinks as `min_n` grows, so that long matches happen too) and of
    no repeats, from empty to several blocks + 1, rows in flight of 0 to
    max_k drafts with a random number accepted; the kernel on `device` and the PyTorch
    reference against a loop over the rows."""
    import numpy as np

    from agent_infer.kernels.triton.ngram import lookup_drafts
    from agent_infer.speculative.ngram import propose_ngram

    gen = torch.Generator().manual_seed(max_k * 100 + min_n * 10 + max_n)
    alphabet = 5 if min_n <= 3 else 2

    def randint(lo, hi, n=None):
        return torch.randint(lo, hi, (1,) if n is None else (n,), generator=gen)

    lengths = [0, 1, min_n, min_n + 1, block - 1, block, block + 1, 2 * block + 3, 3 * block + 1]
    ids, hist, offsets, starts, slots, refs, ref_k, prev_in, prev_tok = [], [], [0], [], [], [], [], [], []
    want, hits = [], 0
    for r, known in enumerate(lengths):
        if r % 3 == 1:  # a row that looks up nothing between the lookup rows
            ids += randint(3000, 4000, 1 + int(randint(0, max_k + 1))).tolist()
        tokens = randint(0, 1000 if r == 5 else alphabet, known).tolist()  # row 5: no repeats
        k = int(randint(0, max_k + 1))
        accepted = int(randint(0, k + 1))
        drafts = randint(0, alphabet, k).tolist()
        sample = int(randint(0, alphabet))
        if accepted < k and sample == drafts[accepted]:
            sample = (sample + 1) % alphabet
        refs.append(len(prev_in) + k)
        ref_k.append(k)
        prev_in += [int(randint(0, alphabet))] + drafts
        prev_tok += drafts[:accepted] + [sample] + randint(0, alphabet, k - accepted).tolist()
        n = int(randint(1, max_k + 1))
        starts.append(len(ids))
        slots.append(n)
        row = randint(2000, 3000, 1 + n).tolist()
        ids += row
        hist += tokens
        offsets.append(len(hist))
        full = np.asarray(tokens + drafts[:accepted] + [sample], dtype=np.int64)
        found = propose_ngram(full, n, min_n, max_n)
        want.append((starts[-1], row[:1] + found + row[1 + len(found):]))
        hits += bool(found)
    assert 2 <= hits <= len(want) - 2, "the cases should mix rows that find drafts with rows that find none"

    def t(values):
        return torch.tensor(values, dtype=torch.int64)

    args = [t(hist), t(offsets), t(starts), t(slots), t(refs), t(ref_k), t(prev_tok), t(prev_in)]
    expected = t(ids)
    for at, row in want:
        expected[at : at + len(row)] = t(row)
    got_ref = t(ids)
    reference.lookup_drafts(got_ref, *args, min_n, max_n, max_k)
    assert torch.equal(got_ref, expected)
    got = t(ids).to(device)
    lookup_drafts(got, *(a.to(device) for a in args), min_n, max_n, max_k, block=block)
    assert torch.equal(got.cpu(), expected)


def check_resolve_rows(device, num_seqs: int, max_k: int) -> None:
    """Rows of sequences whose verify row (k drafts, a random number of them accepted) is
    still in flight move back by the drafts rejected: position, context length and the
    slot their block table gives, the first row's token the verify row's real last
    sample; plain placeholders (k = 0) and real ids stay. Against a loop over the rows,
    for the kernel on `device` and for the PyTorch reference."""
    from agent_infer.kernels import reference
    from agent_infer.kernels.triton.tokens import resolve_rows

    gen = torch.Generator().manual_seed(num_seqs * 17 + max_k)
    bs, width = 4, 12
    prev_in, prev_tok = [], []
    rows = []  # per current row: (follow, k, prev_index, position, context, table row)
    want = []  # per current row: (id, position, slot, context, shift)
    for s in range(num_seqs):
        k = int(torch.randint(0, max_k + 1, (1,), generator=gen))
        accepted = int(torch.randint(0, k + 1, (1,), generator=gen))
        r0 = len(prev_in)
        drafts = torch.randint(0, 50, (k,), generator=gen).tolist()
        samples = drafts[:accepted] + [int(torch.randint(50, 100, (1,), generator=gen))] * (k + 1 - accepted)
        prev_in += [int(torch.randint(0, 50, (1,), generator=gen))] + drafts
        prev_tok += samples
        r = r0 + k  # the row whose sample ends the run if every draft is accepted
        shift = accepted - k
        table = torch.randperm(200, generator=gen)[:width].tolist()
        base = int(torch.randint(k, 30, (1,), generator=gen))
        real = s % 3 == 2  # a sequence whose last token is known: no placeholder
        for j in range(1 + int(torch.randint(0, 3, (1,), generator=gen))):
            pos = base + j
            follow = -1 if real else r
            rows.append((follow, k if not real else 0, r if (j == 0 and not real) else -1, pos, pos + 1, table, 7000 + j))
            sh = 0 if real else shift
            p = pos + sh
            tok = prev_tok[r + sh] if (j == 0 and not real) else 7000 + j
            want.append((tok, p, table[p // bs] * bs + p % bs if not real else -5, p + 1, sh))
    n = len(rows)
    cols = list(zip(*rows))
    ids = torch.tensor(cols[6])
    follow, follow_k, prev_index = torch.tensor(cols[0]), torch.tensor(cols[1]), torch.tensor(cols[2])
    positions = torch.tensor(cols[3])
    context = torch.tensor(cols[4], dtype=torch.int32)
    tables = torch.tensor(cols[5], dtype=torch.int32)
    slots = torch.full((n,), -5)
    for impl, dev in ((reference.resolve_rows, "cpu"), (resolve_rows, device)):
        t = [x.clone().to(dev) for x in (ids, positions, slots, context, torch.zeros(n, dtype=torch.int64))]
        impl(t[0], t[1], t[2], t[3], t[4], prev_index.to(dev), follow.to(dev), follow_k.to(dev), tables.to(dev), bs,
             torch.tensor(prev_tok).to(dev), torch.tensor(prev_in).to(dev), max_k)
        got = list(zip(*(x.cpu().tolist() for x in t)))
        assert got == want, (impl, got, want)


def check_apply_token_bitmask(device, dtype: torch.dtype, rows: int, vocab: int, words: int) -> None:
    """The structured-output mask kernel bans exactly the tokens whose bit is 0, in the
    listed rows only, and every token beyond the mask's 32 * words; it matches the
    PyTorch reference bit for bit."""
    from agent_infer.kernels.triton.tokens import apply_token_bitmask

    gen = torch.Generator().manual_seed(rows * 31 + vocab)
    logits = torch.randn(rows + 2, vocab, generator=gen).to(dtype)
    mask = torch.randint(-(2**31), 2**31, (rows, words), generator=gen, dtype=torch.int64).to(torch.int32)
    mask[0] = -1  # all allowed (within the mask)
    mask[-1] = 0
    mask[-1, 0] = 1 << 5  # only token 5
    picked = torch.randperm(rows + 2, generator=gen)[:rows]
    want = logits.clone()
    reference.apply_token_bitmask(want, mask, picked)
    got = logits.to(device)
    apply_token_bitmask(got, mask.to(device), picked.to(device))
    assert torch.equal(got.cpu(), want)
    untouched = torch.ones(rows + 2, dtype=torch.bool)
    untouched[picked] = False
    assert torch.equal(got.cpu()[untouched], logits[untouched])
    last = picked[-1].item()
    assert torch.isfinite(want[last]).nonzero().flatten().tolist() == [5]
    if 32 * words < vocab:
        assert torch.isinf(want[picked][:, 32 * words:]).all()


def check_gumbel_never_samples_banned_tokens(device, vocab: int = 4096) -> None:
    """With every token but a few banned (-inf), sampled rows pick only allowed tokens,
    on both paths, over many seeds and steps (a banned token whose noise rounds to +inf
    scores NaN, which must never win)."""
    from agent_infer.kernels.triton.sampling import gumbel_sample

    rows = 64
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.full((rows, vocab), float("-inf"))
    allowed = torch.randint(0, vocab, (rows, 3), generator=gen)
    logits.scatter_(1, allowed, torch.randn(rows, 3, generator=gen))
    temperature = torch.ones(rows)
    seeds = torch.randint(-(2**62), 2**62, (rows,), generator=gen)
    for step in range(0, 4000, 400):
        steps = torch.full((rows,), step)
        for got in (reference.gumbel_sample(logits, temperature, seeds, steps),
                    gumbel_sample(logits.to(device), temperature.to(device), seeds.to(device), steps.to(device)).cpu()):
            assert (allowed == got[:, None]).any(dim=1).all()
