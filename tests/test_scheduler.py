"""Scheduler: prefill first, token and sequence budgets, chunked prefill, the banker's
admission rule (no deadlock without preemption), recompute preemption, rejection."""

from __future__ import annotations

import random

from agent_infer.engine.block_manager import BlockManager
from agent_infer.engine.scheduler import Scheduler, SchedulerConfig
from agent_infer.engine.structs import FinishReason, Sequence, SequenceStatus
from agent_infer.sampling_params import SamplingParams

BS = 4
EOS = 0


def make(num_blocks=64, max_seqs=8, max_tokens_budget=64, max_len=128, mode="none", prefix=True):
    bm = BlockManager(num_blocks, BS, prefix)
    return Scheduler(SchedulerConfig(max_seqs, max_tokens_budget, max_len, mode), bm, {EOS})


def seq(rid: str, prompt_len: int, max_tokens: int = 8, first: int = 1) -> Sequence:
    return Sequence(rid, list(range(first, first + prompt_len)), SamplingParams(max_tokens=max_tokens), max_tokens, 0)


def run_step(s: Scheduler, token: int = 7):
    batch = s.schedule()
    if batch is None:
        return None
    return batch, s.postprocess(batch, [token] * sum(batch.samples))


def run_to_end(s: Scheduler, max_steps: int = 10_000) -> int:
    steps = 0
    while s.has_unfinished():
        assert run_step(s) is not None, "scheduler stalled with unfinished requests"
        steps += 1
        assert steps < max_steps
    return steps


def test_prefill_batches_several_prompts_then_decodes_all():
    s = make()
    a, b = seq("a", 5), seq("b", 9, first=100)
    s.add(a), s.add(b)
    batch = s.schedule()
    assert batch.is_prefill and batch.seqs == [a, b] and batch.num_new_tokens == [5, 9]
    s.postprocess(batch, [7, 7])
    batch = s.schedule()
    assert not batch.is_prefill and batch.seqs == [a, b] and batch.num_new_tokens == [1, 1]


def test_one_prompt_per_prefill_step_chunks_as_alone_then_decodes_all():
    """The batch-invariant mode's prefill: one prompt a step, a long one cut at the token
    budget exactly as it would be alone; then every sequence decodes in one step."""
    bm = BlockManager(64, BS, True)
    s = Scheduler(SchedulerConfig(8, 16, 128, one_prompt_per_prefill=True), bm, {EOS})
    a, b, c = seq("a", 5), seq("b", 20, first=100), seq("c", 3, first=200)
    for x in (a, b, c):
        s.add(x)
    steps = [run_step(s)[0] for _ in range(4)]
    assert [(batch.seqs, batch.num_new_tokens) for batch in steps] == [([a], [5]), ([b], [16]), ([b], [4]), ([c], [3])]
    assert all(batch.is_prefill for batch in steps)
    batch = s.schedule()
    assert not batch.is_prefill and batch.seqs == [a, b, c]


def test_prefill_comes_first_when_a_request_arrives():
    s = make()
    a = seq("a", 5)
    s.add(a)
    run_step(s)
    b = seq("b", 6, first=50)
    s.add(b)
    batch = s.schedule()
    assert batch.is_prefill and batch.seqs == [b]


def test_token_budget_and_max_num_seqs():
    s = make(max_seqs=2, max_tokens_budget=20)
    seqs = [seq(str(i), 8, first=10 * i + 1) for i in range(4)]
    for x in seqs:
        s.add(x)
    batch = s.schedule()
    assert batch.seqs == seqs[:2]  # max_num_seqs
    s.postprocess(batch, [7, 7])
    assert len(s.waiting) == 2
    s2 = make(max_seqs=8, max_tokens_budget=20)
    for x in [seq(str(i), 8, first=10 * i + 1) for i in range(4)]:
        s2.add(x)
    batch = s2.schedule()
    assert batch.num_tokens <= 20 and len(batch.seqs) == 2  # 8 + 8; a third would be cut


def test_long_prompt_is_chunked_and_samples_only_at_the_end():
    s = make(max_tokens_budget=16, max_len=128)
    a = seq("a", 40)
    s.add(a)
    chunks = []
    while a.status != SequenceStatus.RUNNING_DECODE:
        batch = s.schedule()
        assert batch.is_prefill
        chunks.append((batch.num_new_tokens[0], batch.samples[0]))
        s.postprocess(batch, [7] * sum(batch.samples))
    assert chunks == [(16, False), (16, False), (8, True)]
    assert a.output_token_ids == [7]


