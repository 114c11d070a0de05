"""Checks of the fused-MoE kernels (`agent_infer/kernels/triton/fused_moe.py`) against
`reference.fused_moe`, shared by tests/test_triton_interpreter.py (CPU tensors through
Triton's interpreter, small odd shapes) and tests/gpu/test_fused_moe.py (CUDA, DeepSeek
sizes).

Inputs are random: x and the weights Gaussian, routing uniform (k distinct experts per
token, optionally one token naming an expert twice), routed weights positive. Kernel
calls run under `poisoned_empty` (NaN / int-max filled scratch), so a padding row,
a non-local slot or a sorted position a kernel forgets shows up. The MoE output is
compared with the reference run in fp32 on the same (upcast) inputs, to the tolerance of
the kernel's dtype.
"""

from __future__ import annotations

import torch

from agent_infer.kernels import reference
from tests.kernel_checks import assert_close, poisoned_empty, same


def dev_randn(*shape: int, dtype: torch.dtype, device, seed: int, scale: float = 1.0) -> torch.Tensor:
    """Gaussian values drawn on `device` itself (GPU-sized weights would take seconds on
    the CPU generator)."""
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)


def moe_weights(num_experts: int, inter: int, hidden: int, dtype: torch.dtype, device, seed: int = 0):
    """(w13 [E, 2I, D] = gate rows then up rows, w2 [E, D, I]), scaled so activations stay O(1)."""
    w13 = dev_randn(num_experts, 2 * inter, hidden, dtype=dtype, device=device, seed=seed, scale=hidden**-0.5)
    w2 = dev_randn(num_experts, hidden, inter, dtype=dtype, device=device, seed=seed + 1, scale=inter**-0.5)
    return w13, w2


def make_routing(
    tokens: int, num_experts: int, top_k: int, device, seed: int, repeat: bool = False,
    id_dtype: torch.dtype = torch.int32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights [T, k] fp32, topk_ids [T, k]): k distinct experts per token, uniform;
    with `repeat`, token 1 (or 0) names its first expert twice."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens, num_experts, generator=g).argsort(dim=1)[:, :top_k]
    if repeat and top_k > 1:
        ids[min(1, tokens - 1), 1] = ids[min(1, tokens - 1), 0]
    w = torch.rand(tokens, top_k, generator=g) + 0.05
    return (w / w.sum(dim=1, keepdim=True)).to(device), ids.to(id_dtype).to(device)


def make_expert_map(num_experts: int, first: int, num_local: int, device) -> torch.Tensor:
    """expert_map [E_global] int32 of a rank holding experts [first, first + num_local)."""
    m = torch.full((num_experts,), -1, dtype=torch.int32)
    m[first : first + num_local] = torch.arange(num_local, dtype=torch.int32)
    return m.to(device)


