"""DeepSeek's MoE router in one or two launches, where PyTorch takes five to nine.

The PyTorch path is five to nine small kernels per layer (the fp32 cast of x, the
logits GEMM, softmax or sigmoid, the group scores and mask, top-k, the scaling, the
shared experts' columns), a few µs each and all latency at batch 1; one kernel takes
about as long as one of them (docs/PERFORMANCE.md has the figures).

- One token (`moe_route_m1`): every program computes BLOCK_N fp32 logits (the GEMV form
  of `gemv.row_dot`, its weight tiles loaded before the PDL wait since the router's
  weights never depend on the previous kernel); the last program to finish, found with
  an atomic counter as in the GEMV's add + norm epilogue, reads all E logits back and
  routes.
- More tokens (`moe_route_rows`): one program per token routes; up to
  FUSED_LOGITS_MAX_TOKENS it computes its E logits too, beyond an fp32 GEMM does.

Routing (`_route`): scores, group selection, top-k by repeated argmax, renormalisation
and scaling. Same maths as `reference.moe_route` (the reference; routing methods there),
in fp32; the logits are summed in another order than cuBLAS's, so a near-tie between two
experts may resolve the other way, as between any two GEMM implementations."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from agent_infer.kernels.triton.gemv import row_block_k, row_dot
from agent_infer.kernels.triton.utils import launch_opts, pdl_begin

# Largest expert count the last program holds in registers (V3 has 256).
MAX_EXPERTS = 1024
# Up to this many tokens, each token's program computes its logits, reading all the
# router's weights (from L2 after the first tokens); beyond, an fp32 GEMM does and the
# programs only route. V2-Lite on an H200: 41 µs at 256 tokens the first way (128 MB of
# L2 reads), against ~6 µs for the GEMM.
FUSED_LOGITS_MAX_TOKENS = 32
_ROWS_TILE = 8192  # fp32 weight values a program loads per K step (64 per thread at 4 warps)


@triton.jit
def _max_first(v, idx, BIG: tl.constexpr):
    """(the maximum of v, the index of its first occurrence); lanes with -inf never win
    over finite ones."""
    m = tl.max(v, axis=0)
    return m, tl.min(tl.where(v == m, idx, BIG), axis=0)


@triton.jit
def _argmax_first(v, idx, BIG: tl.constexpr):
    """Index of the first maximum of v."""
    return _max_first(v, idx, BIG)[1]


@triton.jit
def _route(
    logits, e, live, bias_ptr, weights_ptr, ids_ptr, E, scaling,
    SIGMOID: tl.constexpr, NORM: tl.constexpr, GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr,
    TOPK_GROUPS: tl.constexpr, TOP_K: tl.constexpr, SHARED: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_TOPK: tl.constexpr,
):
    """One token's routing from its fp32 logits [BLOCK_E] (-inf where not `live`): scores,
    group selection, top-k by repeated argmax, renormalisation and scaling; the weights
    and ids stored at weights_ptr / ids_ptr, the shared experts' columns after them."""
    if SIGMOID:
        scores = tl.where(live, 1.0 / (1.0 + tl.exp(-logits)), 0.0)
        choice = tl.where(live, scores + tl.load(bias_ptr + e, mask=live, other=0.0), float("-inf"))
    else:
        p = tl.exp(logits - tl.max(logits, axis=0))
        scores = p / tl.sum(p, axis=0)
        choice = tl.where(live, scores, float("-inf"))
    if GROUPS > 1:
        group = e // GROUP_SIZE
        g_idx = tl.arange(0, BLOCK_G)
        g_score = tl.full([BLOCK_G], float("-inf"), tl.float32)
        for g in tl.static_range(GROUPS):
            v = tl.where(live & (group == g), choice, float("-inf"))
            best = tl.max(v, axis=0)
            if SIGMOID:  # the sum of the group's two best biased scores
                second = tl.max(tl.where(e == _argmax_first(v, e, BLOCK_E), float("-inf"), v), axis=0)
                best = best + second
            g_score = tl.where(g_idx == g, best, g_score)
        kept = g_idx < 0
        for _ in tl.static_range(TOPK_GROUPS):
            kept = kept | (g_idx == _argmax_first(tl.where(kept, float("-inf"), g_score), g_idx, BLOCK_G))
        allowed = live & (group < 0)
        for g in tl.static_range(GROUPS):
            allowed = allowed | ((group == g) & (tl.sum((kept & (g_idx == g)).to(tl.int32), axis=0) > 0))
        if SIGMOID:
            choice = tl.where(allowed, choice, float("-inf"))
        else:  # V2 zeroes the other groups' probabilities, then takes top-k over all
            scores = tl.where(allowed, scores, 0.0)
            choice = tl.where(live, scores, float("-inf"))
    j_idx = tl.arange(0, BLOCK_TOPK)
    out_w = tl.zeros([BLOCK_TOPK], tl.float32)
    out_i = tl.zeros([BLOCK_TOPK], tl.int32)
    for j in tl.static_range(TOP_K):
        # Each block-wide reduction is a round through shared memory on the last program's
        # serial path. Softmax chooses by the score itself, so the max is the pick's weight;
        # sigmoid chooses by score + bias, so its weight is gathered.
        best, pick = _max_first(choice, e, BLOCK_E)
        if SIGMOID:
            best = tl.sum(tl.where(e == pick, scores, 0.0), axis=0)
        out_w = tl.where(j_idx == j, best, out_w)
        out_i = tl.where(j_idx == j, pick, out_i)
        choice = tl.where(e == pick, float("-inf"), choice)
    if NORM:
        out_w = out_w / (tl.sum(out_w, axis=0) + 1e-20)
    # The shared experts' columns follow: experts E .. E + SHARED - 1 at weight 1.
    routed = j_idx < TOP_K
    tl.store(weights_ptr + j_idx, tl.where(routed, out_w * scaling, 1.0), mask=j_idx < TOP_K + SHARED)
    tl.store(ids_ptr + j_idx, tl.where(routed, out_i, E + j_idx - TOP_K), mask=j_idx < TOP_K + SHARED)


