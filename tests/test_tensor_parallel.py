"""Tensor parallelism on CPU (gloo): TP = 2 and 3 with async scheduling give the same
tokens (greedy and seeded sampling) and the same fp32 logprobs as a synchronous TP = 1;
bad sizes fail before any process starts; a dead worker, or a failed step on rank 0,
makes the engine fail fast and leaves no process behind; shutdown ends the group's
threads; torchrun launches work too."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist

from agent_infer.config import ConfigError, EngineConfig
from agent_infer.distributed.control import ControlClient, ControlServer, WorkerError
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.sampling_params import SamplingParams, StructuredOutputsParams
from tests.drafters import Replay

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [300, 12, 13], list(range(20, 61))]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=20)


def make_engine(path: str, tp: int, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 128)
    return LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", tensor_parallel_size=tp, **kw))


def run(path: str, tp: int, prompts=PROMPTS, params=PARAMS, **kw):
    """TP > 1 runs with async scheduling (the default); the TP = 1 reference runs
    synchronously, so every comparison also checks async TP against plain stepping."""
    if tp == 1:
        kw.setdefault("async_scheduling", False)
    eng = make_engine(path, tp, **kw)
    try:
        if tp > 1:
            assert eng.async_scheduling
        return eng.generate(prompts, params)
    finally:
        eng.shutdown()


class StepLog:
    """Records the steps rank 0 sends to its workers."""

    def __init__(self, eng: LLMEngine):
        self.steps = []
        send = eng.workers.send_step

        def record(step):
            self.steps.append(step)
            send(step)

        eng.workers.send_step = record

    @property
    def placeholder_steps(self) -> int:
        """Decode steps whose input ids were (partly) still on the device."""
        return sum(1 for s in self.steps if s.prev_index is not None and (s.prev_index >= 0).any())

    @property
    def silent_steps(self) -> int:
        """Steps that sampled nothing (prompt chunks): no token broadcast on any rank."""
        return sum(1 for s in self.steps if len(s.sample_indices) == 0)


def assert_same(a, b, tol=1e-3):
    # fp32 sums in another order (sharded GEMMs + all-reduce): ~1e-4 on logprobs of
    # these deliberately large-logit random models; a sharding bug moves them by >0.1.
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        for lx, ly in zip(x.logprobs, y.logprobs):
            assert abs(lx.logprob - ly.logprob) < tol
            top_x, top_y = dict(lx.top), dict(ly.top)
            shared = set(top_x) & set(top_y)
            assert len(shared) >= 18  # near-equal values may swap at the edge of the top 20
            assert all(abs(top_x[t] - top_y[t]) < tol for t in shared)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_untied", "qwen2", "llama"])
def test_tp2_equals_tp1(name, tiny_model_dirs):
    # qwen3 / qwen3_untied have one KV head: with TP = 2 it is replicated on both ranks.
    # TP = 2 runs async (placeholder inputs from rank 0's token broadcast), TP = 1 not.
    path = tiny_model_dirs[name]
    assert_same(run(path, 2), run(path, 1))
    assert not dist.is_initialized(), "the rank-0 process must leave no process group behind"


def test_single_process_never_creates_a_group(tiny_model_dirs):
    run(tiny_model_dirs["llama"], 1)
    assert not dist.is_initialized()


def test_default_model_tp3_same_text_and_tp2_is_refused(default_model_dir):
    """Also with a grammar-constrained request in the batch: only rank 0 samples, so
    only rank 0 builds masks, and the workers follow its tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=20)
    regex = SamplingParams(temperature=0.0, max_tokens=16,
                           structured_outputs=StructuredOutputsParams(regex=r"\d{3}-\d{4}"))
    prompts = ["The capital of France is", "Water boils at", "Call me at"]
    one = run(default_model_dir, 1, prompts, [params, params, regex])
    three = run(default_model_dir, 3, prompts, [params, params, regex])
    assert [o.text for o in three] == [o.text for o in one]
    assert re.fullmatch(r"\d{3}-\d{4}", three[2].text) and three[2].finish_reason == "stop"
    assert three[2].token_ids == one[2].token_ids
    assert_same(three[:2], one[:2])
    with pytest.raises(ConfigError, match=r"9 attention heads, 3 KV heads.*\[1, 3, 9\]"):
        LLMEngine(EngineConfig(model=default_model_dir, device="cpu", tensor_parallel_size=2))


