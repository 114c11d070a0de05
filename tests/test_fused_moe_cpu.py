"""The fused-MoE pieces that need no kernel: the reference against the formula written
per token, the CPU dispatch in ops, and the configuration table (its format is what the
tuning script prints, its lookup and heuristic give launchable configurations). The
kernels themselves: tests/test_triton_interpreter.py (moe section), tests/gpu/test_fused_moe.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from agent_infer.kernels import ops, reference
from agent_infer.kernels.triton import fused_moe_configs as cfgs
from tests.moe_checks import make_expert_map, make_routing, moe_weights


def _per_token(x, w13, w2, topk_weights, topk_ids, expert_map):
    """The layer as the model card writes it, one token and one slot at a time."""
    inter = w13.shape[1] // 2
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            if expert_map is not None:
                e = int(expert_map[e])
                if e < 0:
                    continue
            gate, up = w13[e, :inter] @ x[t], w13[e, inter:] @ x[t]
            out[t] += topk_weights[t, j] * (w2[e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("local", [None, (2, 3), (6, 1)])
def test_reference_matches_per_token_formula(local):
    experts, top_k, hidden, inter, tokens = 7, 3, 48, 40, 23
    e_local = experts if local is None else local[1]
    w13, w2 = moe_weights(e_local, inter, hidden, torch.float64, "cpu", seed=1)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    topw, ids = make_routing(tokens, experts, top_k, "cpu", seed=3, repeat=True)
    emap = make_expert_map(experts, *local, "cpu") if local else None
    got = reference.fused_moe(x, w13, w2, topw, ids, emap)
    want = _per_token(x, w13, w2, topw.double(), ids, emap)
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)
    assert want.abs().max() > 0.1  # not trivially zero


def test_ops_dispatch_on_cpu_uses_the_reference():
    w13, w2 = moe_weights(5, 40, 48, torch.float32, "cpu", seed=4)
    x = torch.randn(9, 48, generator=torch.Generator().manual_seed(5))
    topw, ids = make_routing(9, 5, 2, "cpu", seed=6, id_dtype=torch.int64)
    want = reference.fused_moe(x, w13, w2, topw, ids)
    assert torch.equal(ops.fused_moe(x, w13, w2, topw, ids), want)
    given = torch.full_like(x, float("nan"))
    assert ops.fused_moe(x, w13, w2, topw, ids, out=given) is given
    assert torch.equal(given, want)


def _valid(c: cfgs.MoeConfig) -> bool:
    def pow2(v: int) -> bool:
        return v > 0 and v & (v - 1) == 0

    tiles_ok = all(pow2(t.block_n) and pow2(t.block_k) and t.num_warps in (1, 2, 4, 8, 16) and t.num_stages >= 1
                   for t in (c.up, c.down))
    # tl.dot needs every tile dimension >= 16; block_m = 1 is the FMA rows path.
    dot_ok = c.block_m == 1 or (c.block_m >= 16 and min(c.up.block_n, c.up.block_k, c.down.block_n,
                                                        c.down.block_k) >= 16)
    return pow2(c.block_m) and tiles_ok and dot_ok


def test_config_table_is_printed_format_and_valid():
    """The TUNED block in fused_moe_configs.py is exactly what format_table prints (the
    tuning script's output pastes in as is), each family lists the buckets from the first
    on without a gap (the ones past it take the heuristic), DeepSeek-V2-Lite's families
    every bucket up to the largest steps they serve (the shared-experts-joined family
    stops at FUSED_SHARED_MAX_TOKENS), and every configuration is launchable."""
    from agent_infer.layers.moe import FUSED_SHARED_MAX_TOKENS

    source = Path(cfgs.__file__).read_text()
    strip = lambda text: "\n".join(re.sub(r"\s+#.*$", "", line) for line in text.splitlines())  # noqa: E731
    for name, tuned in (("TUNED", cfgs.TUNED), ("TUNED_FP8", cfgs.TUNED_FP8)):
        block = re.search(rf"^{name}: .*?^}}$", source, flags=re.S | re.M).group(0)
        assert strip(block) == strip(cfgs.format_table(tuned, name=name)), name
        namespace = {"MoeConfig": cfgs.MoeConfig, "Tile": cfgs.Tile}
        exec(cfgs.format_table(tuned, {k: "note" for k in tuned}, name), namespace)
        assert namespace[name] == tuned
        assert all(_valid(c) for table in tuned.values() for c in table.values()), name
    assert cfgs.TUNED  # TUNED_FP8 lists only the buckets its runs measured (the rest fall back)
    for family, table in cfgs.TUNED.items():
        assert tuple(sorted(table)) == cfgs.BUCKETS[:len(table)], family
    for family in ((64, 1408, 2048), (66, 1408, 2048)):  # measured whole
        assert max(cfgs.TUNED[family]) >= min(cfgs.BUCKETS[-1], cfgs.bucket(FUSED_SHARED_MAX_TOKENS)), family


def test_config_lookup_and_heuristic():
    assert [cfgs.bucket(t) for t in (1, 2, 3, 5, 16, 17, 1000, 1025, 4096, 8192)] == [
        1, 2, 4, 8, 16, 32, 1024, 4096, 4096, 4096]
    family = cfgs.TUNED[(64, 1408, 2048)]
    assert cfgs.get_config(64, 1408, 2048, 3, 6) is family[4]
    assert cfgs.get_config(64, 1408, 2048, 9000, 6) is family[4096]
    # unknown shape family: the heuristic, by expected slots per (global) expert
    seen = set()
    for t in range(1, 9000, 37):
        for k, e_local, e_global in ((6, 64, 64), (8, 32, 256), (2, 7, 7)):
            c = cfgs.get_config(e_local, 123, 456, t, k, e_global)
            assert _valid(c) and c == cfgs.default_config(t, k, e_global)
            seen.add(c.block_m)
    assert seen == {16, 32, 64, 128}
    small, large = cfgs.default_config(1, 8, 256), cfgs.default_config(8192, 8, 256)
    assert small.block_m < large.block_m


@pytest.mark.parametrize("inter,hidden", [(1408, 2048), (768, 2048), (2048, 7168), (704, 2048), (40, 48)])
def test_fp8_experts_take_word_rows_at_one_token(inter, hidden):
    """e4m3 experts: a measured TUNED_FP8 entry, else one slot a block (the int32-word
    rows) at one token and the bf16 table's tensor-core tiles beyond; a word tile is a
    whole multiple of K when one of at least 512 values divides it, else covers K in as
    few masked loads as 2,048 values allow."""
    for tokens in (1, 2, 5, 300):
        c = cfgs.get_config(64, inter, hidden, tokens, 6, fp8=True)
        measured = cfgs.TUNED_FP8.get((64, inter, hidden), {}).get(cfgs.bucket(tokens))
        if measured is not None:
            assert c is measured
        elif tokens == 1:
            assert c == cfgs.fp8_rows_config(inter, hidden) and c.block_m == 1
        else:
            assert c == cfgs.get_config(64, inter, hidden, tokens, 6)
        assert _valid(c)
    rows = cfgs.fp8_rows_config(inter, hidden)
    for tile, k in ((rows.up, hidden), (rows.down, inter)):
        whole = k % tile.block_k == 0
        assert tile.block_k <= 2048 and (whole and tile.block_k >= min(512, k) or
                                         not whole and -(-k // tile.block_k) == -(-k // 2048))


@pytest.mark.parametrize("inter,hidden", [(32, 42), (30, 48)])
def test_fp8_experts_whose_k_is_not_whole_words_take_tensor_core_tiles(inter, hidden):
    """One token over e4m3 experts whose K (hidden for GEMM 1, I for GEMM 2) is not a
    multiple of 4 cannot be read as int32 words: the bf16 table's tiles instead."""
    c = cfgs.get_config(6, inter, hidden, 1, 2, fp8=True)
    assert c.block_m > 1 and c == cfgs.get_config(6, inter, hidden, 1, 2)


def test_fit_blocks_keeps_tiles_inside_the_scale_blocks():
    """Block-scaled experts: FMA rows shrink to the block's rows, tensor-core K steps to
    its columns; per-row scales (None) leave a configuration as it is."""
    rows, dots = cfgs.fp8_rows_config(2048, 7168), cfgs.default_config(64, 8, 256)
    assert cfgs.fit_blocks(rows, None) is rows and cfgs.fit_blocks(rows, (128, 128)) == rows  # 4 and 8 rows fit
    fitted = cfgs.fit_blocks(cfgs.MoeConfig(1, cfgs.Tile(16, 512), cfgs.Tile(32, 256)), (8, 128))
    assert (fitted.up.block_n, fitted.up.block_k, fitted.down.block_n) == (8, 512, 8)
    fitted = cfgs.fit_blocks(cfgs.MoeConfig(16, cfgs.Tile(32, 256), cfgs.Tile(64, 64)), (128, 96))
    assert (fitted.up.block_n, fitted.up.block_k, fitted.down.block_k) == (32, 32, 32)
    assert cfgs.takes_blocks((128, 128)) and cfgs.takes_blocks(None) and not cfgs.takes_blocks((16, 8))
    assert all(_valid(cfgs.fit_blocks(c, (128, 128))) for c in (rows, dots))


def test_tuner_candidates_cover_every_bucket():
    """benchmarks/tune_fused_moe.py has launchable candidates for every family and bucket
    (its GPU run is too costly to find an empty or invalid candidate set)."""
    pytest.importorskip("triton")
    from benchmarks import tune_fused_moe as tune

    for fam in tune.FAMILIES.values():
        for t in cfgs.BUCKETS:
            block_ms = tune.block_m_candidates(t, fam)
            assert block_ms, (fam, t)
            for bm in block_ms:
                assert all(_valid(cfgs.MoeConfig(bm, tile, tile)) for tile in tune.CANDIDATES[bm]), (fam, bm)
    assert all(_valid(cfgs.MoeConfig(1, tile, tile)) for tile in tune.FP8_ROWS)


def test_tuner_writes_its_entries_into_the_table():
    """`tune_fused_moe.py --write` merges measured entries into a copy of
    fused_moe_configs.py: a bucket replaced in place, one inserted in order, a new family
    appended, each new line stamped; every other entry as it was, and the block still
    what format_table prints (the format test above)."""
    pytest.importorskip("triton")
    from benchmarks import tune_fused_moe as tune

    source = Path(cfgs.__file__).read_text()
    qwen, new = (128, 768, 2048), (12, 64, 128)
    one = cfgs.MoeConfig(1, cfgs.Tile(4, 512, 4, 2), cfgs.Tile(8, 256, 4, 2))
    two = cfgs.MoeConfig(16, cfgs.Tile(32, 128, 4, 4), cfgs.Tile(64, 64, 4, 4))
    out = tune.merge_into_source(source, "TUNED", qwen, "unused", {1: one, 2: two}, "GPU X, 2026-12-05")
    out = tune.merge_into_source(out, "TUNED", new, "a new family", {1: two}, "GPU X, 2026-12-05")
    block = re.search(r"^TUNED: .*?^}$", out, flags=re.S | re.M).group(0)
    namespace = {"MoeConfig": cfgs.MoeConfig, "Tile": cfgs.Tile}
    exec(block, namespace)
    expected = {family: dict(table) for family, table in cfgs.TUNED.items()}
    expected[qwen] |= {1: one, 2: two}
    expected[new] = {1: two}
    assert namespace["TUNED"] == expected
    assert list(namespace["TUNED"][qwen]) == [1, 2] and list(namespace["TUNED"])[-1] == new
    assert block.count("# GPU X, 2026-12-05") == 3 and f"    {new}: {{  # a new family" in block
    strip = lambda text: "\n".join(re.sub(r"\s+#.*$", "", line) for line in text.splitlines())  # noqa: E731
    assert strip(block) == strip(cfgs.format_table(expected, name="TUNED"))
    assert out.replace(block, "") == source.replace(re.search(r"^TUNED: .*?^}$", source, flags=re.S | re.M).group(0),
                                                    "")  # nothing else touched


@pytest.mark.parametrize("fp8", [None, "channel", (4, 8)], ids=str)
@pytest.mark.parametrize("tokens", [1, 9])
def test_shared_experts_joined_to_the_routed_ones(tokens, fp8):
    """Shared experts of S x I loaded into RoutedExperts as S experts of I: the fused form
    (routing columns at weight 1) and the prefill form (dense GEMMs) both give the
    routed sum plus the shared MLP computed whole from the checkpoint's tensors. `fp8`:
    the checkpoint's tensors in e4m3 with scales per row or per block of 4 x 8 (H = 20
    leaves partial blocks), loaded as the loader hands them over (`Fp8Weight`) into the
    experts' fp8 form; the sums are those of the dequantized tensors."""
    from agent_infer.distributed.state import SINGLE
    from agent_infer.layers.moe import RoutedExperts
    from agent_infer.quantization import fp8 as F8

    experts, top_k, hidden, inter, shared = 5, 2, 20, 8, 2
    g = torch.Generator().manual_seed(4)
    config = None if fp8 is None else F8.Fp8Config("channel", None) if fp8 == "channel" else F8.Fp8Config("block", fp8)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    def stored(name: str, w: torch.Tensor):
        """(what the loader passes, the values it stands for)."""
        if config is None:
            return w, w
        q, scale = F8.quantize(w, config)
        return F8.Fp8Weight(name, q, scale, config), F8.dequantize(q, scale, config).double()

    moe = RoutedExperts(experts, top_k, hidden, inter, SINGLE, "ep", num_shared=shared).double()
    if config is not None:
        moe.to_fp8(config)
    w13, w2 = moe_weights(experts, inter, hidden, torch.float64, "cpu", seed=5)
    for e in range(experts):
        (gate_e, w13[e, :inter]), (up_e, w13[e, inter:]), (down_e, w2[e]) = (
            stored(n, w) for n, w in (("gate", w13[e, :inter]), ("up", w13[e, inter:]), ("down", w2[e])))
        moe.weight_loader(moe.w13, gate_e, shard_id=0, expert_id=e)
        moe.weight_loader(moe.w13, up_e, shard_id=1, expert_id=e)
        moe.weight_loader(moe.w2, down_e, expert_id=e)
    (gate_s, gate), (up_s, up), (down_s, down) = (
        stored(n, w) for n, w in (("gate", rand(shared * inter, hidden)), ("up", rand(shared * inter, hidden)),
                                  ("down", rand(hidden, shared * inter))))
    moe.weight_loader(moe.w13, gate_s, shard_id=0)
    moe.weight_loader(moe.w13, up_s, shard_id=1)
    moe.weight_loader(moe.w2, down_s)

    x = rand(tokens, hidden)
    router = rand(experts, hidden).float()
    weights, ids = reference.moe_route(x.float(), router, None, "softmax", top_k, 1, 1, False, 1.5, shared)
    assert ids.shape == (tokens, top_k + shared) and ids[:, top_k:].tolist() == [[5, 6]] * tokens
    assert weights[:, top_k:].tolist() == [[1.0, 1.0]] * tokens
    want = reference.fused_moe(x, w13, w2, weights[:, :top_k], ids[:, :top_k]) + F.linear(
        F.silu(F.linear(x, gate)) * F.linear(x, up), down)
    tol = dict(rtol=1e-10, atol=1e-12) if config is None else dict(rtol=1e-5, atol=1e-5)  # fp8: products in fp32
    for got in (moe(x, weights, ids), moe.forward_shared_dense(x, weights, ids)):
        assert torch.allclose(got, want, **tol), (got - want).abs().max()
    assert want.abs().max() > 0.1
