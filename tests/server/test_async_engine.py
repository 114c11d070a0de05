"""AsyncEngine on its own: streaming, abort on early exit or cancellation, bounded queue,
several event loops, rejections, an idle loop that does not spin, and shutdown."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from contextlib import aclosing

import pytest

from agent_infer.config import EngineConfig
from agent_infer.engine.async_engine import (
    AsyncEngine,
    AsyncEngineConfig,
    EngineDeadError,
    EngineObserver,
    EngineRequest,
    QueueFullError,
    RequestRejectedError,
)
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.sampling_params import SamplingParams

MAX_LEN = 256


def _engine(model_dir: str, **kw) -> LLMEngine:
    cfg = dict(device="cpu", dtype="float32", num_kv_blocks=128, max_model_len=MAX_LEN, max_num_seqs=2)
    cfg.update(kw)
    return LLMEngine(EngineConfig(model=model_dir, **cfg))


@pytest.fixture(scope="module")
def aengine(default_model_dir):
    ae = AsyncEngine(_engine(default_model_dir), AsyncEngineConfig(max_waiting=3))
    ae.start()
    yield ae
    ae.shutdown()


def _wait_idle(ae: AsyncEngine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = ae.snapshot
        if s.num_live == 0 and s.num_running == 0 and s.num_waiting == 0 and s.num_used_blocks == 0:
            return
        time.sleep(0.01)
    raise AssertionError(f"not idle: {ae.snapshot}")


def _ids(ae: AsyncEngine, text: str) -> list[int]:
    return ae.tokenizer.encode(text)


def _long(max_tokens: int = 200) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def test_generate_streams_deltas_to_the_end(aengine):
    async def main():
        deltas, last = [], None
        async for out in aengine.generate(_ids(aengine, "The sky is"), SamplingParams(max_tokens=10, temperature=0)):
            deltas.append(out.delta_text)
            last = out
        return deltas, last

    deltas, last = asyncio.run(main())
    assert last.finished and last.finish_reason in ("stop", "length")
    assert "".join(deltas) == last.text
    assert len(deltas) == len(last.token_ids) >= 2  # one output per token: really streamed
    _wait_idle(aengine)


def test_leaving_early_aborts_and_frees_blocks(aengine):
    async def main():
        async with aclosing(aengine.generate(_ids(aengine, "Once upon a time"), _long())) as gen:
            async for out in gen:
                if len(out.token_ids) == 3:
                    break
        assert aengine.snapshot.num_used_blocks > 0 or aengine.snapshot.num_live > 0  # abort is in flight

    asyncio.run(main())
    _wait_idle(aengine, timeout=2.0)  # 200 tokens would take seconds; the abort is immediate


def test_cancelled_consumer_aborts_its_request(aengine):
    async def consume():
        async for _ in aengine.generate(_ids(aengine, "Far away"), _long()):
            pass

    async def main():
        task = asyncio.create_task(consume())
        while aengine.snapshot.num_running == 0:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    _wait_idle(aengine, timeout=2.0)


def test_waiting_queue_is_bounded_and_groups_are_all_or_nothing(aengine):
    """max_num_seqs=2 run, max_waiting=3 wait; a group that would not fit is refused whole."""
    def req(text: str) -> EngineRequest:
        return EngineRequest(_ids(aengine, text), _long())

    async def main():
        groups = [aengine.submit([req(f"Story {i}:")]) for i in range(2)]
        while aengine.snapshot.num_running < 2:
            await asyncio.sleep(0.01)
        groups.append(aengine.submit([req("waiting 1"), req("waiting 2")]))
        with pytest.raises(QueueFullError) as info:  # 2 waiting + 2 new > 3
            aengine.submit([req("pair 1"), req("pair 2")])
        assert info.value.max_waiting == 3 and info.value.num_waiting == 2
        groups.append(aengine.submit([req("waiting 3")]))
        with pytest.raises(QueueFullError):
            aengine.submit([req("one too many")])
        assert aengine.snapshot.num_waiting + aengine.snapshot.num_running <= 5
        for g in groups:
            g.abort()
        # Once aborted, the queue has room again.
        while aengine.snapshot.num_waiting or aengine.snapshot.num_live:
            await asyncio.sleep(0.01)
        g = aengine.submit([EngineRequest(_ids(aengine, "fits"), SamplingParams(max_tokens=2, temperature=0))])
        async with g:
            outs = [out async for _, out in g]
        assert outs[-1].finished

    asyncio.run(main())
    _wait_idle(aengine)


def test_requests_from_several_event_loops(aengine):
    """Each output goes back to the loop that submitted its request."""
    results: dict[int, str] = {}

    def worker(i: int) -> None:
        async def main():
            text = ""
            async for out in aengine.generate(_ids(aengine, f"Number {i} is"), SamplingParams(max_tokens=6, temperature=0)):
                text += out.delta_text
            return text

        results[i] = asyncio.run(main())

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == [0, 1, 2] and all(results.values())
    _wait_idle(aengine)


def test_rejections_reach_the_caller(aengine):
    async def run(ids):
        async for _ in aengine.generate(ids, SamplingParams(max_tokens=2)):
            pass

    with pytest.raises(RequestRejectedError) as info:
        asyncio.run(run([100] * (MAX_LEN + 3)))
    assert str(MAX_LEN) in str(info.value) and str(MAX_LEN + 3) in str(info.value)
    with pytest.raises(RequestRejectedError):
        asyncio.run(run([10**9]))  # not a token id of this model
    _wait_idle(aengine)


def _thread_cpu_ticks(native_id: int) -> int:
    with open(f"/proc/self/task/{native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime (fields 14 and 15)


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc to read a thread's CPU time")
def test_idle_loop_does_not_spin(aengine):
    _wait_idle(aengine)
    tid = aengine._thread.native_id
    before = _thread_cpu_ticks(tid)
    time.sleep(1.0)
    used = _thread_cpu_ticks(tid) - before
    assert used <= 3, f"idle engine thread used {used} clock ticks in 1 s"


def test_observer_errors_do_not_stop_the_loop(aengine):
    class Broken(EngineObserver):
        def on_step(self, info):
            raise ValueError("observer bug")

    aengine.add_observer(Broken())

    async def main():
        return [o async for o in aengine.generate(_ids(aengine, "Hi"), SamplingParams(max_tokens=3, temperature=0))]

    outs = asyncio.run(main())
    assert outs[-1].finished and aengine.is_running


def test_shutdown_fails_in_flight_requests_and_refuses_new_ones(default_model_dir):
    ae = AsyncEngine(_engine(default_model_dir, num_kv_blocks=32), AsyncEngineConfig(max_waiting=4))
    with pytest.raises(EngineDeadError):  # not started yet

        async def early():
            ae.submit([EngineRequest([1, 2], SamplingParams())])

        asyncio.run(early())
    ae.start()

    async def main():
        gen = ae.generate(_ids(ae, "Forever"), _long(100))
        first = await gen.__anext__()
        assert not first.finished
        t0 = time.monotonic()
        await asyncio.to_thread(ae.shutdown)
        assert time.monotonic() - t0 < 5
        with pytest.raises(EngineDeadError):
            async for _ in gen:
                pass
        with pytest.raises(EngineDeadError):
            ae.submit([EngineRequest([1, 2], SamplingParams())])

    asyncio.run(main())
    assert not ae._thread.is_alive() and not ae.is_running


def test_dead_tensor_parallel_worker_stops_the_loop(tiny_model_dirs):
    """A TP worker killed mid-stream: the stream fails, the loop stops with the reason
    (so /health turns 503), new requests are refused, and no worker process is left."""
    import signal

    engine = LLMEngine(EngineConfig(model=tiny_model_dirs["llama"], device="cpu", dtype="float32", num_kv_blocks=64,
                                    max_model_len=MAX_LEN, max_num_seqs=2, tensor_parallel_size=2))
    procs = list(engine.workers.procs)
    ae = AsyncEngine(engine, AsyncEngineConfig(max_waiting=3))
    ae.start()
    try:
        async def main():
            group = ae.submit([EngineRequest([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=200,
                                                                       ignore_eos=True))])
            seen = 0
            async with group:
                with pytest.raises(Exception) as info:
                    async for _, out in group:
                        seen += len(out.delta_token_ids)
                        if seen == 3:
                            os.kill(procs[0].pid, signal.SIGKILL)
            return info.value, seen

        t0 = time.monotonic()
        error, seen = asyncio.run(asyncio.wait_for(main(), 60))
        assert 3 <= seen < 200 and time.monotonic() - t0 < 20
        deadline = time.monotonic() + 10
        while ae.is_running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not ae.is_running and "WorkerError" in (ae.dead_reason or "")

        async def again():
            ae.submit([EngineRequest([1, 2], SamplingParams(max_tokens=2))])

        with pytest.raises(EngineDeadError):
            asyncio.run(again())
        time.sleep(0.5)
        assert all(p.poll() is not None for p in procs), "a worker outlived the engine"
    finally:
        ae.shutdown()
