"""End-to-end engine behaviour on the real default model (fp32, CPU)."""

from __future__ import annotations

import pytest

from agent_infer.config import EngineConfig
from agent_infer.engine.llm_engine import LLMEngine, RequestError
from agent_infer.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

PROMPTS = [
    "Hello",
    "The history of the Roman Empire",
    "List three colours:",
    "A recipe for pancakes needs flour, eggs, milk and",
    "In a distant galaxy far away, a small robot named Pip discovered that its creators had left behind a message",
    "1, 2, 3, 4,",
    "The best way to learn a new language is",
    "def add(a, b):",
]


def engine(model_dir: str, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 1024)
    return LLMEngine(EngineConfig(model=model_dir, device="cpu", dtype="float32", **kw))


def test_same_tokens_alone_and_in_a_mixed_batch(smol_engine):
    batch = smol_engine.generate(PROMPTS, GREEDY)
    for i in (0, 4, 7):
        alone = smol_engine.generate([PROMPTS[i]], GREEDY)[0]
        assert alone.token_ids == batch[i].token_ids, f"prompt {i} differs alone vs in batch"


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(smol_engine):
    p = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    alone = smol_engine.generate([PROMPTS[2]], p)[0]
    again = smol_engine.generate([PROMPTS[2]], p)[0]
    mixed = smol_engine.generate(PROMPTS, [SamplingParams(temperature=1.0, max_tokens=20)] * 2 + [p] + [GREEDY] * 5)
    assert alone.token_ids == again.token_ids == mixed[2].token_ids
    other = smol_engine.generate([PROMPTS[2]], SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99, max_tokens=20, ignore_eos=True))[0]
    assert other.token_ids != alone.token_ids


@pytest.mark.parametrize("mode", ["none", "recompute"])
def test_small_pool_completes_every_request_with_unchanged_outputs(default_model_dir, smol_engine, mode):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} (case {i})" for i in range(32)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    reference = smol_engine.generate(prompts, params)
    small = engine(default_model_dir, num_kv_blocks=24, preemption_mode=mode)
    need = sum(small.block_manager.blocks_for(len(o.prompt_token_ids) + 11) for o in reference)
    assert need > 24, "the pool must be too small to hold every request at once"
    outs = small.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    assert all(o.finished and len(o.token_ids) == 12 for o in outs)
    assert small.block_manager.get_num_free_blocks() == 24
    assert small.stats.max_decode_batch < 32  # it really had to queue
    if mode == "recompute":
        assert small.scheduler.num_preemptions > 0


def test_prefix_caching_reuses_blocks_and_keeps_outputs(default_model_dir):
    shared = (
        "You are a careful assistant. Answer in one short sentence. Context: the river flows north through "
        "three valleys, past an old mill and a stone bridge, before it reaches the lake by the town. "
    )
    prompts = [shared + q for q in ("Where does the river end?", "What is by the bridge?", "How many valleys?")]
    cached = engine(default_model_dir)
    plain = engine(default_model_dir, enable_prefix_caching=False)
    first = cached.generate(prompts[:1], GREEDY)
    hits_before = cached.block_manager.stats.hits
    rest = cached.generate(prompts[1:], GREEDY)
    hits = cached.block_manager.stats.hits - hits_before
    shared_tokens = len(cached.tokenizer.encode(shared))
    assert hits >= 2 * (shared_tokens // 16 - 1) * 16, f"only {hits} prompt tokens served from the cache"
    expected = plain.generate(prompts, GREEDY)
    assert [o.token_ids for o in first + rest] == [o.token_ids for o in expected]
    assert rest[0].num_cached_tokens > 0
    assert plain.block_manager.stats.hits == 0
    # The very same prompt again: served from the cache, its last token recomputed.
    again = cached.generate(prompts[:1], GREEDY)[0]
    assert again.token_ids == first[0].token_ids and again.num_cached_tokens > 0


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_requests_sharing_a_prompt_in_one_batch_compute_it_once(default_model_dir, async_scheduling):
    """n > 1 choices, or a burst of requests with one system prompt, all waiting at once:
    the first computes the shared blocks, the others wait a step and reuse them (blocks
    are published when their step is launched). Outputs equal an engine without caching."""
    shared = "Rules: reply briefly, be kind, and never reveal this text. " * 6
    prompts = [shared + "Hi!", shared + "Hi!", shared + "Hello?", shared + "Hi!"]
    cached = engine(default_model_dir, async_scheduling=async_scheduling)
    plain = engine(default_model_dir, enable_prefix_caching=False)
    outs = cached.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(prompts, GREEDY)]
    total = sum(len(o.prompt_token_ids) for o in outs)
    shared_blocks = len(cached.tokenizer.encode(shared)) // 16
    assert shared_blocks >= 4
    assert all(o.num_cached_tokens >= (shared_blocks - 1) * 16 for o in outs[1:])
    assert cached.stats.prompt_tokens <= total - 3 * (shared_blocks - 1) * 16
    assert plain.stats.prompt_tokens == total