def expected_alignment(
    topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_local: int, block_m: int, num_positions: int
) -> tuple[list[int], list[int], int]:
    """What moe_align must return, built on the host: each local expert's slots in order,
    padded with the sentinel to a multiple of block_m, then the sentinel up to P; the
    block experts (-1 past the padded total); the padded total."""
    ids = topk_ids.long().cpu().flatten()
    local = ids if expert_map is None else expert_map.long().cpu()[ids]
    sentinel = ids.numel()
    slots: list[int] = []
    blocks: list[int] = []
    for e in range(num_local):
        mine = torch.nonzero(local == e).flatten().tolist()
        padded = -(-len(mine) // block_m) * block_m
        slots += mine + [sentinel] * (padded - len(mine))
        blocks += [e] * (padded // block_m)
    total = len(slots)
    assert total <= num_positions, f"the padded groups ({total}) overflow P = {num_positions}"
    return slots + [sentinel] * (num_positions - total), blocks + [-1] * (num_positions // block_m - len(blocks)), total


def check_moe_align(
    device, tokens: int, num_local: int, top_k: int, block_m: int, *, num_experts: int | None = None,
    first: int = 0, one_program: bool | None = None, seed: int = 0, id_dtype: torch.dtype = torch.int32,
) -> None:
    """moe_align's three outputs equal the host-built grouping exactly (order included),
    with an expert map when `num_experts` (global) is given; P is the documented bound."""
    from agent_infer.kernels.triton.fused_moe import moe_align, num_positions

    _, ids = make_routing(tokens, num_experts or num_local, top_k, device, seed, repeat=True, id_dtype=id_dtype)
    emap = make_expert_map(num_experts, first, num_local, device) if num_experts else None
    with poisoned_empty():
        slots, blocks, npad = moe_align(ids, num_local, block_m, emap, one_program=one_program)
    p = num_positions(tokens * top_k, num_local, block_m)
    want_slots, want_blocks, total = expected_alignment(ids, emap, num_local, block_m, p)
    what = (f"moe_align T={tokens} E={num_local}/{num_experts or num_local} k={top_k} block_m={block_m} "
            f"one={one_program}")
    assert slots.dtype == blocks.dtype == npad.dtype == torch.int32, what
    assert slots.shape == (p,) and blocks.shape == (p // block_m,) and npad.shape == (1,), what
    assert int(npad.item()) == total, f"{what}: num_padded {int(npad.item())} != {total}"
    assert torch.equal(slots.cpu(), torch.tensor(want_slots, dtype=torch.int32)), f"{what}: sorted slots differ"
    assert torch.equal(blocks.cpu(), torch.tensor(want_blocks, dtype=torch.int32)), f"{what}: block experts differ"


def check_fused_moe(
    device, dtype: torch.dtype, tokens: int, num_experts: int, top_k: int, hidden: int, inter: int, *,
    local: tuple[int, int] | None = None, config=None, repeat: bool = False, seed: int = 0,
    weights: tuple[torch.Tensor, torch.Tensor] | None = None, id_dtype: torch.dtype = torch.int32,
    one_program: bool | None = None, direct: bool | None = None, fp8: bool | tuple[int, int] = False,
) -> None:
    """fused_moe against the fp32 reference. `local` = (first, count): this rank holds
    experts [first, first + count) of `num_experts` (an expert map); tokens with no local
    expert must come out exactly 0. A second call into a given `out` must return it and
    match the first bit for bit. `one_program` forces moe_align's path, `direct` the slot
    layout (default: direct for one token). `fp8`: the experts in e4m3 with one scale per
    row (True) or per block of (rows, columns) of each expert's matrices, against the
    reference on the same e4m3 values and scales."""
    from unittest import mock

    from agent_infer.kernels.triton import fused_moe as moe
    from agent_infer.quantization import fp8 as F8

    e_local = num_experts if local is None else local[1]
    w13, w2 = weights or moe_weights(e_local, inter, hidden, dtype, device, seed)
    scales = {}
    if fp8 is True:
        (w13, s13), (w2, s2) = (F8.quantize_channel(w.float().reshape(-1, w.shape[-1])) for w in (w13, w2))
        w13, w2 = w13.view(e_local, 2 * inter, hidden), w2.view(e_local, hidden, inter)
        scales = {"w13_scale": s13.view(e_local, 2 * inter), "w2_scale": s2.view(e_local, hidden)}
    elif fp8:
        (w13, s13), (w2, s2) = (F8.quantize_experts(w, fp8) for w in (w13, w2))
        scales = {"w13_scale": s13, "w2_scale": s2, "block": fp8}
    x = dev_randn(tokens, hidden, dtype=dtype, device=device, seed=seed + 2)
    topw, ids = make_routing(tokens, num_experts, top_k, device, seed + 3, repeat=repeat, id_dtype=id_dtype)
    emap = make_expert_map(num_experts, local[0], local[1], device) if local else None
    ref = reference.fused_moe(x.float(), w13 if fp8 else w13.float(), w2 if fp8 else w2.float(), topw, ids, emap,
                              **scales)
    what = (f"fused_moe {dtype} T={tokens} E={e_local}/{num_experts} k={top_k} D={hidden} I={inter} fp8={fp8} "
            f"{config or 'default config'}")
    slots = {True: 1 << 30, False: 0, None: moe.ONE_PROGRAM_SLOTS}[one_program]
    with mock.patch.object(moe, "ONE_PROGRAM_SLOTS", slots), poisoned_empty():
        out = moe.fused_moe(x, w13, w2, topw, ids, emap, config=config, direct=direct, **scales)
        given = torch.empty_like(out)
        again = moe.fused_moe(x, w13, w2, topw, ids, emap, config=config, out=given, direct=direct, **scales)
    assert out.dtype == dtype and out.shape == (tokens, hidden), what
    assert_close(out.float(), ref, what, dtype)
    if emap is not None:
        none_local = (emap[ids.long()] < 0).all(dim=1)
        assert not out[none_local].any(), f"{what}: tokens without a local expert must be 0"
    assert again is given, f"{what}: out= must be written and returned"
    assert same(again, out), f"{what}: a second run differs (not deterministic)"


def check_fused_moe_graph(
    device, dtype: torch.dtype, tokens: int, num_experts: int, top_k: int, hidden: int, inter: int, *,
    local: tuple[int, int] | None = None, replays: int = 3, config=None,
) -> None:
    """fused_moe captured once in a CUDA graph (static input, routing and output
    tensors), replayed with new x and new routing each time: every replay matches the
    reference of its own inputs."""
    from agent_infer.kernels.triton.fused_moe import fused_moe

    e_local = num_experts if local is None else local[1]
    w13, w2 = moe_weights(e_local, inter, hidden, dtype, device, seed=40)
    emap = make_expert_map(num_experts, local[0], local[1], device) if local else None
    x = dev_randn(tokens, hidden, dtype=dtype, device=device, seed=41)
    topw, ids = make_routing(tokens, num_experts, top_k, device, seed=42)
    out = torch.empty(tokens, hidden, dtype=dtype, device=device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_moe(x, w13, w2, topw, ids, emap, config=config, out=out)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe(x, w13, w2, topw, ids, emap, config=config, out=out)
    for r in range(replays):
        x.copy_(dev_randn(tokens, hidden, dtype=dtype, device=device, seed=100 + r))
        new_w, new_ids = make_routing(tokens, num_experts, top_k, device, seed=200 + r)
        topw.copy_(new_w)
        ids.copy_(new_ids)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference.fused_moe(x.float(), w13.float(), w2.float(), topw, ids, emap)
        assert_close(out.float(), ref, f"fused_moe graph replay {r} T={tokens} E={e_local}/{num_experts}", dtype)


# ---- the batch-1 router (agent_infer/kernels/triton/router.py) ------------------------

ROUTER_CASES = [  # scoring, experts, groups, topk_groups, top_k, hidden, norm, scaling
    ("softmax", 64, 1, 1, 6, 96, False, 1.0),  # V2-Lite's routing
    ("softmax", 13, 1, 1, 3, 48, False, 2.5),  # experts not a power of two
    ("softmax", 20, 4, 2, 3, 64, False, 16.0),  # V2's: groups of 5
    ("sigmoid", 32, 8, 4, 8, 112, True, 2.5),  # V3's: groups of 4, renormalised
    ("softmax", 128, 1, 1, 8, 64, True, 1.0),  # Qwen3-30B-A3B's: softmax top-8 of 128, renormalised
    ("sigmoid", 24, 4, 2, 3, 32, False, 1.0),
]


def check_moe_route(device, scoring, experts, groups, topk_groups, top_k, hidden, norm, scaling, seed=0,
                    shared=0) -> None:
    """The one-launch router against reference.moe_route for one token: the same experts
    with the same weights (top-k order is not part of the contract), the counter left at
    zero, twice in a row (the second launch relies on the first having re-armed it).
    `shared`: the shared experts' columns (ids E.., weight 1) follow the top-k."""
    from agent_infer.kernels.triton.router import moe_route_m1

    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(experts, hidden, generator=g) * hidden**-0.5).to(device)
    bias = (torch.randn(experts, generator=g) * 0.3).to(device) if scoring == "sigmoid" else None
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    for trial in range(2):
        x = torch.randn(1, hidden, generator=g).to(torch.bfloat16).to(device)
        want_w, want_i = reference.moe_route(x, weight, bias, scoring, top_k, groups, topk_groups, norm, scaling,
                                             shared)
        with poisoned_empty():
            got_w, got_i = moe_route_m1(x, weight, bias, scoring, top_k, groups, topk_groups, norm, scaling, counter,
                                        shared)
        width = top_k + shared
        assert got_i.shape == (1, width) and got_w.shape == (1, width) and got_w.dtype == torch.float32
        assert got_i[0, top_k:].tolist() == list(range(experts, experts + shared))
        assert got_w[0, top_k:].tolist() == [1.0] * shared
        order_got, order_want = got_i[0].long().argsort(), want_i[0].long().argsort()
        assert got_i[0].long()[order_got].tolist() == want_i[0].long()[order_want].tolist(), (
            f"trial {trial}: experts {sorted(got_i[0].tolist())} != {sorted(want_i[0].tolist())}")
        assert torch.allclose(got_w[0][order_got].cpu(), want_w[0][order_want].cpu(), rtol=1e-5, atol=1e-7)
        assert int(counter.item()) == 0


def check_moe_route_rows(device, scoring, experts, groups, topk_groups, top_k, hidden, norm, scaling, tokens,
                         seed=0, shared=0) -> None:
    """The one-program-per-token router against reference.moe_route for `tokens` tokens
    (x a strided view, rows wider than D): per token the same experts with the same
    weights, the shared experts' columns last."""
    from agent_infer.kernels.triton.router import moe_route_rows

    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(experts, hidden, generator=g) * hidden**-0.5).to(device)
    bias = (torch.randn(experts, generator=g) * 0.3).to(device) if scoring == "sigmoid" else None
    x = torch.randn(tokens, hidden + 16, generator=g).to(torch.bfloat16).to(device)[:, :hidden]
    want_w, want_i = reference.moe_route(x, weight, bias, scoring, top_k, groups, topk_groups, norm, scaling, shared)
    with poisoned_empty():
        got_w, got_i = moe_route_rows(x, weight, bias, scoring, top_k, groups, topk_groups, norm, scaling, shared)
    width = top_k + shared
    assert got_i.shape == (tokens, width) and got_w.shape == (tokens, width) and got_w.dtype == torch.float32
    assert got_i[:, top_k:].tolist() == [list(range(experts, experts + shared))] * tokens
    for t in range(tokens):
        order_got, order_want = got_i[t].long().argsort(), want_i[t].long().argsort()
        assert got_i[t].long()[order_got].tolist() == want_i[t].long()[order_want].tolist(), (
            f"token {t}: experts {sorted(got_i[t].tolist())} != {sorted(want_i[t].tolist())}")
        assert torch.allclose(got_w[t][order_got].cpu(), want_w[t][order_want].cpu(), rtol=1e-5, atol=1e-7)
