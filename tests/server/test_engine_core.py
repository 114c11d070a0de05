"""The engine core's loop on its own, run in a thread here and driven by a plain ZMQ socket
playing a front end: a step's outputs leave right after the next launch and none stay
behind, the idle loop does not spin, the waiting queue is bounded (groups all or none),
refusals and rejections come back as messages, and a front end whose process goes away
has its requests aborted at once."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import zmq

from agent_infer.config import EngineConfig
from agent_infer.core import protocol as P
from agent_infer.core.config import CoreConfig
from agent_infer.core.engine_core import EngineCore
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.sampling_params import SamplingParams

MAX_LEN = 256


class FakeFrontEnd:
    """A DEALER that speaks the protocol synchronously."""

    def __init__(self, address: str, pid: int | None = None):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.connect(address)
        self.encode = P.encoder().encode
        self.decode = P.front_end_decoder().decode
        self.send(P.Hello(pid or os.getpid(), "fake"))
        self.calls = 0
        self.backlog: list = []  # messages that came while waiting for a reply

    def send(self, message) -> None:
        self.sock.send(self.encode(message))

    def recv(self, timeout_s: float = 30.0):
        if self.backlog:
            return self.backlog.pop(0)
        if not self.sock.poll(int(timeout_s * 1000)):
            raise AssertionError("no message from the core")
        return self.decode(self.sock.recv())

    def add(self, group: int, ids: list[int], prompts: list[list[int]], params: SamplingParams) -> None:
        self.send(P.Add(group, [P.AddItem(i, p, params) for i, p in zip(ids, prompts)], time.monotonic()))

    def outputs_until(self, done: set[int], timeout_s: float = 60.0) -> list[P.Outputs]:
        """Every Outputs message until each id in `done` has finished (or was refused)."""
        messages, open_ids = [], set(done)
        deadline = time.monotonic() + timeout_s
        while open_ids:
            msg = self.recv(max(0.1, deadline - time.monotonic()))
            if isinstance(msg, P.Outputs):
                messages.append(msg)
                open_ids -= {d.id for d in msg.deltas if d.finish_reason or d.error}
                open_ids -= {i for f in msg.failed for i in f.ids}
        return messages

    def snapshot(self) -> P.EngineSnapshot:
        self.calls += 1
        self.send(P.Call(self.calls, "snapshot"))
        while True:
            if not self.sock.poll(30_000):
                raise AssertionError("no reply from the core")
            msg = self.decode(self.sock.recv())
            if isinstance(msg, P.Reply) and msg.call_id == self.calls:
                return P.EngineSnapshot(**msg.result)
            self.backlog.append(msg)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


class CoreThread:
    def __init__(self, engine: LLMEngine, max_waiting: int = 8):
        self.dir = tempfile.mkdtemp(prefix="agent-infer-test-")
        self.address = f"ipc://{self.dir}/core"
        self.core = EngineCore(engine, CoreConfig(max_waiting=max_waiting), self.address)
        self.codes: list[int] = []
        self.thread = threading.Thread(target=lambda: self.codes.append(self.core.run()), daemon=True)
        self.thread.start()

    def stop(self) -> int:
        self.core.request_stop()
        self.thread.join(30)
        assert not self.thread.is_alive()
        return self.codes[0]


def _engine(model_dir: str, **kw) -> LLMEngine:
    cfg = dict(device="cpu", dtype="float32", num_kv_blocks=128, max_model_len=MAX_LEN, max_num_seqs=2)
    cfg.update(kw)
    return LLMEngine(EngineConfig(model=model_dir, **cfg), detokenize=False)


@pytest.fixture(scope="module")
def core(default_model_dir):
    c = CoreThread(_engine(default_model_dir), max_waiting=3)
    yield c
    assert c.stop() == 0


@pytest.fixture
def front(core):
    fe = FakeFrontEnd(core.address)
    yield fe
    fe.close()


def _wait_idle(fe: FakeFrontEnd, timeout: float = 10.0) -> P.EngineSnapshot:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = fe.snapshot()
        if s.num_live == 0 and s.num_running == 0 and s.num_waiting == 0 and s.num_used_blocks == 0:
            return s
        time.sleep(0.01)
    raise AssertionError(f"not idle: {s}")


def _long(max_tokens: int = 200) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def test_tokens_come_back_step_by_step_and_match_the_engine(front, default_model_dir, smol_engine):
    prompt = smol_engine.tokenizer.encode("The capital of France is")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    front.add(1, [10], [prompt], params)
    messages = front.outputs_until({10})
    assert messages[0].admitted == [1]
    deltas = [d for m in messages for d in m.deltas if d.id == 10]
    assert [len(d.token_ids) for d in deltas] == [1] * 8  # one message per step, one token each
    assert deltas[-1].finish_reason == "length" and all(d.finish_reason is None for d in deltas[:-1])
    offline = smol_engine.generate([prompt], params)[0]
    assert [t for d in deltas for t in d.token_ids] == offline.token_ids
    _wait_idle(front)


def test_queue_is_bounded_and_groups_are_all_or_nothing(front, default_model_dir):
    """max_num_seqs=2 run, max_waiting=3 wait; a group that would not fit is refused whole."""
    front.add(1, [1], [[5, 6, 7]], _long())
    front.add(2, [2], [[5, 6, 8]], _long())
    deadline = time.monotonic() + 20
    while front.snapshot().num_running < 2:
        assert time.monotonic() < deadline
    front.add(3, [3, 4], [[9, 9], [9, 8]], _long())
    front.add(4, [5, 6], [[9, 7], [9, 6]], _long())  # 2 waiting + 2 > 3: refused whole
    front.add(5, [7], [[9, 5]], _long())
    front.add(6, [8], [[9, 4]], _long())  # one too many
    admitted, refused = [], []
    while len(admitted) + len(refused) < 6:
        msg = front.recv()
        if isinstance(msg, P.Outputs):
            admitted += msg.admitted
            refused += msg.refused
    assert sorted(admitted) == [1, 2, 3, 5] and sorted(r.group for r in refused) == [4, 6]
    assert all(r.code == "queue_full" and "limit is 3" in r.message for r in refused)
    snap = front.snapshot()
    assert snap.num_waiting == 3 and snap.num_running == 2
    front.send(P.Abort([1, 2, 3, 4, 7]))
    _wait_idle(front, timeout=5)  # 200-token requests would take many seconds: the aborts are immediate


def test_rejections_and_bad_requests_come_back_as_errors(front):
    front.add(1, [1], [[100] * (MAX_LEN + 3)], SamplingParams(max_tokens=2))
    front.add(2, [2], [[10**9]], SamplingParams(max_tokens=2))  # not a token id of this model
    msgs = front.outputs_until({1, 2})
    errors = {d.id: d.error for m in msgs for d in m.deltas if d.error}
    assert str(MAX_LEN) in errors[1] and str(MAX_LEN + 3) in errors[1]
    assert "token ids" in errors[2]
    _wait_idle(front)


class _LaunchRecorder:
    """The runner, noting how many messages the core had sent at each launch."""

    def __init__(self, runner, sent: list):
        self.runner, self.sent, self.sent_at_launch = runner, sent, []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def launch(self, *args, **kwargs):
        self.sent_at_launch.append(len(self.sent))
        return self.runner.launch(*args, **kwargs)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_outputs_go_out_after_the_next_launch_and_none_stay_behind(default_model_dir, async_scheduling):
    engine = _engine(default_model_dir, num_kv_blocks=64, async_scheduling=async_scheduling)
    sent: list = []
    recorder = _LaunchRecorder(engine.runner, sent)
    engine.runner = recorder
    core = CoreThread(engine)
    real_send = core.core._send

    def counting_send(client, message):
        if isinstance(message, P.Outputs) and message.deltas:
            sent.append(message)
        real_send(client, message)

    core.core._send = counting_send
    fe = FakeFrontEnd(core.address)
    try:
        ids = engine.tokenizer.encode("Count: one, two,")
        fe.add(1, [1], [ids], _long(6))
        first = [d for m in fe.outputs_until({1}) for d in m.deltas]
        fe.add(2, [2], [ids], _long(2))  # after the engine went idle: nothing stays behind
        second = [d for m in fe.outputs_until({2}) for d in m.deltas]
    finally:
        fe.close()
        core.stop()
    assert [len(d.token_ids) for d in first] == [1] * 6 and first[-1].finish_reason == "length"
    assert second[-1].finish_reason == "length" and sum(len(d.token_ids) for d in second) == 2
    # Step k's tokens are read back after launch k + 1 (async) or launch k (sync) and go
    # out only once the following launch is queued: never while the core still has a
    # launch to make.
    lag = 2 if async_scheduling else 1
    launches = recorder.sent_at_launch[:6]
    assert launches == [max(0, k - lag) for k in range(len(launches))]


def _thread_cpu_ticks(native_id: int) -> int:
    with open(f"/proc/self/task/{native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime (fields 14 and 15)


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc to read a thread's CPU time")
def test_idle_loop_does_not_spin(core, front):
    _wait_idle(front)
    tid = core.thread.native_id
    before = _thread_cpu_ticks(tid)
    time.sleep(1.0)
    used = _thread_cpu_ticks(tid) - before
    assert used <= 3, f"idle core used {used} clock ticks in 1 s"


def test_a_front_end_that_goes_away_has_its_requests_aborted(core, front):
    """A front end in another process (here: a stand-in pid) dies with a request running:
    the core notices through the pid and frees the request's blocks at once."""
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    known = front.snapshot().num_front_ends
    other = FakeFrontEnd(core.address, pid=stand_in.pid)
    try:
        other.add(1, [1], [[5, 6, 7, 8]], _long())
        other.outputs_until(set(), timeout_s=1)
        deadline = time.monotonic() + 10
        while front.snapshot().num_running == 0:
            assert time.monotonic() < deadline
        assert front.snapshot().num_front_ends == known + 1
        stand_in.kill()
        stand_in.wait()
        t0 = time.monotonic()
        snap = _wait_idle(front, timeout=3)
        assert time.monotonic() - t0 < 3 and snap.num_front_ends == known
    finally:
        stand_in.kill()
        other.close()


def test_on_a_cpu_the_core_leaves_one_cpu_to_its_loop(monkeypatch):
    """torch's intra-op threads take all CPUs but one (host work runs beside the forward
    pass); OMP_NUM_THREADS, when set, decides instead; a GPU engine leaves torch alone."""
    from types import SimpleNamespace

    import torch

    from agent_infer.core.process import leave_a_cpu_to_the_loop

    on = {"cpu": SimpleNamespace(resolve_device=lambda: torch.device("cpu")),
          "cuda": SimpleNamespace(resolve_device=lambda: torch.device("cuda"))}
    before = torch.get_num_threads()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(6)))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        leave_a_cpu_to_the_loop(on["cpu"])
        assert torch.get_num_threads() == 5
        torch.set_num_threads(3)
        leave_a_cpu_to_the_loop(on["cuda"])
        assert torch.get_num_threads() == 3
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        leave_a_cpu_to_the_loop(on["cpu"])
        assert torch.get_num_threads() == 3
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
        leave_a_cpu_to_the_loop(on["cpu"])
        assert torch.get_num_threads() == 1  # never fewer than one
    finally:
        torch.set_num_threads(before)
