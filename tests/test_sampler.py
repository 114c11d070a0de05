"""Sampler: greedy, temperature, top-k/top-p/min-p support, seeded reproducibility that
does not depend on the batch, the exponential race's distribution, penalties, logprobs."""

from __future__ import annotations

import math

import torch

from agent_infer.engine.sampler import Sampler, SamplingBatch, apply_top_k_top_p
from agent_infer.kernels.reference import uniform_noise
from agent_infer.engine.structs import Sequence
from agent_infer.sampling_params import SamplingParams

V = 50


def seqs_for(params: list[SamplingParams], outputs: list[list[int]] | None = None, seeds=None) -> list[Sequence]:
    out = []
    for i, p in enumerate(params):
        s = Sequence(f"r{i}", [1, 2, 3], p, max_tokens=100, seed=(seeds[i] if seeds else 1000 + i))
        if outputs:
            s.output_token_ids = list(outputs[i])
        out.append(s)
    return out


def sample(logits, params, **kw):
    seqs = seqs_for(params, **kw)
    return Sampler()(logits, SamplingBatch.from_seqs(seqs, logits.shape[-1], logits.device))


def test_greedy_is_argmax():
    logits = torch.randn(6, V)
    out = sample(logits, [SamplingParams(temperature=0.0)] * 6)
    assert torch.equal(out.tokens, logits.argmax(-1))


def test_mixed_greedy_and_random_rows():
    logits = torch.randn(4, V)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 2
    out = sample(logits, params)
    assert out.tokens[0] == logits[0].argmax() and out.tokens[2] == logits[2].argmax()


def test_greedy_rows_stay_greedy_beside_top_k_top_p_rows():
    logits = torch.randn(4, V)
    params = [SamplingParams(temperature=0.0, top_p=0.5), SamplingParams(temperature=1.0, top_k=5)] * 2
    out = sample(logits, params)
    assert out.tokens[0] == logits[0].argmax() and out.tokens[2] == logits[2].argmax()
    assert out.tokens[1] in logits[1].topk(5).indices and out.tokens[3] in logits[3].topk(5).indices


def test_top_k_limits_support():
    torch.manual_seed(0)
    logits = torch.randn(1, V)
    allowed = set(logits[0].topk(3).indices.tolist())
    seen = set()
    for seed in range(200):
        out = sample(logits, [SamplingParams(temperature=1.5, top_k=3)], seeds=[seed])
        seen.add(int(out.tokens[0]))
    assert seen <= allowed and len(seen) == 3


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (V - 4)]))
    masked = apply_top_k_top_p(logits, None, torch.tensor([0.7]))
    kept = torch.isfinite(masked[0]).nonzero().flatten().tolist()
    assert kept == [0, 1]  # 0.5 + 0.3 >= 0.7; 0.15 is outside
    masked = apply_top_k_top_p(logits, None, torch.tensor([0.01]))
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == [0]  # the top token always survives


def test_min_p_drops_unlikely_tokens():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1] + [1e-6] * (V - 3)]))
    seen = {int(sample(logits, [SamplingParams(temperature=1.0, min_p=0.4)], seeds=[s]).tokens[0]) for s in range(200)}
    assert seen == {0, 1}


def test_seeded_sampling_is_reproducible_and_batch_independent():
    torch.manual_seed(1)
    logits = torch.randn(8, V)
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=42)
    alone = sample(logits[3:4], [p], seeds=[42]).tokens
    others = [SamplingParams(temperature=0.7)] * 8
    others[3] = p
    seeds = list(range(8))
    seeds[3] = 42
    in_batch = sample(logits, others, seeds=seeds).tokens
    assert in_batch[3] == alone[0]
    # A different seed gives (over many steps) a different stream.
    a = [int(sample(logits[:1], [p], seeds=[42], outputs=[[0] * k]).tokens[0]) for k in range(30)]
    b = [int(sample(logits[:1], [p], seeds=[43], outputs=[[0] * k]).tokens[0]) for k in range(30)]
    assert a != b


def test_exponential_race_matches_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125])
    logits = probs.log().repeat(4000, 1)
    seqs = seqs_for([SamplingParams(temperature=1.0)] * 4000, seeds=list(range(4000)))
    out = Sampler()(logits, SamplingBatch.from_seqs(seqs, 4, logits.device))
    freq = torch.bincount(out.tokens, minlength=4).float() / 4000
    # 4000 draws: standard error <= 0.008; allow 4 sigma.
    assert torch.allclose(freq, probs, atol=0.032), freq


def test_uniform_noise_is_in_range_and_spread():
    u = uniform_noise(torch.arange(64, dtype=torch.int64), torch.zeros(64, dtype=torch.int64), 1000)
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01
    assert u.std().item() > 0.28  # uniform(0,1) has 0.2887


def test_temperature_sharpens():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(2000, 1)
    cold = Sampler()(logits, SamplingBatch.from_seqs(seqs_for([SamplingParams(temperature=0.2)] * 2000, seeds=list(range(2000))), 4, logits.device))
    hot = Sampler()(logits, SamplingBatch.from_seqs(seqs_for([SamplingParams(temperature=2.0)] * 2000, seeds=list(range(2000))), 4, logits.device))
    assert (cold.tokens == 0).float().mean() > 0.95
    assert (hot.tokens == 0).float().mean() < 0.6


def test_penalties():
    logits = torch.tensor([[2.0, 1.9, -1.0, 0.5] + [-5.0] * (V - 4)])
    # token 0 was generated 3 times: frequency penalty 0.5 lowers it by 1.5 and greedy moves to 1.
    out = sample(logits, [SamplingParams(temperature=0.0, frequency_penalty=0.5)], outputs=[[0, 0, 0]])
    assert out.tokens[0] == 1
    out = sample(logits, [SamplingParams(temperature=0.0, presence_penalty=0.2)], outputs=[[0]])
    assert out.tokens[0] == 1
    # repetition penalty divides positive logits of seen tokens (prompt [1, 2, 3] included).
    out = sample(logits, [SamplingParams(temperature=0.0, repetition_penalty=1.2)], outputs=[[]])
    assert out.tokens[0] == 0  # 1.9 / 1.2 < 2.0
    logits = torch.tensor([[2.0, -1.0, -1.0, -1.0, 1.8] + [-5.0] * (V - 5)])
    out = sample(logits, [SamplingParams(temperature=0.0, repetition_penalty=1.2)], outputs=[[0]])
    assert out.tokens[0] == 4  # seen token 0 drops to 2.0 / 1.2 < 1.8
    out = sample(logits, [SamplingParams(temperature=0.0, repetition_penalty=1.2)], outputs=[[5]])
    assert out.tokens[0] == 0


def test_logprobs_are_raw_model_logprobs():
    logits = torch.randn(3, V)
    out = sample(logits, [SamplingParams(temperature=0.0, logprobs=4)] * 3)
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(out.logprobs, ref.gather(1, out.tokens[:, None]).squeeze(1))
    vals, ids = ref.topk(4)
    assert torch.equal(out.top_ids, ids) and torch.allclose(out.top_logprobs, vals)
    assert math.isclose(out.top_logprobs[0, 0].item(), out.logprobs[0].item(), rel_tol=1e-6)
