"""The front end's CoreClient against a real engine-core process: streaming, text and stop
strings done in the front end, abort on early exit or cancellation, refusals, and what
happens when the core's process dies (killed, or a tensor-parallel worker gone); a
scripted core for what reaches requests when its exit is seen before its last messages."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from contextlib import asynccontextmanager

import pytest
import zmq

from agent_infer.config import EngineConfig
from agent_infer.core import protocol as P
from agent_infer.core.client import (
    CoreClient, EngineDeadError, EngineFailedError, EngineRequest, QueueFullError, RequestRejectedError,
)
from agent_infer.core.config import CoreConfig
from agent_infer.core.process import CoreProcess
from agent_infer.loader.tokenizer import load_tokenizer
from agent_infer.sampling_params import SamplingParams
from tests.server.conftest import process_state

MAX_LEN = 256


def _config(model_dir: str, **kw) -> EngineConfig:
    cfg = dict(device="cpu", dtype="float32", num_kv_blocks=128, max_model_len=MAX_LEN, max_num_seqs=2)
    cfg.update(kw)
    return EngineConfig(model=model_dir, **cfg)


@pytest.fixture(scope="module")
def core(default_model_dir):
    proc = CoreProcess.start(_config(default_model_dir), CoreConfig(max_waiting=3), log_level="warning")
    yield proc
    assert proc.stop() == 0


@asynccontextmanager
async def connected(core: CoreProcess):
    tokenizer = load_tokenizer(core.info.tokenizer_path) if core.info.tokenizer_path else None
    client = CoreClient(core.info, core.address, tokenizer)
    await client.start()
    try:
        yield client
    finally:
        await client.close()


async def _generate(client: CoreClient, text: str, params: SamplingParams, stream: bool = True):
    group = client.submit([EngineRequest(client.tokenizer.encode(text), params, text, stream=stream)])
    await group.admitted()
    async with group:
        return [out async for _, out in group]


async def _wait_idle(client: CoreClient, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = await client.snapshot()
        if s.num_live == 0 and s.num_running == 0 and s.num_used_blocks == 0 and client.num_in_flight == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not idle: {s}")


def _long(max_tokens: int = 200) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def test_streams_deltas_to_the_end_with_the_offline_text(core, smol_engine):
    params = SamplingParams(max_tokens=10, temperature=0)

    async def main():
        async with connected(core) as client:
            outs = await _generate(client, "The sky is", params)
            whole = await _generate(client, "The sky is", params, stream=False)
            await _wait_idle(client)
            return outs, whole

    outs, whole = asyncio.run(main())
    last = outs[-1]
    assert last.finished and last.finish_reason in ("stop", "length")
    assert "".join(o.delta_text for o in outs) == last.text
    assert len(outs) == len(last.token_ids) >= 2  # one output per token: really streamed
    offline = smol_engine.generate(["The sky is"], params)[0]
    assert last.text == offline.text and list(last.token_ids) == offline.token_ids
    assert whole[-1].text == offline.text and all(not o.text for o in whole[:-1])  # decoded once, at the end


def test_stop_strings_end_the_request_in_the_front_end(core, smol_engine):
    """The core knows nothing of stop strings: the front end cuts the text, reports the
    string, and aborts the request in the core, which frees it at once."""
    prompt = "Count: one, two, three, four, five, six, seven,"
    free = smol_engine.generate([prompt], _long(24))[0].text
    stop = free[free.index(",", 3):][:3]  # a stop string the free text meets after a few tokens
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True, stop=[stop])

    async def main():
        async with connected(core) as client:
            outs = await _generate(client, prompt, params)
            await _wait_idle(client, timeout=3)  # 200 tokens would take seconds
            return outs

    outs = asyncio.run(main())
    offline = smol_engine.generate([prompt], params)[0]
    last = outs[-1]
    assert last.finish_reason == "stop" and last.stop_reason == stop
    assert last.text == offline.text and stop not in last.text
    assert list(last.token_ids) == offline.token_ids


def test_leaving_early_or_being_cancelled_aborts_and_frees_blocks(core):
    async def main():
        async with connected(core) as client:
            group = client.submit([EngineRequest(client.tokenizer.encode("Once upon a time"), _long())])
            await group.admitted()
            async with group:
                async for _, out in group:
                    if len(out.token_ids) == 3:
                        break
            await _wait_idle(client, timeout=3)

            async def consume():
                g = client.submit([EngineRequest(client.tokenizer.encode("Far away"), _long())])
                await g.admitted()
                async with g:
                    async for _ in g:
                        pass

            task = asyncio.create_task(consume())
            while (await client.snapshot()).num_running == 0:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await _wait_idle(client, timeout=3)

    asyncio.run(main())


def test_refusals_and_rejections_reach_the_caller(core):
    async def main():
        async with connected(core) as client:
            running = []
            for i in range(2):
                g = client.submit([EngineRequest([5, 6, 7 + i], _long())])
                await g.admitted()
                running.append(g)
            waiting = client.submit([EngineRequest([8, 9], _long()), EngineRequest([8, 10], _long())])
            await waiting.admitted()
            too_many = client.submit([EngineRequest([8, 11], _long()), EngineRequest([8, 12], _long())])
            with pytest.raises(QueueFullError, match="limit is 3"):
                await too_many.admitted()
            for g in (*running, waiting):
                g.abort()
            with pytest.raises(RequestRejectedError) as info:
                await _generate_ids(client, [100] * (MAX_LEN + 3))
            assert str(MAX_LEN) in str(info.value) and str(MAX_LEN + 3) in str(info.value)
            with pytest.raises(RequestRejectedError):
                await _generate_ids(client, [10**9])  # not a token id of this model
            await _wait_idle(client)

    asyncio.run(main())


async def _generate_ids(client: CoreClient, ids: list[int]):
    group = client.submit([EngineRequest(ids, SamplingParams(max_tokens=2))])
    await group.admitted()
    async with group:
        return [out async for _, out in group]


def test_a_killed_core_fails_every_request_at_once(default_model_dir):
    """kill -9 of the core mid-stream: the stream fails with EngineDeadError within a
    second or so, new requests are refused, and the on_dead callbacks hear of it."""
    proc = CoreProcess.start(_config(default_model_dir, num_kv_blocks=32), log_level="warning")
    heard: list[str] = []

    async def main():
        async with connected(proc) as client:
            client.on_dead(heard.append)
            group = client.submit([EngineRequest([5, 6, 7], _long())])
            await group.admitted()
            seen = 0
            async with group:
                with pytest.raises(EngineDeadError):
                    async for _, out in group:
                        seen += len(out.delta_token_ids)
                        if seen == 2:
                            os.kill(proc.pid, signal.SIGKILL)
                            killed = time.monotonic()
            noticed = time.monotonic() - killed
            with pytest.raises(EngineDeadError):
                client.submit([EngineRequest([1, 2], _long())])
            with pytest.raises(EngineDeadError):
                await client.snapshot()
            return noticed

    try:
        noticed = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        proc.stop()
    assert noticed < 2.0 and heard and "exited" in heard[0]


def test_dead_tensor_parallel_worker_stops_the_core(tiny_model_dirs):
    """A TP worker killed mid-stream: the stream fails, the core says why and exits
    non-zero, new requests are refused, and no worker process is left."""
    config = EngineConfig(model=tiny_model_dirs["llama"], device="cpu", dtype="float32", num_kv_blocks=64,
                          max_model_len=MAX_LEN, max_num_seqs=2, tensor_parallel_size=2)
    proc = CoreProcess.start(config, log_level="warning")
    workers = _children(proc.pid)
    assert len(workers) == 1
    heard: list[str] = []

    async def main():
        async with connected(proc) as client:
            client.on_dead(heard.append)
            group = client.submit([EngineRequest([5, 6, 7], _long())])
            await group.admitted()
            seen = 0
            async with group:
                with pytest.raises(Exception):
                    async for _, out in group:
                        seen += len(out.delta_token_ids)
                        if seen == 3:
                            os.kill(workers[0], signal.SIGKILL)
            deadline = time.monotonic() + 10
            while client.is_running and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert not client.is_running
            with pytest.raises(EngineDeadError):
                client.submit([EngineRequest([1, 2], _long())])
            return seen

    try:
        seen = asyncio.run(asyncio.wait_for(main(), 60))
        assert proc.proc.wait(20) == 1
    finally:
        proc.stop()
    assert 3 <= seen < 200
    assert any("WorkerError" in reason for reason in heard), heard
    assert all(process_state(pid) in ("gone", "Z") for pid in workers), "a worker outlived the core"


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def test_the_cores_last_words_reach_requests_before_its_exit_does(tmp_path):
    """A core that reports a request failed, says it is dead and exits at once: the request
    ends with the failure the core reported (the server answers 500), not with "the engine
    is gone" (503), even when the front end sees the exit before the messages arrive (they
    cross a socket; the exit is seen at once). A scripted core: it exits, the front end's
    loop runs once, then its last messages are delivered."""
    address = f"ipc://{tmp_path}/core.sock"
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(address)
    stand_in = subprocess.Popen(["sleep", "60"])  # the core's process, for the front end's watch
    info = P.CoreInfo(stand_in.pid, "m", None, "llama", 64, 100, [0], 8, 16, 4)
    encode, decode = P.encoder().encode, P.core_decoder().decode

    def receive(kind):
        identity, payload = router.recv_multipart()
        message = decode(payload)
        assert isinstance(message, kind), message
        return identity, message

    async def main():
        client = CoreClient(info, address)
        await client.start()
        try:
            identity, _ = receive(P.Hello)
            group = client.submit([EngineRequest([1, 2, 3], _long())])
            _, add = receive(P.Add)
            router.send_multipart([identity, encode(P.Outputs(admitted=[add.group]))])
            await group.admitted()
            stand_in.kill()
            stand_in.wait()
            await asyncio.sleep(0.02)  # the front end's watch sees the exit
            router.send_multipart([identity, encode(P.Outputs(failed=[P.Failure([add.items[0].id], "step failed")]))])
            router.send_multipart([identity, encode(P.Dead("the engine failed"))])
            async with group:
                with pytest.raises(EngineFailedError):
                    async for _ in group:
                        pass
            for _ in range(100):  # then the core's own reason for stopping, not its exit
                if not client.is_running:
                    break
                await asyncio.sleep(0.01)
            return client.dead_reason
        finally:
            await client.close()

    try:
        reason = asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        stand_in.kill()
        router.close(linger=0)
        ctx.term()
    assert reason is not None and "the engine failed" in reason
