"""Server overhead on CPU: `agent-infer serve` + `bench serve` against offline `generate`
at the same batch, with the model replaced by a fake device so that only the host side
(Python, the processes, ZMQ, HTTP) is measured.

The fake runner keeps everything of the real engine but the forward pass: scheduler,
block manager, async scheduling (launch step N+1, then wait for step N), the engine
core's loop, the front ends' detokenization and stop strings, FastAPI and uvicorn all
run for real. A launched step "runs" on a simulated device that executes steps one
after another (decode ~6 ms at batch 64, prefill ~25 us per prompt token: offline
throughput comes out like the H200 figure of docs/PERFORMANCE.md, Qwen3-8B shape);
waiting for a step's tokens sleeps until its end with the GIL released, like waiting on
a CUDA event, and a launch lets go of the GIL --launch-gil-releases times, as every
PyTorch call of a real launch does. So the engine loses time where the real one does:
host work between two launches longer than a device step.

The server is `agent-infer serve`'s own code path (agent_infer.server.cli: supervisor,
one engine core, --api-server-count front ends) run in a process of its own, with one
seam patched: the supervisor starts its engine core with an `engine_factory`
(`fake_engine` below, which installs the fake runner and then builds the core's usual
engine), so the fake device lives in the engine core process, where the model would.
The load generator (agent_infer/bench/serve.py) runs in this process; offline runs
`LLMEngine.generate` on the same fake here. Each run prints where the device time went:
busy, "late launches" (the device had finished and the next step was not launched yet)
and "no work" (nothing in flight: requests had not arrived), and the CPU seconds of each
process over the run (/proc/<pid>/stat, all threads): the client (this one), the engine
core, each front end, the front ends' text workers and the supervisor; and how long the
engine's loop (offline: this process's main thread; server: the core's) was ready to run
but waiting for a CPU. On a machine with fewer free cores than busy processes (client,
core, front ends) that wait shows up as late launches: the machine's, not the server's.

    .venv/bin/python benchmarks/server_overhead.py                   # offline and server, 3 repeats each
    .venv/bin/python benchmarks/server_overhead.py --mode server -v  # also list the stretches with no work
    .venv/bin/python benchmarks/server_overhead.py --mode server --api-server-count 2
    .venv/bin/python benchmarks/server_overhead.py --serve-arg=--api-server-count=2   # any serve flag
    PYTHONPATH=/path/to/other/checkout .venv/bin/python benchmarks/server_overhead.py   # another version

Results are noisy on a small machine, and anything else running on it shows: repeat,
and compare versions in alternation. A benchmark, not a test: ~10 s per run and mode,
and the server's start (its front ends load tokenizers and start text workers) can take
a minute on a small machine.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))

# ---- the fake device -----------------------------------------------------------------


class FakeDevice:
    """Runs launched steps one after another; durations from a linear cost model.

    Besides the busy time it counts the two ways the device can wait: `late_s`, a step
    launched after the previous one had already ended (host work or GIL waits between
    launches too long), and `starved_s`, nothing in flight at all (no requests)."""

    def __init__(self, decode_ms: float, decode_us_per_seq: float, prefill_us_per_token: float):
        self.decode_s = decode_ms / 1e3
        self.decode_per_seq_s = decode_us_per_seq / 1e6
        self.prefill_per_token_s = prefill_us_per_token / 1e6
        self.free_at = 0.0  # when the last launched step ends
        self.starved_since: float | None = time.perf_counter()
        self.c = {"late_s": 0.0, "starved_s": 0.0, "prefill_s": 0.0, "decode_s": 0.0, "prefill_steps": 0,
                  "decode_steps": 0, "decode_seqs": 0, "steps": 0}
        self.starved: list[tuple[float, float]] = []  # (since, seconds) of each stretch with no work
        self._lock = threading.Lock()

    def queue(self, is_prefill: bool, num_tokens: int, num_seqs: int) -> float:
        if is_prefill:
            duration = self.decode_s * 0.5 + self.prefill_per_token_s * num_tokens
        else:
            duration = self.decode_s + self.decode_per_seq_s * (num_seqs - 64)
        now = time.perf_counter()
        c = self.c
        with self._lock:
            if self.starved_since is not None:
                c["starved_s"] += now - self.starved_since
                self.starved = [*self.starved[-999:], (self.starved_since, now - self.starved_since)]
                self.starved_since = None
            elif now > self.free_at:
                c["late_s"] += now - self.free_at
            self.free_at = max(now, self.free_at) + duration
            if is_prefill:
                c["prefill_s"] += duration
                c["prefill_steps"] += 1
            else:
                c["decode_s"] += duration
                c["decode_steps"] += 1
                c["decode_seqs"] += num_seqs
            c["steps"] += 1
            return self.free_at

    def mark_starved(self) -> None:
        """The engine read back its last step and has nothing in flight."""
        with self._lock:
            self.starved_since = max(time.perf_counter(), self.free_at)

    def counters(self) -> dict:
        with self._lock:
            c = dict(self.c)
            if self.starved_since is not None:
                c["starved_s"] += max(0.0, time.perf_counter() - self.starved_since)
            return c


class _Handle:
    __slots__ = ("num_tokens", "ready_at")

    def __init__(self, ready_at: float, num_tokens: int):
        self.ready_at, self.num_tokens = ready_at, num_tokens


class FakeRunner:
    """ModelRunner's interface (build_step / launch / collect) on a FakeDevice."""

    def __init__(self, device: FakeDevice, block_size: int, launch_cpu_ms: float, launch_gil_releases: int,
                 prefill_launch_cpu_ms: float = 0.0, seed: int = 0):
        import numpy as np

        self.device = device
        self.block_size = block_size
        self.launch_cpu_s = launch_cpu_ms / 1e3
        self.prefill_launch_cpu_s = prefill_launch_cpu_ms / 1e3
        self.launch_gil_releases = launch_gil_releases
        self.rng = np.random.default_rng(seed)
        self.inflight = 0

    def build_step(self, batch):
        from agent_infer.engine.host_step import build_host_step

        return build_host_step(batch, self.block_size)  # the real host-side input building

    def launch(self, step, sampling_seqs, process_logits=None):
        if process_logits is not None:  # the engine's path for constrained rows: there are no logits here
            raise NotImplementedError("the fake runner has no logits: structured outputs cannot be benchmarked")
        # Host cost with the GIL held: a decode step replays a graph; a prefill step runs
        # eagerly, every kernel launched from Python.
        cpu_s = self.prefill_launch_cpu_s if step.is_prefill else self.launch_cpu_s
        if cpu_s:
            end = time.perf_counter() + cpu_s
            while time.perf_counter() < end:
                pass
        # Every PyTorch call of a real launch (input copies, graph replay, sampler kernels,
        # the copy back) lets go of the GIL for a moment: a chance for another thread to
        # take it, after which this one waits for it to be handed back.
        for _ in range(self.launch_gil_releases):
            time.sleep(0)
        ready = self.device.queue(step.is_prefill, len(step.input_ids), len(step.query_lens))
        self.inflight += 1
        return _Handle(ready, len(sampling_seqs))

    def collect(self, handle: _Handle):
        from agent_infer.engine.model_runner import StepOutput

        delay = handle.ready_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)  # like cudaEventSynchronize: blocks with the GIL released
        self.inflight -= 1
        if self.inflight == 0:
            self.device.mark_starved()
        # Ordinary word-piece ids of SmolLM2's vocabulary, as the random prompts use.
        return StepOutput(tokens=self.rng.integers(100, 10000, handle.num_tokens).tolist())


