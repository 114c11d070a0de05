"""Speculative decoding: greedy tokens equal plain decoding (prompt lookup on the default
model, batched, with runs cut by stop strings, max_tokens and EOS; verify steps chained
onto one still in flight too), rejected drafts leave
nothing in the prefix cache, rejection sampling keeps the target's distribution (a
chi-square test on a tiny vocabulary), structured outputs still match with drafts, the
draft policy turns drafting off where it costs, and the metrics count what happened."""

from __future__ import annotations

import functools
import json
import math
import re
from collections import Counter
from dataclasses import replace

import pytest
import torch

from agent_infer.config import ConfigError, EngineConfig
from agent_infer.engine.block_manager import chain_hash, chain_root
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.loader.tokenizer import ChatFormatter
from agent_infer.sampling_params import SamplingParams, StructuredOutputsParams as SO
from agent_infer.speculative.config import SpeculativeConfig
from agent_infer.speculative.ngram import propose_ngram
from agent_infer.speculative.policy import MAX_PAUSE_STEPS, DraftPolicy
from tests.drafters import Replay

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def spec_engine(model: str, **kw) -> LLMEngine:
    """A CPU engine that drafts at every decode step (the timing policy is tested apart)."""
    kw = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 1024, "speculative_config": NGRAM, **kw}
    engine = LLMEngine(EngineConfig(model=model, **kw))
    engine.draft_policy.batch_drafts = lambda num_decoding: True
    return engine


class Runs:
    """Per verify row that ended its sequence: (request, finish reason, drafts accepted,
    tokens kept), and the output cut short by a stop string or grammar after the fact."""

    def __init__(self, engine: LLMEngine):
        self.ended: list[tuple[str, str, int, int]] = []
        self.cut: list[tuple[str, int, int]] = []
        sched = engine.scheduler
        on_result, finish = sched.on_result, sched.finish

        def log_result(batch, tokens):
            before = {id(s): s.num_resolved for s in batch.seqs}
            out = on_result(batch, tokens)
            accepted = iter(batch.accepted)
            for i, seq in enumerate(batch.seqs):
                if batch.drafts_of(i):
                    n = next(accepted)
                    if seq.is_finished and n:
                        self.ended.append((seq.request_id, seq.finish_reason.value, n, seq.num_resolved - before[id(seq)]))
            return out

        def log_finish(seq, reason, keep=None):
            if keep is not None and keep < seq.num_resolved:
                self.cut.append((seq.request_id, keep, seq.num_resolved))
            return finish(seq, reason, keep)

        sched.on_result, sched.finish = log_result, log_finish


def chat_ids(engine: LLMEngine, text: str) -> list[int]:
    fmt = ChatFormatter(engine.tokenizer)
    return engine.tokenizer.encode(fmt.render([{"role": "user", "content": text}]), add_special_tokens=False)


# ---- configuration and drafts ---------------------------------------------------------------


def test_the_config_takes_vllm_keys_and_refuses_the_rest():
    c = SpeculativeConfig.parse(json.dumps(NGRAM))
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == ("ngram", 4, 3, 1)
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2}).prompt_lookup_min == 5
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}) \
        .prompt_lookup_min == 3
    assert SpeculativeConfig.parse({"method": "deepseek_mtp", "num_speculative_tokens": 1}).method == "mtp"
    for bad, words in [({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "'model'"),
                       ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_maxx": 3}, "prompt_lookup_maxx"),
                       ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                         "prompt_lookup_max": 3}, "prompt_lookup_min"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "chain_verify_steps": False},
                        "chain_verify_steps"),
                       ("{not json", "JSON")]:
        with pytest.raises(ConfigError, match=re.escape(words)):
            SpeculativeConfig.parse(bad)
    assert SpeculativeConfig.parse(NGRAM).chain_verify_steps is True  # Python only: not one of vLLM's keys
    with pytest.raises(ConfigError, match="chain_verify_steps"):
        SpeculativeConfig("ngram", 4, 3, 1, chain_verify_steps=0)
    assert EngineConfig(model="m", speculative_config=NGRAM).speculative_config == SpeculativeConfig.parse(NGRAM)


def test_prompt_lookup_takes_the_longest_then_latest_match():
    t = torch.tensor([1, 2, 3, 4, 7, 2, 3, 5, 1, 2, 3]).numpy()
    assert propose_ngram(t, 3, 1, 3) == [4, 7, 2]  # "1 2 3" (at 0) beats the later "2 3" (at 5)
    assert propose_ngram(t, 3, 1, 2) == [5, 1, 2]  # at most two: the latest "2 3"
    assert propose_ngram(t, 9, 1, 2) == [5, 1, 2, 3]  # what follows, up to the end
    assert propose_ngram(t, 2, 4, 4) == []  # no earlier "3 1 2 3"
    assert propose_ngram(t[:3], 2, 1, 1) == []


# ---- exactness ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spec_smol(default_model_dir):
    return spec_engine(default_model_dir)