def assert_same_outputs(a, b, tol=1e-3):
    """Token for token (greedy and seeded sampling), same finish, logprobs within fp32 noise."""
    for x, y in zip(a, b, strict=True):
        assert (x.token_ids, x.finish_reason, x.stop_reason) == (y.token_ids, y.finish_reason, y.stop_reason)
        assert (x.logprobs is None) == (y.logprobs is None)
        for lx, ly in zip(x.logprobs or [], y.logprobs or [], strict=True):
            assert lx.token_id == ly.token_id and abs(lx.logprob - ly.logprob) < tol


MIXED_PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [300, 12, 13], list(range(20, 61)), [7, 7, 7, 1], [450, 2, 99, 100, 101]]


def mixed_params(stop_token: int | None = None) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3,
                       stop_token_ids=[stop_token] if stop_token is not None else []),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=14, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=1.0, seed=8, max_tokens=3, ignore_eos=True),  # finishes early
        SamplingParams(temperature=0.7, top_k=20, seed=9, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=1.2, min_p=0.05, seed=10, max_tokens=1, ignore_eos=True),  # prefill only
    ]


def test_async_tp2_with_constrained_rows_equals_sync_tp1(tiny_model_dirs):
    """allowed_token_ids, logit_bias and min_tokens (masks built on rank 0 between the
    forward pass and sampling) next to unconstrained rows, async TP = 2 against sync TP = 1."""
    path = tiny_model_dirs["qwen3"]
    params = mixed_params()[:3] + [
        SamplingParams(temperature=1.0, seed=3, max_tokens=9, allowed_token_ids=[5, 17, 300, 301]),
        SamplingParams(temperature=0.0, max_tokens=6, logit_bias={42: 100.0}),
    ]
    params[0] = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12, logprobs=3)
    one, two = run(path, 1, MIXED_PROMPTS, params), run(path, 2, MIXED_PROMPTS, params)
    assert_same_outputs(two, one)
    assert set(two[3].token_ids) <= {5, 17, 300, 301} and two[4].token_ids == [42] * 6
    assert len(two[0].token_ids) == 12


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_async_tp2_equals_sync_tp1_sampled_mixed_and_chunked(name, tiny_model_dirs):
    """Async TP = 2 against synchronous TP = 1, token for token. Decode inputs of TP = 2 are
    placeholders resolved on the device from rank 0's broadcast tokens: a worker with a
    wrong token would write other K/V for it into its cache shard, and every later
    all-reduced hidden state (hence token and logprob) would move. A small token budget
    cuts the 41-token prompt into chunks that sample nothing (no broadcast on any rank);
    requests end early by length and — known only after a step was already launched
    for it — by a stop token."""
    path = tiny_model_dirs[name]
    sync1 = make_engine(path, 1, async_scheduling=False, max_num_batched_tokens=16)
    two = make_engine(path, 2, max_num_batched_tokens=16)
    try:
        assert two.async_scheduling and not sync1.async_scheduling
        log = StepLog(two)
        expected = sync1.generate(MIXED_PROMPTS, mixed_params())
        assert_same_outputs(two.generate(MIXED_PROMPTS, mixed_params()), expected)
        assert log.placeholder_steps >= 10 and log.silent_steps >= 2
        # Stop request 0 at a token it produces mid-way: the stop is seen one step late.
        stop = expected[0].token_ids[6]
        expected = sync1.generate(MIXED_PROMPTS, mixed_params(stop))
        assert expected[0].finish_reason == "stop" and len(expected[0].token_ids) <= 7
        assert_same_outputs(two.generate(MIXED_PROMPTS, mixed_params(stop)), expected)
        assert two.block_manager.num_used_blocks == 0
    finally:
        two.shutdown()
        sync1.shutdown()