FAKE_SETTINGS = ("decode_ms", "decode_us_per_seq", "prefill_us_per_token", "launch_cpu_ms", "prefill_launch_cpu_ms",
                 "launch_gil_releases")


def fake_settings(args) -> dict:
    """The fake device's and runner's settings, as a plain (picklable) dict."""
    return {k: getattr(args, k) for k in FAKE_SETTINGS}


def install_fake_runner(fake: dict) -> FakeDevice:
    """Make every LLMEngine built from now on in this process use a FakeRunner (no
    weights, no KV cache)."""
    from agent_infer.engine import llm_engine
    from agent_infer.engine.runner_setup import RunnerPlan, resolve_max_model_len

    device = FakeDevice(fake["decode_ms"], fake["decode_us_per_seq"], fake["prefill_us_per_token"])

    def setup_runner(config, model_config, dev, dtype, tp):
        max_model_len = resolve_max_model_len(config, model_config)
        blocks = config.max_num_seqs * -(-max_model_len // config.block_size) + 64
        runner = FakeRunner(device, config.block_size, fake["launch_cpu_ms"], fake["launch_gil_releases"],
                            fake["prefill_launch_cpu_ms"])
        return runner, RunnerPlan(blocks, max_model_len)

    llm_engine.setup_runner = setup_runner
    return device


def _device_delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in FakeDevice(0, 0, 0).c}


