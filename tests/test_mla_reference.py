"""The plain-PyTorch MLA references (agent_infer/kernels/reference.py, reached through
agent_infer/kernels/ops.py on CPU) against transformers' DeepSeek code and against
attention over materialised keys and values, so the Triton kernels (checked against
these references) compute what the checkpoints expect:

- the cos/sin table of layers/rotary.py is transformers' DeepseekV2 `freqs_cis`
  (real parts = the first R/2 columns, imaginary = the last R/2), YaRN included;
- the rope is DeepSeek's interleaved one: equal to DeepseekV2's `apply_rotary_emb`
  (pairs (2i, 2i + 1) stay in place), and to DeepseekV3's
  `apply_rotary_pos_emb_interleave` up to the de-interleaving permutation that V3 writes
  its output in, which q and k share, so every score is the same;
- kv_a_layernorm is DeepseekV2RMSNorm;
- absorbed decode over the latent cache (q_nope @ W_UK, then W_UV on the output) equals
  attention over K/V up-projected by kv_b_proj, and equals the prefill reference's last
  row on the same keys.
"""

from __future__ import annotations

import pytest
import torch

from agent_infer.kernels import ops
from tests.kernel_checks import randn
from tests.mla_checks import LatentBatch, rope_table

ROPE = 64


def _v2_config():
    from transformers import DeepseekV2Config

    # DeepSeek-V2-Lite's rope section.
    return DeepseekV2Config(
        hidden_size=256, num_attention_heads=4, qk_rope_head_dim=ROPE, kv_lora_rank=48, qk_nope_head_dim=32,
        v_head_dim=32, max_position_embeddings=163840, rope_theta=10000,
        rope_scaling={"type": "yarn", "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                      "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1},
    )


def _hf_freqs_cis(positions: torch.Tensor) -> torch.Tensor:
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2RotaryEmbedding

    return DeepseekV2RotaryEmbedding(_v2_config())(torch.zeros(1), positions[None])[0]  # [T, R/2] complex64


def _our_table(max_pos: int) -> torch.Tensor:
    from agent_infer.config import RopeConfig
    from agent_infer.layers.rotary import build_cos_sin_cache

    return build_cos_sin_cache(RopeConfig.from_hf(_v2_config().to_dict()), ROPE, max_pos, torch.device("cpu"))