def test_async_tp2_mixed_batches_equal_sync_tp1(tiny_model_dirs):
    """Mixed steps under TP = 2: each worker builds the same mixed step from the HostStep
    (decode rows first, their inputs placeholders resolved from rank 0's broadcast, the
    41-token prompt's chunks beside them) and the tokens equal synchronous TP = 1 with
    prefill-only steps."""
    path = tiny_model_dirs["qwen3"]
    sync1 = make_engine(path, 1, async_scheduling=False, max_num_batched_tokens=16)
    two = make_engine(path, 2, max_num_batched_tokens=16, mixed_batches=True)
    try:
        mixed: list[int] = []
        schedule = two.scheduler.schedule

        def recording_schedule():
            batch = schedule()
            if batch is not None and batch.num_decode:
                mixed.append(batch.num_decode)
            return batch

        two.scheduler.schedule = recording_schedule
        expected = sync1.generate(MIXED_PROMPTS, mixed_params())
        assert_same_outputs(two.generate(MIXED_PROMPTS, mixed_params()), expected)
        assert mixed, "no step mixed decodes with prefill"
        assert two.block_manager.num_used_blocks == 0
    finally:
        two.shutdown()
        sync1.shutdown()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_killed_worker_fails_fast_and_leaves_no_orphans(tiny_model_dirs, async_scheduling):
    eng = make_engine(tiny_model_dirs["qwen3_untied"], 2, async_scheduling=async_scheduling)
    assert eng.async_scheduling == async_scheduling
    procs = list(eng.workers.procs)
    control = eng.workers.control
    record = control._fail

    def slow_record(message):  # a busy host: the reader thread records the death late,
        time.sleep(0.3)  # after gloo has already failed the collective on rank 0
        record(message)

    control._fail = slow_record
    eng.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
    eng.add_request([8, 9], SamplingParams(temperature=0.8, seed=3, max_tokens=400, ignore_eos=True))
    for _ in range(4):
        eng.step()
    assert (eng._inflight is not None) == async_scheduling  # killed with a decode step in flight
    os.kill(procs[0].pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="worker 1"):
        while eng.has_unfinished_requests():
            eng.step()
    assert time.monotonic() - t0 < 15  # not a collective timeout (60 s)
    time.sleep(0.5)
    assert all(p.poll() is not None for p in procs), "a worker outlived the engine"
    assert eng.workers is None


def test_rank0_failing_mid_step_stops_the_blocked_workers(tiny_model_dirs):
    """Rank 0 raises after the forward pass, before its token broadcast: the worker is left
    waiting in that broadcast. The engine must raise at once and kill it, not wait."""
    eng = make_engine(tiny_model_dirs["llama"], 2)
    procs = list(eng.workers.procs)
    eng.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
    for _ in range(3):
        eng.step()

    def broken_sampler(logits, batch):
        raise RuntimeError("sampler exploded")

    eng.runner.sampler = broken_sampler
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="sampler exploded"):
        eng.step()
    assert time.monotonic() - t0 < 8
    assert eng.workers is None
    assert _wait_for(lambda: all(p.poll() is not None for p in procs)), "a blocked worker outlived the engine"


def _control_pair():
    server = ControlServer("127.0.0.1", 1)
    holder = {}
    t = threading.Thread(target=lambda: holder.setdefault("c", ControlClient(server.address, 1)))
    t.start()
    server.accept_all(timeout_s=10)
    t.join()
    return server, holder["c"]


def _wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


def test_control_channel_reports_a_worker_error_and_acks():
    server, client = _control_pair()
    fatal = []
    server.start_watch(on_fatal=fatal.append, grace_s=60)
    server.broadcast(("step", 1, "payload"))
    assert client.recv() == ("step", 1, "payload")
    client.send(("ack", 1))
    assert _wait_for(lambda: server.acked.get(1) == 1)
    client.send(("error", "ValueError: boom"))
    assert _wait_for(lambda: server.failure is not None)
    with pytest.raises(WorkerError, match="worker 1 failed: ValueError: boom"):
        server.check()
    server.close()
    client.close()
    assert fatal == []  # the engine noticed in time: no last-resort exit


def test_watchdog_fires_when_the_engine_does_not_notice():
    server, client = _control_pair()
    fatal = []
    server.start_watch(on_fatal=fatal.append, grace_s=0.3)
    client.close()  # the worker vanishes; nobody calls check()
    assert _wait_for(lambda: fatal == ["tensor-parallel worker 1 exited unexpectedly"], timeout=5)
    server.close()


TORCHRUN_SCRIPT = """
import sys
from agent_infer import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cpu", dtype="float32", num_kv_blocks=64)
out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
print("TOKENS", out[0].token_ids, flush=True)
llm.shutdown()
"""