# ---- offline -------------------------------------------------------------------------


def make_prompts(args, seed: int) -> list[list[int]]:
    from agent_infer.bench.serve import BenchConfig
    from agent_infer.bench.serve import make_prompts as bench_prompts

    cfg = BenchConfig(base_url="", num_prompts=args.num_prompts, random_input_len=args.input_len,
                      random_output_len=args.output_len, seed=seed)
    return [p.prompt for p in bench_prompts(cfg)]


def run_offline(args, model: str, seed: int) -> dict:
    from agent_infer.config import EngineConfig
    from agent_infer.engine.llm_engine import LLMEngine
    from agent_infer.sampling_params import SamplingParams

    device = install_fake_runner(fake_settings(args))
    engine = LLMEngine(EngineConfig(model=model, device="cpu", max_num_seqs=args.concurrency,
                                    max_model_len=args.max_model_len))
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    engine.generate(make_prompts(args, seed + 1000)[: args.concurrency], params)  # warm-up
    prompts = make_prompts(args, seed)
    before = device.counters()
    cpu0, wait0, t0 = time.thread_time(), runqueue_wait_s(os.getpid()), time.perf_counter()
    outs = engine.generate(prompts, params)
    wall, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
    tokens = sum(len(o.token_ids) for o in outs)
    return {"output_tok_s": tokens / wall, "wall_s": wall, "tokens": tokens, "engine_cpu_s": cpu,
            "engine_cpu_wait_s": runqueue_wait_s(os.getpid()) - wait0,
            **_device_delta(before, device.counters())}


# ---- in the server's engine core process -----------------------------------------------


def fake_engine(fake: dict, config):
    """The engine core's `engine_factory` (see agent_infer/core/process.py): the core's
    usual engine, on the fake runner. Runs in the core process, which unpickles it by
    reference as `server_overhead.fake_engine` (this directory is on its PYTHONPATH).
    SIGUSR1 then writes the fake device's counters to fake["stats_file"]."""
    from agent_infer.core.process import default_engine

    device = install_fake_runner(fake)
    engine = default_engine(config)

    def on_signal(signum, frame):
        # The handler runs in the core's main thread, maybe inside FakeDevice.queue with
        # its lock held: another thread waits for the lock and writes the file.
        threading.Thread(target=_write_counters, args=(device, fake["stats_file"]), daemon=True).start()

    signal.signal(signal.SIGUSR1, on_signal)
    return engine


def _write_counters(device: FakeDevice, path: str) -> None:
    counters = device.counters()
    with device._lock:
        starved = device.starved[-500:]
    with open(path + ".tmp", "w") as f:
        json.dump({**counters, "starved": starved}, f)
    os.replace(path + ".tmp", path)


# ---- the server process (the supervisor) ------------------------------------------------


def _serve_child(args, argv: list[str]) -> int:
    """In the server process: `agent-infer serve` (agent_infer.server.cli.main), its
    engine core started with `fake_engine` as its engine factory."""
    import server_overhead  # this file by its module name, so that the factory pickles by reference

    factory = functools.partial(server_overhead.fake_engine, {**fake_settings(args), "stats_file": args.stats_file})
    _start_cores_with(factory)
    from agent_infer.server.cli import main

    return main(argv)


