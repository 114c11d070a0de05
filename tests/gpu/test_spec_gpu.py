"""Speculative decoding on a GPU (bf16): verify steps replayed from CUDA graphs give the
tokens eager verify steps give, and greedy decoding with drafts stays close to
transformers under vLLM's logprob-closeness rule (verify rows are decode rows of a
larger batch, so bf16 rounding may differ from plain decoding's: exactness is the CPU
suite's in fp32, and the batch-invariant mode's, tested here too)."""

from __future__ import annotations

import pytest
import torch

from agent_infer.sampling_params import SamplingParams
from tests.drafters import Replay
from tests.gpu.test_engine_gpu import TOP, _engine, _matched_with_transformers, _prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_verify_steps_in_graphs_equal_eager_and_stay_close_to_transformers(name, tiny_model_dirs):
    path = tiny_model_dirs[name]
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=TOP)
    plain = _engine(path, eager=False).generate(prompts, params)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    outs = {}
    for eager in (False, True):
        eng = _engine(path, eager=eager, speculative_config=spec)
        assert (eng.runner.graphs is None) == eager
        eng.draft_policy.batch_drafts = lambda num_decoding: True
        eng.drafter = Replay(plain, wrong_at=2)  # a wrong draft every third proposal: rejections happen
        outs[eager] = eng.generate(prompts, params)
        stats = eng.draft_policy.stats
        assert stats.num_accepted_tokens > 20 and stats.num_draft_tokens > stats.num_accepted_tokens, stats
    assert [o.token_ids for o in outs[False]] == [o.token_ids for o in outs[True]], "graphs and eager differ"
    matched = _matched_with_transformers(path, prompts, {"spec": outs[False], "plain": plain}, name)
    print(f"{name} with drafts: tokens matched before first (tolerated) difference: {matched}")


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_batch_invariant_tokens_equal_each_prompt_alone_in_bf16(eager):
    """bf16 with batch_invariant on the Qwen3-0.6B shape (random weights: near-uniform
    logits, so any change in rounding soon turns a greedy path): each prompt's greedy
    tokens decoded beside others (arriving one per step, ending at other lengths), with
    and without drafts (replayed from its own path, some wrong), and all given at once,
    equal its tokens decoded alone: the batch-1 GEMV takes a row axis, attention splits
    every row as a one-row step does, a prefill step takes one prompt."""
    from agent_infer.bench.random_weights import ensure_random_model
    from tests.test_speculative import _arrivals

    path = ensure_random_model("qwen3-0.6b")
    prompts = [[(97 * i + 13 * j) % 150000 + 10 for i in range(n)] for j, n in enumerate((40, 7, 120, 19, 64, 3))]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (48, 32, 48, 24, 40, 16)]
    alone = _engine(path, eager=eager, batch_invariant=True)
    outs = [alone.generate([p], q)[0] for p, q in zip(prompts, params)]
    expected = [o.token_ids for o in outs]
    assert _arrivals(_engine(path, eager=eager, batch_invariant=True), prompts, params) == expected
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    eng = _engine(path, eager=eager, batch_invariant=True, speculative_config=spec)
    eng.draft_policy.batch_drafts = lambda num_decoding: True
    eng.drafter = Replay(outs)
    assert _arrivals(eng, prompts, params) == expected
    stats = eng.draft_policy.stats
    assert 20 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    together = _engine(path, eager=eager, batch_invariant=True)  # all at once: a prefill step each
    assert [o.token_ids for o in together.generate(prompts, params)] == expected


def test_mtp_draft_passes_in_graphs_equal_eager(tmp_path):
    """DeepSeek-V3's MTP layer as the drafter: a decode step's draft pass replays a graph
    of its own right after the step's graph (the same static metadata and hidden states);
    its drafts and the tokens equal an eager engine's, and the drafts are the reference's
    often enough to be accepted."""
    from tests.deepseek_models import write_deepseek_model
    from tests.test_mtp import MTP, PROMPTS, add_mtp_layer

    path = add_mtp_layer(write_deepseek_model("v3", str(tmp_path / "m")))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    runs = {}
    for eager in (False, True):
        eng = _engine(path, eager=eager, speculative_config=MTP)
        assert (eng.runner.graphs is None) == eager
        assert eager or eng.runner.graphs.draft_graphs
        eng.draft_policy.batch_drafts = lambda num_decoding: True
        drafts = []
        after = eng.drafter.after_step

        def log(batch, row_drafts, after=after, drafts=drafts):
            after(batch, row_drafts)
            drafts.append(row_drafts)

        eng.drafter.after_step = log
        outs = eng.generate(PROMPTS, params)
        runs[eager] = ([o.token_ids for o in outs], drafts, eng.draft_policy.stats)
    (tokens, drafts, stats), (eager_tokens, eager_drafts, _) = runs[False], runs[True]
    assert tokens == eager_tokens, "graphs and eager differ"
    assert drafts == eager_drafts and sum(d is not None for d in drafts) >= params.max_tokens - 1
    assert stats.num_drafts > 20 and stats.num_accepted_tokens > 0, stats