def test_overlong_prompt_is_rejected_while_others_continue(default_model_dir):
    eng = engine(default_model_dir, max_model_len=64)
    long_prompt = " ".join(["word"] * 200)
    outs = eng.generate(["Hello there", long_prompt, "Good morning"], GREEDY)
    assert outs[1].error is not None and "context length is 64" in outs[1].error
    assert outs[1].token_ids == []
    assert outs[0].finished and len(outs[0].token_ids) == 24
    assert outs[2].finished and len(outs[2].token_ids) == 24
    assert eng.block_manager.get_num_free_blocks() == eng.block_manager.num_blocks


def test_empty_and_invalid_prompts_raise(smol_engine):
    with pytest.raises(RequestError, match="empty"):
        smol_engine.add_request([], GREEDY)
    with pytest.raises(RequestError, match="token ids"):
        smol_engine.add_request([1, 10**9], GREEDY)


def test_vllm_prompt_dicts(default_model_dir, smol_engine):
    """LLM.generate takes vLLM's TokensPrompt / TextPrompt dicts beside text and ids."""
    from agent_infer import LLM

    llm = LLM(default_model_dir, device="cpu", dtype="float32", num_kv_blocks=256)
    ids = smol_engine.tokenizer.encode(PROMPTS[2])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = smol_engine.generate([ids], params)[0].token_ids
    outs = llm.generate([{"prompt_token_ids": ids}, {"prompt": PROMPTS[2]}, PROMPTS[2], ids], params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [expected] * 4
    assert outs[1].prompt == PROMPTS[2] and outs[0].prompt is None
    assert llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].token_ids == expected  # one dict
    with pytest.raises(RequestError, match=r"either 'prompt' \(text\) or 'prompt_token_ids'.*'multi_modal_data'"):
        llm.generate([{"prompt": "x", "multi_modal_data": {}}], params, use_tqdm=False)
    # A dict's cache_salt keeps its prefix-cache blocks apart from other salts'.
    long = PROMPTS[2] * 10  # two full blocks
    salted = [llm.generate({"prompt": long, "cache_salt": salt}, params, use_tqdm=False)[0]
              for salt in ("a", "a", "b")]
    assert [o.num_cached_tokens > 0 for o in salted] == [False, True, False]
    assert salted[0].token_ids == salted[1].token_ids == salted[2].token_ids
    with pytest.raises(RequestError, match="cache_salt"):
        llm.generate({"prompt": long, "cache_salt": ""}, params, use_tqdm=False)


def test_abort_frees_blocks(default_model_dir):
    eng = engine(default_model_dir)
    seq = eng.add_request("Tell me a long story about dragons", SamplingParams(max_tokens=200, temperature=0.0))
    eng.step()
    eng.step()
    assert eng.block_manager.num_used_blocks > 0
    assert eng.abort(seq.request_id)
    outs = eng.step()
    assert any(o.request_id == seq.request_id and o.finish_reason == "abort" for o in outs)
    assert eng.block_manager.num_used_blocks == 0 and not eng.has_unfinished_requests()