def test_greedy_tokens_equal_plain_decoding_on_the_default_model(smol_engine, spec_smol):
    """Batched prompts that repeat themselves (so drafts are accepted), runs that end on
    max_tokens, EOS and a stop string inside them, logprobs and a repetition penalty."""
    engine = spec_smol
    prompts = [
        "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3,",
        "a b c d e f g h a b c d e f g h a b c",
        chat_ids(engine, "Say exactly this and nothing else: The cat sat on the mat."),
        chat_ids(engine, "Copy this line: def add(a, b): return a + b"),
        "The capital of France is",
        "red green blue red green blue red green",
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=10),  # the run reaches max_tokens
        SamplingParams(temperature=0, max_tokens=40, stop=["f g h a b c d"]),  # a stop string inside a run
        SamplingParams(temperature=0, max_tokens=40),  # EOS inside a run
        SamplingParams(temperature=0, max_tokens=40, logprobs=3),
        SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3),
        SamplingParams(temperature=0.8, seed=11, max_tokens=30),  # seeded sampling: the same tokens too
    ]
    runs = Runs(engine)
    try:
        plain = smol_engine.generate(prompts, params)
        spec = engine.generate(prompts, params)
    finally:
        del engine.scheduler.on_result, engine.scheduler.finish
    for a, b in zip(plain, spec):
        assert b.token_ids == a.token_ids and b.text == a.text and b.finish_reason == a.finish_reason
        for x, y in zip(a.logprobs or [], b.logprobs or []):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4
            assert len(x.top) == len(y.top) == 3 and [t for t, _ in x.top] == [t for t, _ in y.top]
    stats = engine.draft_policy.stats
    assert stats.num_accepted_tokens > 20, stats
    reasons = {(rid, reason) for rid, reason, _, _ in runs.ended}
    ids = [o.request_id for o in spec]
    assert (ids[0], "length") in reasons
    eos_inside = [r for r in runs.ended if r[0] == ids[2] and r[1] == "stop"]
    assert eos_inside and eos_inside[0][3] < eos_inside[0][2] + 1  # EOS, with accepted drafts after it dropped
    assert any(rid == ids[1] for rid, _, _ in runs.cut)  # the stop string ended it before the run did
    assert spec[1].text.endswith(" d e ") and spec[1].stop_reason == "f g h a b c d"


