"""Tensor parallelism on CPU (gloo): TP = 2 and 3 give the same greedy tokens and the same
fp32 logprobs as TP = 1; bad sizes fail before any process starts; a dead worker makes the
engine fail fast and leaves no process behind; torchrun launches work too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch.distributed as dist

from agent_infer.config import ConfigError, EngineConfig
from agent_infer.engine.control import ControlClient, ControlServer, WorkerError
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.sampling_params import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [300, 12, 13], list(range(20, 61))]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=20)


def run(path: str, tp: int, prompts=PROMPTS, params=PARAMS):
    eng = LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", num_kv_blocks=128, tensor_parallel_size=tp))
    try:
        return eng.generate(prompts, params)
    finally:
        eng.shutdown()


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
    path = tiny_model_dirs[name]
    assert_same(run(path, 2), run(path, 1))
    assert not dist.is_initialized(), "the rank-0 process must leave no process group behind"


def test_single_process_never_creates_a_group(tiny_model_dirs):
    run(tiny_model_dirs["llama"], 1)
    assert not dist.is_initialized()


def test_default_model_tp3_same_text_and_tp2_is_refused(default_model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=20)
    prompts = ["The capital of France is", "Water boils at"]
    one = run(default_model_dir, 1, prompts, params)
    three = run(default_model_dir, 3, prompts, params)
    assert [o.text for o in three] == [o.text for o in one]
    assert_same(three, one)
    with pytest.raises(ConfigError, match=r"9 attention heads, 3 KV heads.*\[1, 3, 9\]"):
        LLMEngine(EngineConfig(model=default_model_dir, device="cpu", tensor_parallel_size=2))


def test_killed_worker_fails_fast_and_leaves_no_orphans(tiny_model_dirs):
    eng = LLMEngine(EngineConfig(model=tiny_model_dirs["qwen3_untied"], device="cpu", dtype="float32",
                                 num_kv_blocks=128, tensor_parallel_size=2))
    procs = list(eng.workers.procs)
    eng.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
    for _ in range(3):
        eng.step()
    os.kill(procs[0].pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="worker 1"):
        while eng.has_unfinished_requests():
            eng.step()
    assert time.monotonic() - t0 < 30
    time.sleep(0.5)
    assert all(p.poll() is not None for p in procs), "a worker outlived the engine"
    assert eng.workers is None


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


def test_two_tp_engines_on_one_host(tiny_model_dirs):
    code = textwrap.dedent(f"""
        from agent_infer.config import EngineConfig
        from agent_infer.engine.llm_engine import LLMEngine
        from agent_infer.sampling_params import SamplingParams
        e = LLMEngine(EngineConfig(model={tiny_model_dirs['llama']!r}, device="cpu", num_kv_blocks=64, tensor_parallel_size=2))
        print("OK", e.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0].token_ids)
        e.shutdown()
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    assert outs[0][0].strip() == outs[1][0].strip() and outs[0][0].startswith("OK")
