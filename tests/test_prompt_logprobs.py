"""Prompt logprobs (`SamplingParams.prompt_logprobs`): every prompt token's logprob given
the tokens before it, with the top-k, equal to transformers' log_softmax over the prompt
(fp32); the same when the prompt is prefilled in chunks, in a batch with other requests,
behind a cached prefix, and with async scheduling."""

from __future__ import annotations

import pytest
import torch

from agent_infer.config import EngineConfig
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.sampling_params import SamplingParams, SamplingParamsError
from tests.hf_reference import load_hf_model

PROMPT = [(13 * i + 7) % 400 + 3 for i in range(45)]
TOP = 3


def _engine(path: str, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", num_kv_blocks=64, block_size=16, **kw))


@torch.inference_mode()
def _hf_prompt_logprobs(path: str, prompt: list[int]) -> tuple[list[float], list[list[int]]]:
    model = load_hf_model(path)
    logits = model(input_ids=torch.tensor([prompt])).logits[0, :-1]
    lp = torch.log_softmax(logits.float(), dim=-1)
    return lp.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1).tolist(), lp.topk(TOP).indices.tolist()


def _check(out, ref_lps, ref_top) -> None:
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(PROMPT) and got[0] is None
    assert [g.token_id for g in got[1:]] == PROMPT[1:]
    for i, (g, lp, top) in enumerate(zip(got[1:], ref_lps, ref_top)):
        assert abs(g.logprob - lp) < 1e-4, f"prompt token {i + 1}: {g.logprob} vs {lp}"
        assert len(g.top) == TOP and [t for t, _ in g.top][:2] == top[:2], f"prompt token {i + 1}: top-k differs"


@pytest.mark.parametrize("chunk", [None, 16])
def test_prompt_logprobs_match_transformers(tiny_model_dirs, chunk):
    path = tiny_model_dirs["qwen3"]
    ref_lps, ref_top = _hf_prompt_logprobs(path, PROMPT)
    kw = {"max_num_batched_tokens": chunk} if chunk else {}
    eng = _engine(path, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=TOP)
    others = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outs = eng.generate([PROMPT, [5, 6, 7], PROMPT], [params, others, others])
    _check(outs[0], ref_lps, ref_top)
    assert outs[1].prompt_logprobs is None and outs[2].prompt_logprobs is None
    assert outs[0].token_ids == outs[2].token_ids  # asking for them changes nothing else
    if chunk:
        assert eng.stats.prefill_steps >= 3  # the prompt really went in several chunks


def test_prompt_logprobs_skip_the_prefix_cache_and_work_async(tiny_model_dirs):
    """A cached prefix would leave positions uncomputed, so such a request is computed in
    full even when its prefix is cached; async scheduling reports the same."""
    path = tiny_model_dirs["llama"]
    ref_lps, ref_top = _hf_prompt_logprobs(path, PROMPT)
    eng = _engine(path, async_scheduling=True)
    assert eng.async_scheduling
    plain = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    eng.generate([PROMPT], plain)  # leaves the prompt's blocks in the prefix cache
    hits = eng.block_manager.stats.hits
    eng.generate([PROMPT], plain)
    assert eng.block_manager.stats.hits > hits  # the cache does serve this prompt
    hits = eng.block_manager.stats.hits
    out = eng.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True,
                                                prompt_logprobs=TOP))[0]
    assert eng.block_manager.stats.hits == hits and out.num_cached_tokens == 0
    _check(out, ref_lps, ref_top)


def test_streaming_outputs_carry_prompt_logprobs_once_the_prompt_is_done(tiny_model_dirs):
    eng = _engine(tiny_model_dirs["qwen2"], max_num_batched_tokens=16)
    eng.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=0),
                    request_id="r", stream=True)
    seen = []
    while eng.has_unfinished_requests():
        seen += [o for o in eng.step() if o.request_id == "r"]
    assert seen and all(o.prompt_logprobs is not None for o in seen)  # every output, from the first token on
    assert all(len(p.top) == 0 for p in seen[0].prompt_logprobs[1:])  # prompt_logprobs=0: no alternatives
    assert seen[0].prompt_logprobs is seen[-1].prompt_logprobs  # built once


def _rank_bounds(row: torch.Tensor, token: int, tol: float = 1e-4) -> tuple[int, int]:
    """The ranks a token may have in a transformers log_softmax row, allowing for
    rounding: 1 + the entries surely above it .. 1 + those possibly above it."""
    v = row[token]
    return int((row > v + tol).sum()) + 1, int((row > v - tol).sum()) + 1


def test_prompt_and_sampled_logprobs_carry_the_token_rank(tiny_model_dirs):
    """Every prompt and sampled token's logprob comes with its rank in its row (1 + the
    vocabulary entries with a larger logprob, as vLLM's Logprob.rank), also with no
    top-k to find the token in (prompt_logprobs=0, logprobs=0)."""
    path = tiny_model_dirs["qwen3"]
    out = _engine(path).generate([PROMPT], SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True,
                                                          prompt_logprobs=0, logprobs=0))[0]
    full = PROMPT + out.token_ids
    with torch.inference_mode():
        logits = load_hf_model(path)(input_ids=torch.tensor([full])).logits[0, :-1]
    rows = torch.log_softmax(logits.float(), dim=-1)
    checked = list(zip(out.prompt_logprobs[1:], range(len(PROMPT) - 1)))
    checked += list(zip(out.logprobs, range(len(PROMPT) - 1, len(full) - 1)))
    assert len(checked) == len(full) - 1
    for lp, r in checked:
        assert lp.token_id == full[r + 1] and isinstance(lp.rank, int)
        low, high = _rank_bounds(rows[r], lp.token_id)
        assert low <= lp.rank <= high, f"position {r + 1}: rank {lp.rank}, expected {low}..{high}"
    assert any(lp.rank > 1 for lp, _ in checked)  # not just argmaxes


def test_bad_prompt_logprobs_is_refused():
    with pytest.raises(SamplingParamsError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


def test_prompt_logprobs_with_tensor_parallelism(tiny_model_dirs):
    """Workers run the prompt rows through the vocabulary-parallel LM head too (its gather
    is a collective): TP = 2 reports what TP = 1 does."""
    path = tiny_model_dirs["qwen3_untied"]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=TOP)
    one = _engine(path).generate([PROMPT], params)[0]
    eng = _engine(path, tensor_parallel_size=2, max_num_batched_tokens=16)
    try:
        two = eng.generate([PROMPT], params)[0]
    finally:
        eng.shutdown()
    assert two.token_ids == one.token_ids
    for a, b in zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:]):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