def test_rejected_drafts_leave_nothing_in_the_prefix_cache(smol_engine, spec_smol):
    """Every block the prefix cache knows holds tokens its sequence really has, and
    prompts that extend the outputs (served from blocks written by verify steps) still
    decode as plain decoding does."""
    engine = spec_smol
    prompts = ["x y z x y z x y z x y", "one two three one two three one two three one"]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    engine.reset_history()  # only this test's blocks in the cache
    first = engine.generate(prompts, params)
    assert engine.draft_policy.stats.num_draft_tokens > engine.draft_policy.stats.num_accepted_tokens > 0
    bm = engine.block_manager
    bs = bm.block_size
    # The last token has no K/V.
    real = {k for out in first for k in _block_keys(out.prompt_token_ids + out.token_ids[:-1], bs)}
    published = {k for k, b in bm.key_to_block.items() if bm.block_tokens[b] is not None}
    output_keys = published - {k for out in first for k in _block_keys(out.prompt_token_ids, bs)}
    assert output_keys and output_keys <= real
    again = [o.prompt_token_ids + o.token_ids for o in first]
    hits0 = bm.stats.hits
    spec = engine.generate(again, params)
    assert bm.stats.hits - hits0 >= sum(len(p) // bs - 1 for p in again)
    plain = smol_engine.generate(again, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def test_chained_verify_steps_give_plain_decodings_tokens(default_model_dir, smol_engine):
    """Steps launched before the verify step in flight is read back (async scheduling),
    drafted on a guess of what it gives (Replay proposes plain decoding's own
    continuation, every second proposal's eighth token wrong): where that step rejects
    drafts, the device moves the next step's rows back by as many, and the tokens,
    logprobs (seeded samples included) and finish reasons are plain decoding's; runs end
    on max_tokens, EOS and a stop string; the prefix cache holds only tokens the sequences have."""
    prompts = ["1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2,",
               "a b c d e f g h a b c d e f g h a b c", "The capital of France is",
               chat_ids(smol_engine, "Copy this line: def add(a, b): return a + b")]
    params = [SamplingParams(temperature=0, max_tokens=37, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0, max_tokens=40, stop=["f g h a b c d"]),
              SamplingParams(temperature=0.8, seed=5, max_tokens=30),
              SamplingParams(temperature=0, max_tokens=60)]
    plain = smol_engine.generate(prompts, params)
    engine = spec_engine(default_model_dir, block_size=2)  # blocks fill (and are published) every other token
    assert engine.async_scheduling
    # The eighth token of a proposal made behind a one-token step (the first is that
    # step's token): a draft of the step after (k = 4).
    engine.drafter = Replay(plain, wrong_at=7, every=2)
    moved, resolve_rows = [], engine.runner.resolve_rows

    def count_moved(step, *args):
        resolve_rows(step, *args)
        moved.append(int((engine.runner._row_shift != 0).sum()))

    engine.runner.resolve_rows = count_moved
    got = [engine.generate([p], sp)[0] for p, sp in zip(prompts, params)] + engine.generate(prompts, params)
    stats = engine.draft_policy.stats
    assert stats.num_chained_rows > 10, stats
    assert sum(1 for m in moved if m) > 3, moved  # rows the device moved back
    for a, b in zip(plain + plain, got):
        assert b.token_ids == a.token_ids and b.text == a.text and b.finish_reason == a.finish_reason
        for x, y in zip(a.logprobs or [], b.logprobs or []):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4
    # A stop string inside an accepted run ends the output, not the K/V computed past it:
    # those tokens are the model's own, so their blocks may be cached.
    uncut = smol_engine.generate(prompts, [replace(sp, stop=None) for sp in params])
    bm = engine.block_manager
    real = {k for out in uncut for k in _block_keys(out.prompt_token_ids + out.token_ids[:-1], bm.block_size)}
    published = {k for k, b in bm.key_to_block.items() if bm.block_tokens[b] is not None}
    assert published and published <= real


def test_drafts_behind_a_row_in_flight_follow_the_text_it_gave(default_model_dir, smol_engine):
    """Prompt lookup behind a row still in flight: the host's lookup in the tokens it knows
    only sizes the next row, whose drafts the device looks up in the text with what the row
    in flight really gave (`ops.lookup_drafts`). Every such row verifies exactly
    `propose_ngram`'s drafts on the sequence's real tokens before it (as many as it found,
    the host's after them), rows where the host's drafts were wrong among them, and the
    tokens are plain decoding's."""
    import numpy as np

    prompts = ["1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2,",
               "one two three four one two four three one two three five one two",
               chat_ids(smol_engine, "Copy this line twice: def add(a, b): return a + b")]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = smol_engine.generate(prompts, params)
    engine = spec_engine(default_model_dir)
    spec = engine.config.speculative_config
    host_drafts, build_step = {}, engine.runner.build_step

    def keep_host_drafts(batch):
        host_drafts[id(batch)] = [list(d) for d in batch.drafts]
        return build_step(batch)

    checked, on_result = [], engine.scheduler.on_result

    def check(batch, tokens):
        for i, history in enumerate(batch.draft_histories):
            if history is None:
                continue
            seq, drafts = batch.seqs[i], batch.drafts[i]
            real = np.asarray(seq.prompt_token_ids + seq.output_token_ids[: seq.num_resolved], dtype=np.int64)
            assert np.array_equal(history, real[: len(history)]), "the host's tokens are the sequence's"
            found = propose_ngram(real, len(drafts), spec.prompt_lookup_min, spec.prompt_lookup_max)
            host = host_drafts[id(batch)][i]
            assert drafts == found + host[len(found):], (drafts, found, host)
            checked.append(found != host[: len(found)])
        return on_result(batch, tokens)

    engine.runner.build_step, engine.scheduler.on_result = keep_host_drafts, check
    got = engine.generate(prompts, params) + [engine.generate([p], params)[0] for p in prompts]
    assert [o.token_ids for o in got] == [o.token_ids for o in plain + plain]
    assert len(checked) >= 10 and sum(checked) >= 2, checked  # rows the host's drafts got wrong among them
    stats = engine.draft_policy.stats
    assert stats.num_chained_rows >= 10 and stats.num_accepted_tokens > 0.5 * stats.num_draft_tokens, stats


class MissAndGuess(Replay):
    """Replay that finds nothing at every third proposal and, at every fifth, proposes a
    wrong token and a wrong one after it (`wrong_calls`): behind a one-token step the
    first is the prediction of the token in flight, so the drafts after it fail."""

    def __init__(self, outs):
        super().__init__(outs)
        self.wrong_calls: set[int] = set()

    def propose(self, request_id, prompt, tokens_at, total, k, known=None):
        run = super().propose(request_id, prompt, tokens_at, total, k)
        if self.calls % 3 == 0:
            return []
        if len(run) > 1 and self.calls % 5 == 0:
            run[0], run[1] = (run[0] + 1) % 100, (run[1] + 1) % 100
            self.wrong_calls.add(self.calls)
        return run


def test_drafts_behind_a_one_token_step_give_plain_decodings_tokens(default_model_dir, smol_engine):
    """Drafts proposed while the step in flight still computes the sequence's one next
    token (a plain decode row after a miss, a prompt's last chunk), so that looking for
    drafts costs that step no overlap: the verify row starts at the token in flight, and
    drafts predicted after a wrong prediction of it are rejected. The tokens, logprobs and
    finish reasons are plain decoding's, alone and batched, with chaining on and off."""
    prompts = ["1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2,",
               "a b c d e f g h a b c d e f g h a b c",
               chat_ids(smol_engine, "Copy this line: def add(a, b): return a + b")]
    params = [SamplingParams(temperature=0, max_tokens=37, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=40, stop=["f g h a b c d"]),
              SamplingParams(temperature=0, max_tokens=60)]
    plain = smol_engine.generate(prompts, params)
    for chain in (False, True):
        spec = replace(SpeculativeConfig.parse(NGRAM), chain_verify_steps=chain)
        engine = spec_engine(default_model_dir, speculative_config=spec)
        engine.drafter = MissAndGuess(plain)
        engine.draft_policy.may_draft = lambda request_id, length: True  # no pause after misses
        behind, propose_behind = [], engine._propose_behind

        def count_behind(seqs, drafter=engine.drafter):
            first = drafter.calls + 1
            took = propose_behind(seqs)
            behind.append((took, set(range(first, drafter.calls + 1)) & drafter.wrong_calls))
            return took

        engine._propose_behind = count_behind
        verified, on_verified = [], engine.draft_policy.on_verified
        engine.draft_policy.on_verified = \
            lambda rid, d, a, n: verified.append((d, a)) or on_verified(rid, d, a, n)
        got = [engine.generate([p], sp)[0] for p, sp in zip(prompts, params)] + engine.generate(prompts, params)
        for a, b in zip(plain + plain, got):
            assert b.token_ids == a.token_ids and b.text == a.text and b.finish_reason == a.finish_reason
            for x, y in zip(a.logprobs or [], b.logprobs or []):
                assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4
        assert sum(took for took, _ in behind) >= 4, behind  # drafted with a step in flight
        assert any(took and wrong for took, wrong in behind), behind  # a wrong prediction of the token in flight
        # Drafts aligned after the predicted token (not on it): most are accepted (63 % with
        # chaining, where a wrong prediction also misleads the guess of the row after it;
        # under half when shifted by one, through the misses and wrong predictions).
        stats = engine.draft_policy.stats
        assert stats.num_accepted_tokens > 0.58 * stats.num_draft_tokens, stats
        assert any(d and a == 0 for d, a in verified) and any(d and a == d for d, a in verified), verified


def test_verify_steps_read_back_first_without_chaining(default_model_dir, smol_engine):
    """chain_verify_steps = False: every verify step is read back before the next is
    launched (no row follows one in flight), with the same tokens as plain decoding."""
    prompts = ["1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2,", "a b c d e f g h a b c d"]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = smol_engine.generate(prompts, params)
    spec = replace(SpeculativeConfig.parse(NGRAM), chain_verify_steps=False)
    engine = spec_engine(default_model_dir, speculative_config=spec)
    engine.drafter = Replay(plain, wrong_at=2)
    follows, build_step = [], engine.runner.build_step

    def record(batch):
        step = build_step(batch)
        follows.append(step.follow)
        return step

    engine.runner.build_step = record
    got = engine.generate(prompts, params)
    stats = engine.draft_policy.stats
    assert stats.num_drafts > 0 and stats.num_chained_rows == 0, stats
    assert len(follows) > 5 and all(f is None for f in follows)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]


def _block_keys(tokens: list[int], bs: int) -> set[int]:
    """The prefix cache's chained keys of the full blocks of `tokens` (unsalted)."""
    keys, parent = set(), chain_root(None)
    for i in range(len(tokens) // bs):
        parent = chain_hash(parent, tuple(tokens[i * bs: (i + 1) * bs]))
        keys.add(parent)
    return keys


@pytest.mark.parametrize("mixed", [False, True])
def test_continuous_batching_with_arrivals(default_model_dir, smol_engine, mixed):
    """Requests arrive while others verify (chunked prefill beside verify rows with
    --mixed-batches, prefill steps between them without; rows drafted behind one in flight
    looked up on the device in either): the tokens stay those of plain decoding."""
    engine = spec_engine(default_model_dir, mixed_batches=mixed, max_num_batched_tokens=24)
    lookups, build_step = [], engine.runner.build_step
    engine.runner.build_step = lambda batch: lookups.append((batch.is_prefill, batch.draft_histories != [])) or \
        build_step(batch)
    prompts = ["1 2 3 4 1 2 3 4 1 2", "The quick brown fox jumps over the lazy dog. The quick brown",
               "A long prompt that needs several chunks of prefill: " + "lorem ipsum dolor " * 6, "z y x z y x z"]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = smol_engine.generate(prompts, params)
    got = {}
    engine.add_request(prompts[0], params, request_id="r0")
    pending = list(enumerate(prompts))[1:]
    while engine.has_unfinished_requests() or pending:
        if pending and engine.draft_policy.stats.num_drafts:  # the next arrives once drafting runs
            i, p = pending.pop(0)
            engine.add_request(p, params, request_id=f"r{i}")
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.token_ids
    assert [got[f"r{i}"] for i in range(len(prompts))] == [o.token_ids for o in expected]
    assert engine.draft_policy.stats.num_accepted_tokens > 0
    assert (mixed, True) in lookups, lookups  # beside a prompt's chunk too, with --mixed-batches


def _arrivals(engine: LLMEngine, prompts: list, params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    """Greedy tokens of `prompts` arriving one per step: each prefills in a step of its own,
    then decodes beside the others, which start later and end at other lengths."""
    got: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    while engine.has_unfinished_requests() or pending:
        if pending:
            i, p = pending.pop(0)
            engine.add_request(p, params[i] if isinstance(params, list) else params, request_id=f"r{i}")
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.token_ids
    return [got[f"r{i}"] for i in range(len(prompts))]


def test_batch_invariant_bf16_tokens_equal_each_prompt_decoded_alone(default_model_dir):
    """bf16 on the CPU with batch_invariant: each prompt's greedy tokens, decoded beside
    others (plain steps of 1-5 rows, and with drafts verify steps of up to 25), equal its
    tokens decoded alone, and so do they when the prompts are given all at once (each
    prefilled in a step of its own). Without the mode, bf16 rows of a multi-row step round
    apart from a one-row step's, and a greedy path turns at the first near-tie."""
    prompts = ["1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3,",
               "a b c d e f g h a b c d e f g h a b c", "The capital of France is",
               "red green blue red green blue red green", "Once upon a time, in a land far away,"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 24, 40, 32, 16)]
    config = dict(model=default_model_dir, device="cpu", dtype="bfloat16", num_kv_blocks=1024, batch_invariant=True)
    alone = LLMEngine(EngineConfig(**config))
    expected = [alone.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
    assert _arrivals(LLMEngine(EngineConfig(**config)), prompts, params) == expected
    spec = spec_engine(**config)
    assert _arrivals(spec, prompts, params) == expected
    assert spec.draft_policy.stats.num_accepted_tokens > 20, spec.draft_policy.stats
    # All at once: each prompt is prefilled in a step of its own, as it would be alone.
    together = LLMEngine(EngineConfig(**config))
    assert [o.token_ids for o in together.generate(prompts, params)] == expected
    assert together.stats.prefill_steps == len(prompts)


def test_batch_invariant_refuses_what_it_cannot_honour(default_model_dir, tmp_path):
    """Mixed steps, tensor parallelism, experts and latent attention, the torch attention
    backend on a GPU, and transformers' own classes are refused by name."""
    from types import SimpleNamespace

    from agent_infer.arguments import engine_config_from_args
    from agent_infer.attention.dense_torch import DenseTorchBackend
    from agent_infer.cli import build_parser
    from tests.deepseek_models import write_deepseek_model

    for extra, words in (({"mixed_batches": True}, "mixed_batches off"), ({"tensor_parallel_size": 2}, "one device")):
        with pytest.raises(ConfigError, match=words):
            EngineConfig(model=default_model_dir, batch_invariant=True, **extra)
    for command in ("generate", "serve"):  # the flag, and its refusal, from the command line
        args = [command, "--model", default_model_dir, "--batch-invariant"]
        args += ["--prompt", "x"] if command == "generate" else []
        assert engine_config_from_args(build_parser().parse_args(args)).batch_invariant
        with pytest.raises(ConfigError, match="mixed_batches off"):
            engine_config_from_args(build_parser().parse_args(args + ["--mixed-batches"]))
    path = write_deepseek_model("v2_lite", str(tmp_path / "v2"))
    with pytest.raises(ConfigError, match="batch_invariant covers dense models; .* (routed experts|latent attention)"):
        LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", num_kv_blocks=64, batch_invariant=True))
    layer = SimpleNamespace(cache_layout=None, num_heads=4)
    with pytest.raises(ConfigError, match="batch_invariant on a GPU needs the triton attention backend"):
        DenseTorchBackend(layer, 8, torch.device("cuda"), batch_invariant=True)
    DenseTorchBackend(layer, 8, torch.device("cpu"), batch_invariant=True)  # the CPU path attends row by row
    with pytest.raises(ConfigError, match="batch_invariant covers the native families"):
        LLMEngine(EngineConfig(model=default_model_dir, device="cpu", dtype="float32", num_kv_blocks=64,
                               model_impl="transformers", batch_invariant=True))


# ---- distribution ------------------------------------------------------------------------------


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.1 % point of chi-square with `df` degrees of freedom (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_rejection_sampling_keeps_the_target_distribution(tmp_path):
    """Three tokens from a tiny-vocabulary model at T = 0.9: the first from the prefill,
    the next two from a verify row whose drafts are fixed. Their joint frequencies over
    4,000 seeds match p(t0) p(t1 | t0) p(t2 | t0 t1), computed with transformers."""
    import transformers

    from tests.tiny_models import _save_random

    vocab = 6
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                      initializer_range=0.3, bos_token_id=0, eos_token_id=vocab - 1)
    path = _save_random("LlamaForCausalLM", config, str(tmp_path / "v6"), seed=3)
    prompt, temperature, n = [0, 3, 1], 0.9, 4000

    hf = transformers.LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        p0 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1] / temperature, -1)
        seqs = torch.tensor([prompt + [a, b] for a in range(vocab) for b in range(vocab)])
        logits = hf(seqs).logits / temperature
    p1 = torch.softmax(logits[::vocab, -2], -1)  # [t0, t1]
    p2 = torch.softmax(logits[:, -1], -1).reshape(vocab, vocab, vocab)  # [t0, t1, t2]
    joint = p0[:, None, None] * p1[:, :, None] * p2
    # Drafts that are right often enough to exercise both acceptance and rejection.
    d1 = int(p1[int(p0.argmax())].argmax())
    d2 = int(p2[int(p0.argmax()), d1].argmax())

    engine = LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", num_kv_blocks=2048, max_num_seqs=256,
                                    speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                        "prompt_lookup_max": 1, "prompt_lookup_min": 1}))
    engine.draft_policy.batch_drafts = lambda num_decoding: True

    class Fixed:
        def propose(self, request_id, prompt_ids, tokens_at, total, k, known=None):
            return [d1, d2][:k]

        def after_step(self, batch, row_drafts):
            pass

        def forget(self, request_id):
            pass

    engine.drafter = Fixed()
    params = [SamplingParams(temperature=temperature, seed=1000 + i, max_tokens=3, ignore_eos=True) for i in range(n)]
    outs = engine.generate([prompt] * n, params)
    stats = engine.draft_policy.stats
    assert stats.num_drafts == n and 0.2 * n < stats.accepted_per_pos[0] < 0.95 * n, stats
    counts = Counter(tuple(o.token_ids) for o in outs)
    assert sum(counts.values()) == n and all(len(k) == 3 for k in counts)
    expected = (joint * n).flatten().tolist()
    observed = [counts.get((a, b, c), 0) for a in range(vocab) for b in range(vocab) for c in range(vocab)]
    # Cells expected fewer than 5 times are pooled (the chi-square approximation needs it).
    big = [i for i, e in enumerate(expected) if e >= 5]
    e = [expected[i] for i in big] + [sum(x for i, x in enumerate(expected) if i not in set(big))]
    o = [observed[i] for i in big] + [sum(x for i, x in enumerate(observed) if i not in set(big))]
    chi2 = sum((oi - ei) ** 2 / ei for oi, ei in zip(o, e) if ei > 0)
    assert len(big) >= 8, "the target is too peaked to test"
    assert chi2 < _chi2_critical(len(e) - 1), (chi2, len(e))