@triton.jit
def _route_m1_kernel(
    x_ptr, w_ptr, bias_ptr, logits_ptr, weights_ptr, ids_ptr, count_ptr,
    E, K, scaling,
    SIGMOID: tl.constexpr, NORM: tl.constexpr, GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr,
    TOPK_GROUPS: tl.constexpr, TOP_K: tl.constexpr, SHARED: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_TOPK: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < E
    y = row_dot(x_ptr, w_ptr, w_ptr, n, n_mask, K, K, 0, False, False, PDL, BLOCK_K, tl.float32, PREFETCH)
    tl.store(logits_ptr + n, y, mask=n_mask)
    # The last program routes. A scalar atomic runs in one thread, so its release covers
    # that thread's stores only: the barrier first makes every thread's logits part of it.
    tl.debug_barrier()
    done = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        tl.debug_barrier()  # ... and the acquire is that thread's: the others load after it
        e = tl.arange(0, BLOCK_E)
        live = e < E
        # .cg: other SMs wrote the logits; this SM's L1 is not coherent with them.
        logits = tl.load(logits_ptr + e, mask=live, other=float("-inf"), cache_modifier=".cg")
        _route(logits, e, live, bias_ptr, weights_ptr, ids_ptr, E, scaling, SIGMOID, NORM, GROUPS, GROUP_SIZE,
               TOPK_GROUPS, TOP_K, SHARED, BLOCK_E, BLOCK_G, BLOCK_TOPK)
        tl.store(count_ptr, 0)  # re-armed: the next launch starts after this kernel ends


@triton.jit
def _route_rows_kernel(
    x_ptr, w_ptr, bias_ptr, weights_ptr, ids_ptr,
    E, K, sxm, swm, sim, scaling,
    SIGMOID: tl.constexpr, NORM: tl.constexpr, GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr,
    TOPK_GROUPS: tl.constexpr, TOP_K: tl.constexpr, SHARED: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_TOPK: tl.constexpr, FROM_LOGITS: tl.constexpr, PDL: tl.constexpr,
):
    """Token `program_id` alone: its E logits (FROM_LOGITS: x holds them already, fp32;
    else computed here, the router's weights from L2 after the first tokens' programs),
    then its routing."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    live = e < E
    if FROM_LOGITS:
        pdl_begin(PDL)
        logits = tl.load(x_ptr + t * sxm + e, mask=live, other=float("-inf"))
    else:
        y = row_dot(x_ptr + t * sxm, w_ptr, w_ptr, e, live, K, K, 0, False, False, PDL, BLOCK_K, tl.float32, 1)
        logits = tl.where(live, y, float("-inf"))
    _route(logits, e, live, bias_ptr, weights_ptr + t * swm, ids_ptr + t * sim, E, scaling, SIGMOID, NORM, GROUPS,
           GROUP_SIZE, TOPK_GROUPS, TOP_K, SHARED, BLOCK_E, BLOCK_G, BLOCK_TOPK)


@dataclass(frozen=True)
class M1Launch:
    """How `moe_route_m1` launches for a hidden size: BLOCK_N logit rows of BLOCK_K
    columns a load per program, PREFETCH tiles loaded before the PDL wait."""

    block_n: int
    block_k: int
    prefetch: int
    num_warps: int


def m1_launch(hidden: int) -> M1Launch:
    """One warp a logit row when the whole row is loaded before the PDL wait (at most two
    tiles of 2,048 columns): the last program's routing then reduces with warp shuffles
    alone, where four warps take a round through shared memory and a barrier for each
    of its ~20 reductions in sequence (46 barriers for sm_90 at 128 experts, top 8).
    Longer rows (V3's 7,168) keep four warps and two rows a program: their loads after
    the wait are issued by four times as many threads."""
    block_k = row_block_k(hidden)
    tiles = hidden // block_k
    if tiles <= 2:
        return M1Launch(1, block_k, tiles, 1)
    return M1Launch(2, block_k, 2, 4)


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Tokens [T, D], fp32 router weights, a hidden size the GEMV tiles divide."""
    return (x.dim() == 2 and x.shape[0] >= 1 and x.stride(1) == 1 and weight.is_contiguous()
            and weight.dtype == torch.float32 and weight.shape[0] <= MAX_EXPERTS and x.shape[1] % 16 == 0)


def _check_routing(x, weight, bias, scoring, top_k, num_groups, topk_groups) -> None:
    num_experts, k = weight.shape
    assert supported(x, weight) and x.shape[1] == k, f"x {tuple(x.shape)}, router weight {tuple(weight.shape)}"
    assert num_experts % num_groups == 0 and 1 <= top_k <= num_experts and 1 <= topk_groups <= num_groups
    assert scoring in ("softmax", "sigmoid"), scoring
    if scoring == "sigmoid":  # the choice adds the bias (zeros for a router without one)
        assert bias is not None and bias.dtype == torch.float32 and bias.is_contiguous()


def _routing_constexprs(scoring, num_experts, top_k, num_groups, topk_groups, norm_topk_prob, num_shared) -> dict:
    return dict(SIGMOID=scoring == "sigmoid", NORM=bool(norm_topk_prob), GROUPS=num_groups,
                GROUP_SIZE=num_experts // num_groups, TOPK_GROUPS=topk_groups, TOP_K=top_k, SHARED=num_shared,
                BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_G=triton.next_power_of_2(num_groups),
                BLOCK_TOPK=triton.next_power_of_2(top_k + num_shared))


def rows_block_k(num_experts: int, hidden: int) -> int:
    """The per-token router's column step: a [BLOCK_E, BLOCK_K] fp32 weight tile of about
    _ROWS_TILE values, 16 to 256 columns, a power of two that divides the hidden size
    (the batch-1 column tile caps it at that)."""
    return min(max(16, min(256, _ROWS_TILE // triton.next_power_of_2(num_experts))), row_block_k(hidden))


def moe_route_rows(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scoring: str, top_k: int, num_groups: int,
    topk_groups: int, norm_topk_prob: bool, scaling: float, num_shared: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.moe_route for x [T, D] with one program per token: (weights [T, k +
    num_shared] fp32, ids [T, k + num_shared] int32), the shared experts' columns last.
    Past FUSED_LOGITS_MAX_TOKENS tokens the logits come from an fp32 GEMM first."""
    _check_routing(x, weight, bias, scoring, top_k, num_groups, topk_groups)
    tokens, (num_experts, k) = x.shape[0], weight.shape
    from_logits = tokens > FUSED_LOGITS_MAX_TOKENS
    src = F.linear(x.float(), weight) if from_logits else x
    weights = torch.empty(tokens, top_k + num_shared, dtype=torch.float32, device=x.device)
    ids = torch.empty(tokens, top_k + num_shared, dtype=torch.int32, device=x.device)
    _route_rows_kernel[(tokens,)](
        src, weight, bias if bias is not None else weight, weights, ids,
        num_experts, k, src.stride(0), weights.stride(0), ids.stride(0), float(scaling),
        **_routing_constexprs(scoring, num_experts, top_k, num_groups, topk_groups, norm_topk_prob, num_shared),
        BLOCK_K=rows_block_k(num_experts, k), FROM_LOGITS=from_logits, num_warps=4, num_stages=2,
        **launch_opts(x.device),
    )
    return weights, ids


def moe_route_m1(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scoring: str, top_k: int, num_groups: int,
    topk_groups: int, norm_topk_prob: bool, scaling: float, counter: torch.Tensor, num_shared: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.moe_route for x [1, D] in one launch: (weights [1, k + num_shared] fp32,
    ids [1, k + num_shared] int32), the shared experts' columns last. `counter`: an int32
    [1] tensor, zero on entry and left zero (one per call site that can be in flight at
    once; its address may be captured in a CUDA graph)."""
    _check_routing(x, weight, bias, scoring, top_k, num_groups, topk_groups)
    assert x.shape[0] == 1 and x.is_contiguous()
    assert counter.dtype == torch.int32 and counter.numel() == 1 and counter.device == x.device
    num_experts, k = weight.shape
    launch = m1_launch(k)
    logits = torch.empty(num_experts, dtype=torch.float32, device=x.device)
    weights = torch.empty(1, top_k + num_shared, dtype=torch.float32, device=x.device)
    ids = torch.empty(1, top_k + num_shared, dtype=torch.int32, device=x.device)
    _route_m1_kernel[(triton.cdiv(num_experts, launch.block_n),)](
        x, weight, bias if bias is not None else weight, logits, weights, ids, counter,
        num_experts, k, float(scaling),
        **_routing_constexprs(scoring, num_experts, top_k, num_groups, topk_groups, norm_topk_prob, num_shared),
        BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, PREFETCH=launch.prefetch, num_warps=launch.num_warps,
        num_stages=2, **launch_opts(x.device),
    )
    return weights, ids