def _start_cores_with(factory) -> None:
    """Every `CoreProcess.start` in this process passes `engine_factory=factory`. Patched
    on the class, so whoever calls it and however they imported it; an explicit factory
    from the caller is an error (the server now picks one itself: this patch needs a look)."""
    from agent_infer.core.process import CoreProcess

    real_start = CoreProcess.start  # bound to the class

    def start(engine_config, core_config=None, **kwargs):
        if kwargs.get("engine_factory") is not None:
            raise RuntimeError(f"the server starts its core with engine_factory={kwargs['engine_factory']!r}; "
                               "server_overhead.py would replace it: update the benchmark")
        return real_start(engine_config, core_config, engine_factory=factory, **kwargs)

    CoreProcess.start = staticmethod(start)


# ---- CPU seconds of the server's processes ------------------------------------------------


def _proc_stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (state first), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _descendants(root: int) -> list[tuple[int, int]]:
    """(pid, parent pid) of every live descendant of `root`, parents before their children."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = _proc_stat(int(name))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(name))
    out, todo = [], [(pid, root) for pid in sorted(children.get(root, []))]
    while todo:
        pid, parent = todo.pop(0)
        out.append((pid, parent))
        todo += [(child, pid) for child in sorted(children.get(pid, []))]
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def server_cpu(supervisor: int) -> dict[int, tuple[str, float]]:
    """pid -> (role, CPU seconds so far: user + system, all threads) of the supervisor
    and every process under it. Roles: core, fe0, fe1, ... (front ends, in the order they
    started), "text workers" (the front ends' children), "core workers" (the core's,
    e.g. tensor-parallel ranks), supervisor."""
    tick = os.sysconf("SC_CLK_TCK")
    roles = {supervisor: "supervisor"}
    front_ends = 0
    for pid, parent in _descendants(supervisor):  # parents come first
        parent_role = roles[parent]
        if parent_role == "supervisor":
            if "agent_infer.core" in _cmdline(pid):
                roles[pid] = "core"
            else:
                roles[pid], front_ends = f"fe{front_ends}", front_ends + 1
        else:
            roles[pid] = "core workers" if parent_role.startswith("core") else "text workers"
    out = {}
    for pid, role in roles.items():
        fields = _proc_stat(pid)
        if fields is not None:
            out[pid] = (role, (int(fields[11]) + int(fields[12])) / tick)
    return out


def runqueue_wait_s(pid: int) -> float:
    """Seconds the process's main thread (the core's loop) has been ready to run but
    waiting for a CPU (/proc/<pid>/schedstat): on a busy machine, late launches that are
    no host work of the engine's."""
    try:
        with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return float("nan")