# ---- constraints, metrics, policy --------------------------------------------------------------


def test_structured_outputs_with_drafts_match_their_schema(smol_engine, spec_smol):
    """Drafts are checked against the grammar and each verify row's mask follows the
    drafts before it: the outputs match their schema and equal plain decoding's."""
    engine = spec_smol
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"type": "string", "maxLength": 20}},
              "required": ["city", "country"], "additionalProperties": False}
    prompts = [chat_ids(engine, 'Reply with this JSON exactly: {"city": "Paris", "country": "France"}'),
               chat_ids(engine, "Repeat: 555-1234 555-1234 555-1234"),
               chat_ids(engine, 'Repeat the JSON list [1, 2, 3, 1, 2, 3, 1, 2, 3] twice.')]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=SO(json=schema)),
              SamplingParams(temperature=0, max_tokens=30, structured_outputs=SO(regex=r"(\d{3}-\d{4} ){2}\d{3}-\d{4}")),
              SamplingParams(temperature=0, max_tokens=40, structured_outputs=SO(
                  json={"type": "array", "items": {"type": "integer"}, "maxItems": 12}))]
    before = engine.draft_policy.stats.num_accepted_tokens
    masked0 = engine.constraints.stats.masked_rows
    spec = engine.generate(prompts, params)
    plain = smol_engine.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    obj = json.loads(spec[0].text)
    assert set(obj) == {"city", "country"}
    assert re.fullmatch(r"(\d{3}-\d{4} ){2}\d{3}-\d{4}", spec[1].text)
    assert all(isinstance(x, int) for x in json.loads(spec[2].text))
    assert engine.draft_policy.stats.num_accepted_tokens - before > 5
    assert engine.constraints.stats.masked_rows - masked0 > sum(len(o.token_ids) for o in spec) / 2