def test_cos_sin_table_is_deepseek_v2_freqs_cis():
    positions = torch.tensor([0, 1, 7, 4095, 4096, 30000])
    table = _our_table(30001)[positions]
    freqs = _hf_freqs_cis(positions)
    torch.testing.assert_close(table[:, : ROPE // 2], freqs.real, atol=2e-7, rtol=0)
    torch.testing.assert_close(table[:, ROPE // 2 :], freqs.imag, atol=2e-7, rtol=0)


def _rope_store(x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, q_heads: int = 3):
    """ops.mla_rope_store on kv_a = [random latent | x] and q_pe = x repeated per head:
    the rotated k_pe [T, R] and q_pe [T, H, R]."""
    tokens, rank = x.shape[0], 8
    kv_a = torch.cat((randn(tokens, rank, dtype=x.dtype, device="cpu", seed=1), x), dim=-1)
    q_pe = x[:, None, :].repeat(1, q_heads, 1)
    cache = torch.zeros(4, 16, rank + ROPE, dtype=x.dtype)
    slots = torch.arange(tokens)
    _, k_pe = ops.mla_rope_store(kv_a, q_pe, positions, torch.ones(rank, dtype=x.dtype), 1e-6, table, cache, slots)
    return k_pe, q_pe


def test_rope_matches_deepseek_v2():
    """Same values, same places, as DeepseekV2's complex-number rope; in bf16 the same
    single rounding of an fp32 rotation."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb

    positions = torch.tensor([0, 3, 100, 4097, 20000])
    table = _our_table(20001)
    freqs = _hf_freqs_cis(positions)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 0.0)):
        x = randn(len(positions), ROPE, dtype=dtype, device="cpu", seed=2)
        k_pe, q_pe = _rope_store(x, positions, table)
        hf_q, hf_k = apply_rotary_emb(x[None, None], x[None, None], freqs[None])  # [1, 1, T, R]
        torch.testing.assert_close(k_pe, hf_k[0, 0], atol=tol, rtol=tol)
        for h in range(q_pe.shape[1]):
            torch.testing.assert_close(q_pe[:, h], hf_q[0, 0], atol=tol, rtol=tol)


def test_rope_matches_deepseek_v3_up_to_its_output_permutation():
    """DeepseekV3 (rope_interleave) reads the same interleaved pairs but writes the
    rotated values de-interleaved ([even results | odd results]); q and k share that
    permutation, so their dot products (the attention scores) are the same as ours."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    positions = torch.tensor([1, 5, 64, 999])
    table = rope_table(ROPE, 1000, "cpu")
    q = randn(len(positions), ROPE, dtype=torch.float32, device="cpu", seed=3)
    k = randn(len(positions), ROPE, dtype=torch.float32, device="cpu", seed=4)
    k_ours, _ = _rope_store(k, positions, table)
    _, q_ours = _rope_store(q, positions, table)
    q_ours = q_ours[:, 0]
    cos, sin = table[positions].chunk(2, dim=-1)
    cos, sin = torch.cat((cos, cos), dim=-1)[None], torch.cat((sin, sin), dim=-1)[None]  # V3's cat(freqs, freqs)
    hf_q, hf_k = apply_rotary_pos_emb_interleave(q[None, None], k[None, None], cos, sin)
    deinterleave = torch.cat((torch.arange(0, ROPE, 2), torch.arange(1, ROPE, 2)))
    torch.testing.assert_close(q_ours[:, deinterleave], hf_q[0, 0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_ours[:, deinterleave], hf_k[0, 0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(q_ours @ k_ours.T, hf_q[0, 0] @ hf_k[0, 0].T, atol=1e-4, rtol=1e-5)
    assert not torch.allclose(q_ours, hf_q[0, 0]), "V3's layout differs from V2's (else this test shows nothing)"


def test_latent_norm_is_deepseek_v2_rmsnorm():
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2RMSNorm

    rank, tokens = 48, 5
    norm = DeepseekV2RMSNorm(rank, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(rank))
    for dtype in (torch.float32, torch.bfloat16):
        x = randn(tokens, rank + ROPE, dtype=dtype, device="cpu", seed=5)
        want = norm.to(dtype)(x[:, :rank].clone())
        latent, _ = ops.mla_rope_store(x, torch.zeros(tokens, 1, ROPE, dtype=dtype), torch.zeros(tokens, dtype=torch.long),
                                       norm.weight.detach(), 1e-6, rope_table(ROPE, 4, "cpu"),
                                       torch.zeros(2, 16, rank + ROPE, dtype=dtype), torch.full((tokens,), -1))
        assert torch.equal(latent, want)


@pytest.mark.parametrize("cache_dtype,cache_scale", [(None, 1.0), (torch.float8_e4m3fn, 0.25)], ids=["fp64", "fp8"])
def test_absorbed_decode_equals_materialised_attention(cache_dtype, cache_scale):
    """One decode step both ways: absorbed (ops.mla_decode over the latent cache, W_UK
    into the query, W_UV on the output) and materialised (kv_b_proj's K/V of every cached
    row, then ordinary attention via ops.mla_prefill_attention's last row, the new token
    being its sequence's last key). An fp8 cache: its entries times the scale are the
    rows the materialised side reads."""
    heads, rank, nope, vdim, block_size = 3, 48, 16, 12, 16
    contexts = [37, 1, 90]
    batch = LatentBatch("cpu", torch.float64, contexts, heads, rank, ROPE, block_size, padding_rows=1,
                        cache_dtype=cache_dtype, cache_scale=cache_scale)
    w_kb = randn(heads, nope, rank, dtype=torch.float64, device="cpu", seed=6) * rank**-0.5  # kv_b_proj's K rows
    w_vb = randn(heads, vdim, rank, dtype=torch.float64, device="cpu", seed=7) * rank**-0.5  # and its V rows
    q_nope = randn(len(contexts), heads, nope, dtype=torch.float64, device="cpu", seed=8)
    q_pe = batch.q[: len(contexts), :, rank:]
    q = torch.zeros(len(contexts) + 1, heads, rank + ROPE, dtype=torch.float64)
    q[: len(contexts), :, :rank] = torch.einsum("bhn,hnl->bhl", q_nope, w_kb)
    q[: len(contexts), :, rank:] = q_pe
    out = torch.full((len(contexts) + 1, heads, rank), float("nan"), dtype=torch.float64)
    res = ops.mla_decode(q, batch.kv_cache, batch.block_tables, batch.context_lens, batch.scale, rank, out=out,
                         cache_scale=cache_scale)
    assert res is out and torch.equal(out[-1], torch.zeros_like(out[-1])), "padding row (context 0) must be zeros"
    absorbed = torch.einsum("bhl,hvl->bhv", out[: len(contexts)], w_vb)

    rows = [batch.kv_cache[batch.block_tables[i].long()].flatten(0, 1)[:c] for i, c in enumerate(contexts)]
    latent = torch.cat(rows).double() * cache_scale  # [sum of contexts, L + R]
    k_nope = torch.einsum("tl,hnl->thn", latent[:, :rank], w_kb)
    v = torch.einsum("tl,hvl->thv", latent[:, :rank], w_vb)
    cu_q = torch.arange(len(contexts) + 1, dtype=torch.int32)
    cu_k = torch.tensor([0] + contexts).cumsum(0).to(torch.int32)
    materialised = ops.mla_prefill_attention(q_nope, q_pe, k_nope, latent[:, rank:], v, cu_q, cu_k, 1, batch.scale)
    # The references compute in fp32 whatever the input dtype.
    torch.testing.assert_close(absorbed, materialised, atol=1e-6, rtol=1e-4)


def test_absorbed_query_written_in_place_equals_the_concatenation():
    """ops.mla_absorb_query (decode batches past the one-kernel absorption, and a mixed
    step's decode rows): the batched GEMM into a strided view of the result, then q_pe
    copied, is reference.mla_absorb_query; W_UK a strided view of kv_b_proj's weight, q a
    strided view of a projection."""
    from agent_infer.kernels import reference

    heads, nope, rope, latent = 5, 24, 8, 40
    q = randn(7, heads, nope + rope + 3, dtype=torch.float32, device="cpu", seed=1)[..., : nope + rope]
    w_uk = randn(heads, nope + 16, latent, dtype=torch.float32, device="cpu", seed=2)[:, :nope]
    got = ops.mla_absorb_query(q, w_uk)
    assert got.shape == (7, heads, latent + rope)
    assert torch.allclose(got, reference.mla_absorb_query(q, w_uk), rtol=1e-5, atol=1e-5)