def cpu_delta(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds per role between two samples (a process started in between counts
    from zero; one gone in between is missing)."""
    out: dict[str, float] = {}
    for pid, (role, sec) in after.items():
        out[role] = out.get(role, 0.0) + sec - before.get(pid, (role, 0.0))[1]
    return out


# ---- the server, from this process ------------------------------------------------------


class ServerProcess:
    """The server child: started, its URL found, its core's counters read, stopped.

    It runs in a scratch directory: its own children run `python -m ...`, which puts the
    working directory first on their path, so a checkout there would win over PYTHONPATH."""

    def __init__(self, args, model: str):
        self.stats_dir = tempfile.mkdtemp(prefix="server-overhead-")
        self.stats_file = os.path.join(self.stats_dir, "counters.json")
        self.proc = subprocess.Popen(self._command(args, model), stderr=subprocess.PIPE, text=True,
                                     env=self._environment(args), cwd=self.stats_dir)
        self.url = None
        self.log: list[str] = []
        try:
            self._read_url()
            threading.Thread(target=self._drain, daemon=True).start()
            self._wait_healthy()
            self.core_pid = self._find_core()
        except BaseException:
            self.close()
            raise

    def _command(self, args, model: str) -> list[str]:
        serve_argv = ["--model", os.path.abspath(model), "--device", "cpu", "--port", "0", "--max-num-seqs",
                      str(args.concurrency), "--max-model-len", str(args.max_model_len), "--log-level", "warning"]
        if args.api_server_count is not None:
            serve_argv += ["--api-server-count", str(args.api_server_count)]
        return [sys.executable, os.path.abspath(__file__), "--serve-child", "--stats-file", self.stats_file,
                *_model_flags(args), "--", *serve_argv, *args.serve_arg]

    @staticmethod
    def _environment(args) -> dict[str, str]:
        env = dict(os.environ)
        # After what is there already: the engine core imports this file (its engine factory).
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), BENCH_DIR) if p)
        for item in args.server_env:
            k, _, v = item.partition("=")
            env[k] = v
        return env

    def _read_url(self) -> None:
        deadline = time.monotonic() + 120
        for line in self.proc.stderr:
            self.log.append(line)
            m = re.search(r"serving .* on (http://\S+)", line)
            if m:
                self.url = m.group(1)
                return
            if time.monotonic() > deadline:
                break
        raise RuntimeError("server did not start:\n" + "".join(self.log))

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)

    def _wait_healthy(self) -> None:
        import httpx

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", trust_env=False, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("server never became healthy")

    def _find_core(self) -> int:
        cores = [pid for pid, (role, _) in self.cpu().items() if role == "core"]
        if len(cores) != 1:
            raise RuntimeError(f"expected one engine core under the server (pid {self.proc.pid}), found {cores}")
        return cores[0]

    def cpu(self) -> dict[int, tuple[str, float]]:
        return server_cpu(self.proc.pid)

    def counters(self) -> dict:
        """The fake device's counters, from the engine core."""
        if os.path.exists(self.stats_file):
            os.remove(self.stats_file)
        os.kill(self.core_pid, signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while not os.path.exists(self.stats_file):
            if time.monotonic() > deadline:
                raise RuntimeError("the engine core did not report the fake device's counters (is it running "
                                   "server_overhead.fake_engine?)")
            time.sleep(0.01)
        with open(self.stats_file) as f:
            return json.load(f)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # the supervisor's orderly shutdown
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.returncode != 0:
            print(f"server_overhead: the server exited with code {self.proc.returncode}; its last log lines:\n"
                  + "".join(self.log[-20:]), file=sys.stderr, flush=True)
        shutil.rmtree(self.stats_dir, ignore_errors=True)


def run_server(args, server: ServerProcess, seed: int) -> dict:
    from agent_infer.bench.serve import BenchConfig, run_benchmark

    def bench(n: int, out_len: int, s: int) -> dict:
        cfg = BenchConfig(base_url=server.url + "/v1", num_prompts=n, max_concurrency=args.concurrency,
                          random_input_len=args.input_len, random_output_len=out_len, seed=s)
        return asyncio.run(run_benchmark(cfg))

    bench(args.concurrency, 16, seed + 1000)  # warm-up: connections, code paths
    before, cpu_before, wait0 = server.counters(), server.cpu(), runqueue_wait_s(server.core_pid)
    client_cpu0, t0 = time.process_time(), time.perf_counter()
    res = bench(args.num_prompts, args.output_len, seed)
    client_cpu = time.process_time() - client_cpu0
    after, cpu_after, wait1 = server.counters(), server.cpu(), runqueue_wait_s(server.core_pid)
    if res["failed"]:
        raise RuntimeError(f"{res['failed']} requests failed: {res['errors']}")
    cpu = cpu_delta(cpu_before, cpu_after)
    return {"output_tok_s": res["output_throughput"], "wall_s": res["duration_s"], "tokens": res["total_output_tokens"],
            "ttft_ms": res["ttft_ms"]["mean"], "tpot_ms": res["tpot_ms"]["mean"], "itl_ms": res["itl_ms"]["mean"],
            "client_cpu_s": client_cpu, "engine_cpu_s": cpu.pop("core", 0.0), "process_cpu_s": cpu,
            "engine_cpu_wait_s": wait1 - wait0, **_device_delta(before, after),
            # stretches of 1 ms or more with no work in flight: (start after the run began, seconds)
            "starved_periods": [(since - t0, sec) for since, sec in after["starved"] if since >= t0 and sec >= 1e-3]}


# ---- driver --------------------------------------------------------------------------


def _model_flags(args) -> list[str]:
    return [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in FAKE_SETTINGS]


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    rest: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None,
                   help="model directory: only its config.json and tokenizer are read (default: the embedded SmolLM2)")
    p.add_argument("--concurrency", type=int, default=64, help="client concurrency = offline batch (max-num-seqs)")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--decode-ms", type=float, default=6.0, help="fake device time of a decode step at batch 64")
    p.add_argument("--decode-us-per-seq", type=float, default=17.0, help="fake decode time per sequence beyond 64")
    p.add_argument("--prefill-us-per-token", type=float, default=25.0, help="fake prefill time per prompt token")
    p.add_argument("--launch-cpu-ms", type=float, default=0.0,
                   help="host time (GIL held) of launching a step, on top of the real input building")
    p.add_argument("--prefill-launch-cpu-ms", type=float, default=0.0,
                   help="host time (GIL held) of launching a prefill step, which runs eagerly")
    p.add_argument("--launch-gil-releases", type=int, default=20,
                   help="times a launch lets go of the GIL (each PyTorch call of a real launch does)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--mode", choices=["both", "offline", "server"], default="both")
    p.add_argument("--api-server-count", type=int, default=None, metavar="N",
                   help="front-end processes of the server (`agent-infer serve --api-server-count`; default: "
                        "the server's)")
    p.add_argument("--server-env", action="append", default=[], metavar="K=V",
                   help="extra environment for the server's processes (repeatable)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="extra `agent-infer serve` argument (repeatable), e.g. --serve-arg=--api-server-count=2")
    p.add_argument("-v", "--verbose", action="store_true", help="also list the server's stretches with no work")
    p.add_argument("--json", default=None, help="write all runs as JSON here")
    p.add_argument("--serve-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--stats-file", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv), rest


def _describe(res: dict) -> str:
    """One run in a line: throughput, where the device time went, host CPU per process."""
    out = (f"{res['output_tok_s']:8.1f} tok/s  wall {res['wall_s']:.2f} s; device: busy "
           f"{res['prefill_s'] + res['decode_s']:.2f} s (prefill {res['prefill_s']:.2f} s in {res['prefill_steps']} "
           f"steps, decode {res['decode_steps']} steps at mean batch {res['decode_seqs'] / max(1, res['decode_steps']):.1f})"
           f" + late launches {res['late_s']:.3f} s + no work {res['starved_s']:.3f} s")
    engine = (f"{res['engine_cpu_s']:.2f} ({res['engine_cpu_s'] / max(1, res['steps']) * 1e3:.2f} ms/step; "
              f"waited {res['engine_cpu_wait_s']:.2f} s for a CPU)")
    if "ttft_ms" not in res:
        return out + f"  | CPU s: engine thread {engine}"
    out += f"  | TTFT {res['ttft_ms']:.0f} ms TPOT {res['tpot_ms']:.2f} ms ITL {res['itl_ms']:.2f} ms"
    others = "".join(f", {role} {sec:.2f}" for role, sec in sorted(res["process_cpu_s"].items()))
    return out + f"  | CPU s: client {res['client_cpu_s']:.2f}, core {engine}{others}"


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs) if runs else 0.0


def main(argv: list[str] | None = None) -> int:
    args, rest = parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if args.serve_child:
        return _serve_child(args, rest)
    if args.model:
        model = args.model
    else:
        from agent_infer.loader.default_model import ensure_default_model

        model = ensure_default_model()
    offline: list[dict] = []
    server_runs: list[dict] = []
    server = ServerProcess(args, model) if args.mode in ("both", "server") else None
    try:
        for r in range(args.repeats):
            if args.mode in ("both", "offline"):
                res = run_offline(args, model, seed=r)
                offline.append(res)
                print(f"offline #{r}: {_describe(res)}", flush=True)
            if server is not None:
                res = run_server(args, server, seed=r)
                server_runs.append(res)
                print(f"server  #{r}: {_describe(res)}", flush=True)
                if args.verbose:
                    print("  no work at (s after start, ms): " + (", ".join(
                        f"{t:.3f}:{sec * 1e3:.0f}" for t, sec in res["starved_periods"]) or "none of 1 ms or more"),
                        flush=True)
    finally:
        if server is not None:
            server.close()
    off, srv = _median(offline, "output_tok_s"), _median(server_runs, "output_tok_s")
    if offline:
        print(f"offline median: {off:.1f} output tok/s")
    if server_runs:
        print(f"server  median: {srv:.1f} output tok/s")
    if offline and server_runs:
        print(f"server overhead: {100 * (1 - srv / off):.1f} % (median against median)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "offline": offline, "server": server_runs}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