def test_drafting_stops_where_it_costs():
    policy = DraftPolicy()
    # One sequence whose drafts keep failing pauses, longer each time, never past the cap.
    # Its length is the clock: one token a step while it does not draft.
    pauses, paused = [], 0
    for length in range(100, 500):
        if policy.may_draft("a", length):
            if paused:
                pauses.append(paused)
                paused = 0
            policy.on_verified("a", 4, 0, length + 1)
        else:
            paused += 1
    assert pauses[:4] == [2, 4, 8, 16] and max(pauses) == MAX_PAUSE_STEPS
    assert not policy.may_draft("a", 500)
    policy.on_verified("a", 4, 2, 503)  # an acceptance resets it
    assert policy.may_draft("a", 503) and policy.may_draft("b", 1)

    def run(batch: int, plain_s: float, verify_s: float, tokens_per_row: float, steps: int = 3000) -> int:
        drafted = 0
        for _ in range(steps):
            verify = policy.batch_drafts(batch)
            drafted += verify
            policy.record_step(batch, verify_s if verify else plain_s, verify,
                               round(batch * tokens_per_row) if verify else batch)
        return drafted

    # Batch 1: a verify step costs 1.1 plain ones and yields 2.5 tokens: drafting stays on,
    # even when one of the first verify steps stalls (a compilation: 2,000 plain steps).
    policy.record_step(1, 1.0, False, 1)
    policy.record_step(1, 2000.0, True, 3)
    assert run(1, 1.0, 1.1, 2.5) > 2900
    # Batch 256: a verify step costs 3 plain ones for 1.4 tokens a row: off after the first
    # ones, then probes whose extra cost stays near 1 % of the time.
    drafted = run(256, 1.0, 3.0, 1.4)
    assert drafted <= 20 and drafted * (3.0 - 1.0) / 3000 < 0.015
    # Drafting steps that found nothing (1 token a row, the overlap lost): off as well.
    drafted = run(4, 1.0, 1.05, 1.0)
    assert drafted < 3000 / 10 and drafted * (1.05 - 1.0) / 3000 < 0.01
    assert policy.batch_drafts(1)  # each batch size keeps its own measurements
    # A cheap probe that finds repetition again turns drafting back on at once.
    assert run(4, 1.0, 1.05, 3.0, steps=100) > 60
    assert DraftPolicy(disable_by_batch_size=8).batch_drafts(8) is False