def test_overlong_prompt_is_rejected_not_queued():
    s = make(max_len=32)
    bad = seq("bad", 32)
    assert not s.add(bad)
    assert bad.status == SequenceStatus.REJECTED and "32" in bad.error
    assert not s.has_unfinished()


def test_request_larger_than_the_pool_is_rejected():
    s = make(num_blocks=4, max_len=128)
    big = seq("big", 10, max_tokens=20)  # needs 29 tokens = 8 blocks
    assert not s.add(big)
    assert "KV blocks" in big.error


def test_stop_conditions():
    s = make()
    a, b = seq("a", 3, max_tokens=2), seq("b", 3, max_tokens=5, first=20)
    s.add(a), s.add(b)
    batch = s.schedule()
    s.postprocess(batch, [5, EOS])
    assert b.finish_reason == FinishReason.STOP
    batch = s.schedule()
    s.postprocess(batch, [6])
    assert a.finish_reason == FinishReason.LENGTH and a.output_token_ids == [5, 6]
    assert s.bm.get_num_free_blocks() == s.bm.num_blocks


def test_admission_keeps_a_safe_order_and_never_deadlocks():
    # 10 blocks of 4 tokens. Each request: a 12-token prompt (3 blocks) that may grow to
    # 12 + 21 - 1 = 32 tokens (8 blocks). With both admitted, 4 blocks would be free while
    # each could still need 5: neither could be sure to finish. So the second waits.
    s = make(num_blocks=10, max_len=64)
    a, b = seq("a", 12, max_tokens=21), seq("b", 12, max_tokens=21, first=50)
    s.add(a), s.add(b)
    batch = s.schedule()
    assert batch.seqs == [a], "admitting b could deadlock"
    s.postprocess(batch, [7])
    run_to_end(s)
    assert a.num_output_tokens == 21 and b.num_output_tokens == 21
    assert s.bm.get_num_free_blocks() == 10


def test_safe_states_admit_what_can_finish_in_turn():
    # 12 blocks; each request holds 1 and may need 4 more. All three fit the rule: one can
    # finish with the 9 free blocks, and each finisher returns 5.
    s = make(num_blocks=12, max_len=64)
    seqs = [seq(str(i), 4, max_tokens=16, first=10 * i + 1) for i in range(3)]
    for x in seqs:
        s.add(x)
    batch = s.schedule()
    assert len(batch.seqs) == 3
    s.postprocess(batch, [7, 7, 7])
    run_to_end(s)
    assert all(x.finish_reason == FinishReason.LENGTH and x.num_output_tokens == 16 for x in seqs)
    assert s.bm.get_num_free_blocks() == 12


def test_random_workloads_always_finish_without_preemption():
    rng = random.Random(0)
    for trial in range(30):
        s = make(num_blocks=rng.randint(8, 24), max_seqs=rng.randint(1, 6), max_tokens_budget=rng.randint(8, 40), max_len=64)
        seqs = []
        for i in range(rng.randint(1, 12)):
            x = seq(f"{trial}-{i}", rng.randint(1, 20), max_tokens=rng.randint(1, 20), first=rng.randint(1, 5))
            if s.add(x):
                seqs.append(x)
        run_to_end(s)
        assert all(x.status == SequenceStatus.FINISHED for x in seqs)
        assert s.bm.get_num_free_blocks() == s.bm.num_blocks
        assert s.num_preemptions == 0


def test_recompute_preemption_keeps_tokens_and_finishes():
    s = make(num_blocks=12, max_len=64, mode="recompute")
    seqs = [seq(str(i), 4, max_tokens=16, first=10 * i + 1) for i in range(3)]
    for x in seqs:
        s.add(x)
    batch = s.schedule()
    assert len(batch.seqs) == 3  # optimistic admission
    s.postprocess(batch, [7, 7, 7])
    run_to_end(s)
    assert s.num_preemptions > 0
    assert all(x.num_output_tokens == 16 for x in seqs)
    assert s.bm.get_num_free_blocks() == 12


def test_abort_frees_blocks_of_running_and_waiting():
    s = make(max_seqs=1)
    a, b = seq("a", 6), seq("b", 6, first=50)
    s.add(a), s.add(b)
    run_step(s)
    assert a.block_table and b.status == SequenceStatus.WAITING
    s.abort(a)
    s.abort(b)
    assert a.finish_reason == FinishReason.ABORT and b.finish_reason == FinishReason.ABORT
    assert not s.has_unfinished() and s.bm.get_num_free_blocks() == s.bm.num_blocks