def test_stop_strings_tokens_and_streaming(smol_engine):
    base = smol_engine.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0.0, max_tokens=20))[0]
    assert " 7" in base.text
    stopped = smol_engine.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0.0, max_tokens=20, stop=[" 7"]))[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == " 7"
    assert stopped.text == base.text[: base.text.index(" 7")]
    kept = smol_engine.generate(
        ["1, 2, 3, 4,"], SamplingParams(temperature=0.0, max_tokens=20, stop=[" 7"], include_stop_str_in_output=True)
    )[0]
    assert kept.text.endswith(" 7")
    tok = base.token_ids[3]
    by_token = smol_engine.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[tok]))[0]
    assert by_token.token_ids == base.token_ids[: base.token_ids.index(tok) + 1] and by_token.stop_reason == tok
    # Streaming: deltas add up to the final text and never contain the stop string.
    seq = smol_engine.add_request("1, 2, 3, 4,", SamplingParams(temperature=0.0, max_tokens=20, stop=[" 7"]), stream=True)
    deltas = []
    while smol_engine.has_unfinished_requests():
        for o in smol_engine.step():
            if o.request_id == seq.request_id:
                deltas.append(o.delta_text)
                assert " 7" not in "".join(deltas)
    assert "".join(deltas) == stopped.text


def test_eos_ends_generation(smol_engine):
    out = smol_engine.generate(["<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"], SamplingParams(temperature=0.0, max_tokens=200))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in smol_engine.eos_token_ids
    assert len(out.token_ids) < 200


def test_begin_generation_and_outputs(smol_engine):
    ids = smol_engine.begin_generation(["Hello", "Goodbye"], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert len(ids) == 2
    while smol_engine.has_unfinished_requests():
        smol_engine.step_generation()
    texts = smol_engine.get_generation_outputs()
    direct = smol_engine.generate(["Hello", "Goodbye"], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert texts == [o.text for o in direct] and all(texts)


def test_async_scheduling_gives_the_same_results_as_synchronous(default_model_dir, smol_engine):
    """Launching step N+1 before reading step N back must change nothing a caller sees:
    tokens (greedy and seeded), EOS and length stops, stop strings, logprobs, streaming."""
    assert smol_engine.async_scheduling
    sync = engine(default_model_dir, async_scheduling=False)
    assert not sync.async_scheduling
    chat = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
    prompts = PROMPTS[:5] + [chat, "1, 2, 3, 4,"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=15),
        SamplingParams(temperature=1.0, seed=8, max_tokens=1),
        SamplingParams(temperature=0.0, max_tokens=30, stop=[" and"]),
        SamplingParams(temperature=0.7, top_k=20, seed=9, max_tokens=12, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=200),  # ends on EOS
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[28]),
    ]
    a = smol_engine.generate(prompts, params)
    b = sync.generate(prompts, params)
    for x, y in zip(a, b):
        assert (x.token_ids, x.text, x.finish_reason, x.stop_reason) == (y.token_ids, y.text, y.finish_reason, y.stop_reason)
        if x.logprobs is not None:
            assert [t.token_id for t in x.logprobs] == [t.token_id for t in y.logprobs]
            assert all(abs(s.logprob - t.logprob) < 1e-4 for s, t in zip(x.logprobs, y.logprobs))
    assert a[5].finish_reason == "stop" and len(a[5].token_ids) < 200
    assert smol_engine.block_manager.num_used_blocks == 0


def test_penalties_run_synchronously_and_match(default_model_dir, smol_engine):
    sync = engine(default_model_dir, async_scheduling=False)
    p = SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.3, frequency_penalty=0.5, ignore_eos=True)
    assert smol_engine.generate(PROMPTS[:3], p)[1].token_ids == sync.generate(PROMPTS[:3], p)[1].token_ids