def test_plain_probes_only_where_no_plain_step_came_on_its_own():
    """While drafting pays, the batch rule refreshes its plain timing with a plain step only
    where none came on its own (a pause, a lookup that found nothing) for PLAIN_PROBE_EVERY
    steps: a forced plain step costs what a verify step would have given."""
    from agent_infer.speculative.policy import PLAIN_PROBE_EVERY

    def forced(natural_every: int, steps: int = 1000) -> int:
        policy, count = DraftPolicy(), 0
        policy.record_step(1, 1.0, False, 1)
        for i in range(1, steps + 1):
            if i % natural_every == 0:  # a sequence paused: the step runs plain whatever the rule says
                policy.batch_drafts(1)
                policy.record_step(1, 1.0, False, 1)
                continue
            if policy.batch_drafts(1):
                policy.record_step(1, 1.1, True, 3)
            else:
                count += 1
                policy.record_step(1, 1.0, False, 1)
        return count

    assert forced(10**9) == pytest.approx(1000 / PLAIN_PROBE_EVERY, abs=2)  # none come on their own
    assert forced(PLAIN_PROBE_EVERY * 3 // 4 + 1) == 0  # one every 49 steps: no forced one


@pytest.mark.parametrize("chain", [True, False])
def test_the_policy_times_each_step_with_its_own_yield(default_model_dir, chain):
    """The batch rule sees each decode step's own time and tokens, whichever call read it
    back: with chained verify steps a verify step is read back by the next call, and an
    isolated drafting step (a probe while drafting is off) must still be credited with
    what its drafts gave, not the plain step after it."""
    spec = replace(SpeculativeConfig.parse(NGRAM), chain_verify_steps=chain)
    engine = LLMEngine(EngineConfig(model=default_model_dir, device="cpu", dtype="float32", num_kv_blocks=1024,
                                    speculative_config=spec))
    calls = iter(range(10**6))
    engine.draft_policy.batch_drafts = lambda num_decoding: next(calls) % 3 == 0  # isolated drafting steps
    records = []
    record = engine.draft_policy.record_step
    engine.draft_policy.record_step = lambda n, s, drafting, tokens: records.append((n, s, drafting, tokens)) or \
        record(n, s, drafting, tokens)
    prompts = ["1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3,",
               "a b c d e f g h a b c d e f g h a b c"]
    engine.generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    accepted = engine.draft_policy.stats.num_accepted_tokens
    assert accepted > 10, accepted
    assert all(tokens == n for n, _, drafting, tokens in records if not drafting), "a plain step credited with drafts"
    assert sum(tokens - n for n, _, drafting, tokens in records if drafting) == accepted
    assert all(s > 0 for _, s, _, _ in records)
    decode_steps = engine.stats.decode_steps
    assert len(records) >= decode_steps - 1, (len(records), decode_steps)  # the first after the prefill may be left out


def test_the_batch_rule_times_verify_steps_and_empty_lookups_as_plain_steps(default_model_dir, smol_engine):
    """The batch rule compares what a verify step costs and yields with a plain step: a
    step whose lookups found nothing (and kept its overlap with the step in flight) runs
    as a plain step and is timed as one; every verify step is timed as drafting, with its
    own yield, those behind a wrong guess of the row in flight included."""
    prompts = ["1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2,",
               chat_ids(smol_engine, "Copy this line: def add(a, b): return a + b")]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = smol_engine.generate(prompts, params)
    engine = spec_engine(default_model_dir)
    engine.drafter = MissAndGuess(plain)
    engine.draft_policy.may_draft = lambda request_id, length: True  # no pause after misses
    records, record = [], engine.draft_policy.record_step
    engine.draft_policy.record_step = lambda n, s, drafting, tokens: records.append((drafting, tokens - n)) or \
        record(n, s, drafting, tokens)
    timed, time_for_policy = [], engine._time_for_policy

    def log_timing(batch, now):
        before = len(records)
        time_for_policy(batch, now)
        timed.append((batch.num_prompt_rows, batch.num_draft_tokens, sum(batch.accepted), records[before:]))

    engine._time_for_policy = log_timing
    got = [engine.generate([p], params)[0] for p in prompts]
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    decode = [t for t in timed if t[0] == 0][1:]  # the first read-back has no step before it to time from
    empty = [rec for _, drafts, _, rec in decode if drafts == 0]
    verify = [(rec, acc) for _, drafts, acc, rec in decode if drafts]
    assert len(empty) >= 3 and len(verify) >= 5, (len(empty), len(verify))
    assert sum(acc == 0 for _, acc in verify) >= 2, verify  # rejected all (a wrong guess among them)
    assert all(rec == [(False, 0)] for rec in empty), empty
    assert all(rec == [(True, acc)] for rec, acc in verify), verify


def _copy_task(seed: int, copy_len: int, novel_len: int) -> list[tuple[list[int], list[int]]]:
    """Prompts of random tokens, and outputs that copy `copy_len` of them back, then write
    `novel_len` new tokens from a handful that recur (so that lookups find drafts there
    and they fail), and so on: an agent quoting a file between its own remarks."""
    import random

    rnd = random.Random(seed)
    texts = []
    for _ in range(4):
        prompt = [rnd.randrange(1000) for _ in range(600)]
        out: list[int] = []
        while len(out) < 400:
            start = len(out) // (copy_len + novel_len) * copy_len
            out += prompt[start:start + copy_len] + [1000 + rnd.randrange(5) for _ in range(novel_len)]
        texts.append((prompt, out[:400]))
    return texts


@functools.cache
def _spec_replay():
    """benchmarks/spec_replay.py as a module (loaded once)."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "spec_replay.py")
    spec = importlib.util.spec_from_file_location("spec_replay", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _replay_speedup(texts, verify_ms: float, batch_rule: bool) -> float:
    """Tokens per time against plain decoding's, batch 1 replayed through the policy
    (benchmarks/spec_replay.py: prompt lookup, rows chained behind verify rows in flight,
    fixed step costs against a 0.82 ms plain step)."""
    r = _spec_replay().Replay(8, 2, 4, (0.82, verify_ms, 0.015), batch_rule)
    for i, (prompt, out) in enumerate(texts):
        r.run(str(i), prompt + out, len(prompt) + 1)
    return r.tokens * 0.82 / r.time


@pytest.mark.parametrize("copy_len,novel_len", [(80, 40), (30, 30)])
def test_the_batch_rule_keeps_drafting_where_it_pays(copy_len, novel_len):
    """On text that copies runs between stretches of its own, at what a verify step costs
    on a GPU at batch 1 (1.4x a plain step), the batch rule costs under 2 % against
    drafting at every step the pause rule allows."""
    copying = _copy_task(0, copy_len, novel_len)
    with_rule, without = _replay_speedup(copying, 1.15, True), _replay_speedup(copying, 1.15, False)
    assert without > 1.4 and with_rule > 0.98 * without, (with_rule, without)


def test_the_batch_rule_turns_drafting_back_on_where_the_text_repeats_again():
    """At a verify step 3.7x a plain one, drafting pays on text that copies 120-token runs
    between 20 tokens of its own, but the stretches of its own turn the rule off; its
    probes (a drafting step every few hundred) must then bring drafting back: a probe's
    yield weighs more than a verify step's in the rule's average. Within 2 % of drafting at
    every step the pause rule allows (at a probe's weight equal to a verify step's, 29 %
    under it)."""
    copying = _copy_task(0, 120, 20)
    with_rule, without = _replay_speedup(copying, 3.0, True), _replay_speedup(copying, 3.0, False)
    assert without > 1.5 and with_rule > 0.98 * without, (with_rule, without)


@pytest.mark.parametrize("verify_ms", [1.6, 3.0])
def test_the_batch_rule_stops_drafting_where_it_does_not_pay(verify_ms):
    """On text whose lookups keep finding drafts that fail (a small alphabet, no
    repetition), the batch rule keeps the steps within 2 % of plain decoding, where
    drafting at every step the pause rule allows loses more."""
    import random

    rnd = random.Random(2)
    dry = [([rnd.randrange(6) for _ in range(300)], [rnd.randrange(6) for _ in range(300)]) for _ in range(4)]
    with_rule, without = _replay_speedup(dry, verify_ms, True), _replay_speedup(dry, verify_ms, False)
    assert with_rule > 0.98 and with_rule > without + 0.02, (with_rule, without)