def test_torchrun_launch(tiny_model_dirs, tmp_path):
    path = tiny_model_dirs["qwen2"]
    script = tmp_path / "job.py"
    script.write_text(TORCHRUN_SCRIPT)
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script), path],
        capture_output=True, text=True, timeout=180,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [line for line in r.stdout.splitlines() if line.startswith("TOKENS")]
    assert len(lines) == 1, r.stdout  # only rank 0 returns from LLM(); the worker ends with it
    expected = run(path, 1, [[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert lines[0] == f"TOKENS {expected[0].token_ids}"


def _gloo_worker_threads() -> int:
    """This process's gloo worker threads (torch names them), read from /proc."""
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return names.count("pt_gloo_runloop")


def test_shutdown_ends_the_groups_threads_while_the_engine_lives(tiny_model_dirs):
    """Shutdown joins gloo's worker threads even though the engine (its layers, their
    ParallelState) is still referenced, as a script's global engine is until exit. A thread
    left running may still be releasing a collective's tensors when the interpreter
    finalizes, which aborted ranks at exit ("terminate called without an active exception")."""
    before = _gloo_worker_threads()
    eng = make_engine(tiny_model_dirs["qwen2"], 2)
    try:
        eng.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        assert _gloo_worker_threads() > before  # the count sees the group's threads
    finally:
        eng.shutdown()
    assert eng.runner.tp.world_size == 2  # still referenced
    assert _gloo_worker_threads() == before, "the group's threads outlived its destruction"


def test_two_tp_engines_on_one_host(tiny_model_dirs):
    code = textwrap.dedent(f"""
        from agent_infer.config import EngineConfig
        from agent_infer.engine.llm_engine import LLMEngine
        from agent_infer.sampling_params import SamplingParams, StructuredOutputsParams
        e = LLMEngine(EngineConfig(model={tiny_model_dirs['llama']!r}, device="cpu", num_kv_blocks=64, tensor_parallel_size=2))
        print("OK", e.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0].token_ids)
        e.shutdown()
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    assert outs[0][0].strip() == outs[1][0].strip() and outs[0][0].startswith("OK")


# ---- the all-reduce joined with the residual add + RMSNorm after it ---------------------


@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_tp2_row_parallel_reduces_in_add_norm_and_equals_tp1(name, tiny_model_dirs, monkeypatch):
    """Every row-parallel projection (o_proj, down_proj) reduces through
    `all_reduce_add_rms_norm` with the add + norm after it, and the embedding through
    `all_reduce_rms_norm` with the first layer's norm; on CPU (no fused kernel;
    `--all-reduce symm_mem_fused` is accepted there) that is gloo's all-reduce, then the
    add + norm. Same tokens and logprobs as plain TP = 2 exactly, and TP = 1's within fp32
    noise."""
    from agent_infer.layers import embedding, linear

    calls, embed_calls = [], []
    real, real_embed = linear.all_reduce_add_rms_norm, embedding.all_reduce_rms_norm

    def counting(x, residual, weight, eps, tp):
        calls.append(x.shape[0])
        return real(x, residual, weight, eps, tp)

    def counting_embed(x, weight, eps, tp):
        embed_calls.append(x.shape[0])
        return real_embed(x, weight, eps, tp)

    monkeypatch.setattr(linear, "all_reduce_add_rms_norm", counting)
    monkeypatch.setattr(embedding, "all_reduce_rms_norm", counting_embed)
    path = tiny_model_dirs[name]
    eng = make_engine(path, 2, all_reduce="symm_mem_fused")
    try:
        assert eng.runner.tp.all_reduce_norm_impl is None  # no fused kernel on CPU
        layers = eng.model_config.num_layers
        fused = eng.generate(PROMPTS, PARAMS)
        steps = eng.stats.steps
    finally:
        eng.shutdown()
    assert len(calls) == 2 * layers * steps, f"{len(calls)} calls for {steps} steps of {layers} layers"
    assert len(embed_calls) == steps, f"the embedding reduced in its norm {len(embed_calls)} times in {steps} steps"
    plain = run(path, 2)
    assert_same(fused, plain, tol=1e-6)
    assert_same(fused, run(path, 1))
    assert not dist.is_initialized()


def test_add_norm_reduces_through_the_fused_impl_or_falls_back():
    """all_reduce_add_rms_norm and all_reduce_rms_norm: the fused implementation where it
    accepts the tensors, else the group's all-reduce then the (add +) norm; both give the
    reference on the summed input. Here a 'group' of two ranks holding the same x (its sum is 2x)."""
    from agent_infer.kernels import ops, reference
    from agent_infer.distributed.state import ParallelState
    from agent_infer.layers.linear import all_reduce_add_rms_norm, all_reduce_rms_norm

    calls = {"fused": 0, "all_reduce": 0}

    class OneRowFused:
        def accepts(self, x, residual):
            return x.shape[0] == 1

        def __call__(self, x, residual, weight, eps, add=True):
            calls["fused"] += 1
            if not add:
                residual.copy_(x.mul_(2))
                return ops.rms_norm(residual, weight, eps), residual
            return ops.fused_add_rms_norm(x.mul_(2), residual, weight, eps)

    def all_reduce(x):
        calls["all_reduce"] += 1
        x.mul_(2)

    tp = ParallelState(rank=0, world_size=2, all_reduce_impl=all_reduce, all_reduce_norm_impl=OneRowFused())
    weight = torch.rand(64) + 0.5
    for rows, path in ((1, "fused"), (3, "all_reduce")):
        x, r = torch.randn(rows, 64), torch.randn(rows, 64)
        ref_out, ref_res = reference.fused_add_rms_norm(2 * x, r, weight, 1e-6)
        before = dict(calls)
        out, res = all_reduce_add_rms_norm(x.clone(), r.clone(), weight, 1e-6, tp)
        assert calls[path] == before[path] + 1 and sum(calls.values()) == sum(before.values()) + 1
        torch.testing.assert_close(out, ref_out)
        torch.testing.assert_close(res, ref_res)
    # The start of the stream (the embedding's sum and the first layer's norm): no add.
    for rows, path in ((1, "fused"), (3, "all_reduce")):
        x = torch.randn(rows, 64)
        before = dict(calls)
        out, summed = all_reduce_rms_norm(x.clone(), weight, 1e-6, tp)
        assert calls[path] == before[path] + 1 and sum(calls.values()) == sum(before.values()) + 1
        torch.testing.assert_close(summed, 2 * x)
        torch.testing.assert_close(out, reference.rms_norm(2 * x, weight, 1e-6))


def test_tp2_with_speculative_decoding_equals_tp1_without(tiny_model_dirs):
    """Verify steps (several query rows per sequence, rows sampled at each) go to the
    workers like any step, chained ones too (launched before the one in flight is read
    back, their first token still on the device and their rows moved there by the drafts
    it rejected, on every rank): TP = 2 with drafts gives plain TP = 1's tokens (the
    drafts replay the reference, some wrong). And with prompt lookup itself, whose drafts
    for rows behind one in flight every rank looks up on the device alike."""
    path = tiny_model_dirs["qwen3"]
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [40, 41, 42, 43, 40, 41, 42], list(range(20, 61))]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = run(path, 1, prompts, params)
    for replay in (True, False):
        eng = make_engine(path, 2, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                       "prompt_lookup_max": 2, "prompt_lookup_min": 1})
        eng.draft_policy.batch_drafts = lambda num_decoding: True
        eng.draft_policy.may_draft = lambda request_id, length: True  # drafts that fail do not pause
        if replay:
            eng.drafter = Replay(ref, wrong_at=2)  # a draft of a verify step: the step after it moves back
        lookups, build_step = [], eng.runner.build_step
        eng.runner.build_step = lambda batch: lookups.append(batch.draft_histories != []) or build_step(batch)
        try:
            got = eng.generate(prompts, params)
            stats = eng.draft_policy.stats
        finally:
            eng.shutdown()
        assert [o.token_ids for o in got] == [o.token_ids for o in ref]
        if replay:
            assert stats.num_accepted_tokens > 20 and stats.num_draft_tokens > stats.num_accepted_tokens, stats
            assert stats.num_chained_rows > 0, stats
        else:  # a random model repeats little: rows behind one-token rows in flight
            assert sum(lookups) >= 3, (sum(lookups), stats)


def test_tp2_computes_the_kv_scales_of_tp1(tiny_model_dirs):
    """--calculate-kv-scales under TP: each rank measures its own KV heads and the ranks
    take the maximum, so rank 0's layers get TP = 1's scales (up to fp32 summation order),
    and the fp8 cache then decodes alike."""
    path = tiny_model_dirs["llama"]
    scales = {}
    outs = {}
    for tp in (1, 2):
        eng = make_engine(path, tp, kv_cache_dtype="fp8", calculate_kv_scales=True, async_scheduling=tp > 1)
        try:
            scales[tp] = [(layer.cache.k_scale, layer.cache.v_scale) for layer in eng.runner.model.attention_layers]
            outs[tp] = eng.generate(PROMPTS, PARAMS)
        finally:
            eng.shutdown()
    assert all(k != 1.0 for k, _ in scales[1])
    flat = {tp: [s for pair in scales[tp] for s in pair] for tp in scales}
    assert flat[2] == pytest.approx(flat[1], rel=1e-5)
    assert [o.token_ids for o in outs[2]] == [o.token_ids for o in outs[1]]
