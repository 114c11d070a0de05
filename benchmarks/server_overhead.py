"""Server overhead on CPU: `agent-infer serve` + `bench serve` against offline `generate`
at the same batch, with the model replaced by a fake device so that only the host side
(Python, the GIL, HTTP) is measured.

The fake runner keeps everything of the real engine but the forward pass: scheduler,
block manager, async scheduling (launch step N+1, then wait for step N), detokenizer,
AsyncEngine, FastAPI app and uvicorn all run for real. A launched step "runs" on a
simulated device that executes steps one after another (decode ~6 ms at batch 64,
prefill ~25 us per prompt token: offline throughput comes out like the H200 figure of
docs/PERFORMANCE.md, Qwen3-8B shape); waiting for a step's tokens sleeps until its end
with the GIL released, like waiting on a CUDA event, and a launch lets go of the GIL
--launch-gil-releases times, as every PyTorch call of a real launch does. So the engine
thread loses time where the real one does: the GIL handed back late, or host work
between two launches longer than a device step.

As in the real setup the server is a process of its own (the `agent-infer serve` code
path with the fake runner patched in) and the load generator (agent_infer/bench/serve.py)
runs in this one; offline runs `LLMEngine.generate` on the same fake here. Each run
prints where the device time went: busy, "late launches" (the device had finished and
the next step was not launched yet) and "no work" (nothing in flight: requests had not
arrived), and the CPU seconds of the client, the event loop and the engine thread.

    .venv/bin/python benchmarks/server_overhead.py                   # offline and server, 3 repeats each
    .venv/bin/python benchmarks/server_overhead.py --mode server -v  # also list the stretches with no work
    .venv/bin/python benchmarks/server_overhead.py --serve-arg=--switch-interval-ms=1
    PYTHONPATH=/path/to/other/checkout .venv/bin/python benchmarks/server_overhead.py   # another version

Results are noisy on a small machine, and anything else running on it shows: repeat,
and compare versions in alternation. A benchmark, not a test: ~10 s per run and mode.
"""

from __future__ import annotations

import argparse
import asyncio
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
        from agent_infer.engine.model_runner import build_host_step

        return build_host_step(batch, self.block_size)  # the real host-side input building

    def launch(self, step, sampling_seqs):
        # Host cost with the GIL held: a decode step replays a graph; a prefill step runs
        # eagerly, every kernel launched from Python.
        cpu_s = self.prefill_launch_cpu_s if step.is_prefill else self.launch_cpu_s
        if cpu_s:
            end = time.perf_counter() + cpu_s
            while time.perf_counter() < end:
                pass
        # Every PyTorch call of a real launch (input copies, graph replay, sampler kernels,
        # the copy back) lets go of the GIL for a moment: a chance for a busy event loop to
        # take it, after which this thread waits for it to be handed back.
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


def install_fake_runner(args) -> FakeDevice:
    """Make every LLMEngine built from now on use a FakeRunner (no weights, no KV cache)."""
    from agent_infer.engine import llm_engine
    from agent_infer.engine.runner_setup import RunnerPlan, resolve_max_model_len

    device = FakeDevice(args.decode_ms, args.decode_us_per_seq, args.prefill_us_per_token)

    def setup_runner(config, model_config, dev, dtype, tp):
        max_model_len = resolve_max_model_len(config, model_config)
        blocks = config.max_num_seqs * -(-max_model_len // config.block_size) + 64
        runner = FakeRunner(device, config.block_size, args.launch_cpu_ms, args.launch_gil_releases,
                            args.prefill_launch_cpu_ms)
        return runner, RunnerPlan(blocks, max_model_len)

    llm_engine.setup_runner = setup_runner
    return device


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

    device = install_fake_runner(args)
    engine = LLMEngine(EngineConfig(model=model, device="cpu", max_num_seqs=args.concurrency,
                                    max_model_len=args.max_model_len))
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    engine.generate(make_prompts(args, seed + 1000)[: args.concurrency], params)  # warm-up
    prompts = make_prompts(args, seed)
    before = device.counters()
    cpu0, t0 = time.thread_time(), time.perf_counter()
    outs = engine.generate(prompts, params)
    wall, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
    tokens = sum(len(o.token_ids) for o in outs)
    return {"output_tok_s": tokens / wall, "wall_s": wall, "tokens": tokens, "engine_cpu_s": cpu,
            **_device_delta(before, device.counters())}


def _device_delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in FakeDevice(0, 0, 0).c}


# ---- server --------------------------------------------------------------------------


def _serve_child(args, argv: list[str]) -> int:
    """In the server process: the `agent-infer serve` code path on the fake runner.
    SIGUSR1 writes the fake device's counters to --stats-file."""
    device = install_fake_runner(args)

    def dump(signum, frame):
        with open(args.stats_file + ".tmp", "w") as f:
            json.dump({**device.counters(), "cpu_s": _thread_cpu_seconds(), "starved": device.starved[-500:]}, f)
        os.replace(args.stats_file + ".tmp", args.stats_file)

    signal.signal(signal.SIGUSR1, dump)
    if args.child_switch_interval_ms is not None:  # set before serving (a serve flag would override it)
        sys.setswitchinterval(args.child_switch_interval_ms / 1e3)
    from agent_infer.server.cli import main

    return main(argv)


def _thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) used so far by each Python thread of this process."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for t in threading.enumerate():
        try:
            with open(f"/proc/self/task/{t.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[t.name] = (int(fields[11]) + int(fields[12])) / tick
    return out


class ServerProcess:
    def __init__(self, args, model: str):
        self.stats_dir = tempfile.mkdtemp(prefix="server-overhead-")
        self.stats_file = os.path.join(self.stats_dir, "counters.json")
        serve_argv = ["--model", model, "--device", "cpu", "--port", "0", "--max-num-seqs", str(args.concurrency),
                      "--max-model-len", str(args.max_model_len), "--log-level", "warning", *args.serve_arg]
        cmd = [sys.executable, os.path.abspath(__file__), "--serve-child", "--stats-file", self.stats_file,
               *_model_flags(args), "--", *serve_argv]
        if args.child_switch_interval_ms is not None:
            cmd[3:3] = ["--child-switch-interval-ms", str(args.child_switch_interval_ms)]
        env = dict(os.environ)
        for item in args.server_env:
            k, _, v = item.partition("=")
            env[k] = v
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
        self.url = None
        self.log: list[str] = []
        deadline = time.monotonic() + 120
        for line in self.proc.stderr:
            self.log.append(line)
            m = re.search(r"serving .* on (http://\S+)", line)
            if m:
                self.url = m.group(1)
                break
            if time.monotonic() > deadline:
                break
        if self.url is None:
            self.close()
            raise RuntimeError("server did not start:\n" + "".join(self.log))
        threading.Thread(target=self._drain, daemon=True).start()
        self._wait_healthy()

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

    def counters(self) -> dict:
        if os.path.exists(self.stats_file):
            os.remove(self.stats_file)
        self.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while not os.path.exists(self.stats_file):
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not report its counters")
            time.sleep(0.01)
        with open(self.stats_file) as f:
            return json.load(f)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.stats_dir, ignore_errors=True)


def run_server(args, server: ServerProcess, seed: int) -> dict:
    from agent_infer.bench.serve import BenchConfig, run_benchmark

    def bench(n: int, out_len: int, s: int) -> dict:
        cfg = BenchConfig(base_url=server.url + "/v1", num_prompts=n, max_concurrency=args.concurrency,
                          random_input_len=args.input_len, random_output_len=out_len, seed=s)
        return asyncio.run(run_benchmark(cfg))

    bench(args.concurrency, 16, seed + 1000)  # warm-up: connections, code paths
    before = server.counters()
    client_cpu0, t0 = time.process_time(), time.perf_counter()
    res = bench(args.num_prompts, args.output_len, seed)
    client_cpu = time.process_time() - client_cpu0
    after = server.counters()
    if res["failed"]:
        raise RuntimeError(f"{res['failed']} requests failed: {res['errors']}")
    cpu = {name: sec - before["cpu_s"].get(name, 0.0) for name, sec in after["cpu_s"].items()}
    return {"output_tok_s": res["output_throughput"], "wall_s": res["duration_s"], "tokens": res["total_output_tokens"],
            "ttft_ms": res["ttft_ms"]["mean"], "tpot_ms": res["tpot_ms"]["mean"], "itl_ms": res["itl_ms"]["mean"],
            "client_cpu_s": client_cpu, "loop_cpu_s": cpu.get("MainThread", 0.0),
            "engine_cpu_s": cpu.get("agent-infer-engine", 0.0), **_device_delta(before, after),
            # stretches of 1 ms or more with no work in flight: (start after the run began, seconds)
            "starved_periods": [(since - t0, sec) for since, sec in after["starved"] if since >= t0 and sec >= 1e-3]}


# ---- driver --------------------------------------------------------------------------


def _model_flags(args) -> list[str]:
    return ["--decode-ms", str(args.decode_ms), "--decode-us-per-seq", str(args.decode_us_per_seq),
            "--prefill-us-per-token", str(args.prefill_us_per_token), "--launch-cpu-ms", str(args.launch_cpu_ms),
            "--prefill-launch-cpu-ms", str(args.prefill_launch_cpu_ms),
            "--launch-gil-releases", str(args.launch_gil_releases)]


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
    p.add_argument("--server-env", action="append", default=[], metavar="K=V",
                   help="extra environment for the server process (repeatable)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="extra `agent-infer serve` argument (repeatable), e.g. --serve-arg=--switch-interval-ms=1")
    p.add_argument("--child-switch-interval-ms", type=float, default=None,
                   help="sys.setswitchinterval in the server process before it starts serving (for servers "
                        "without --switch-interval-ms; a serve flag or default overrides it)")
    p.add_argument("-v", "--verbose", action="store_true", help="also list the server's stretches with no work")
    p.add_argument("--json", default=None, help="write all runs as JSON here")
    p.add_argument("--serve-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--stats-file", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv), rest


def _describe(res: dict) -> str:
    """One run in a line: throughput, where the device time went, host CPU per thread."""
    out = (f"{res['output_tok_s']:8.1f} tok/s  wall {res['wall_s']:.2f} s; device: busy "
           f"{res['prefill_s'] + res['decode_s']:.2f} s (prefill {res['prefill_s']:.2f} s in {res['prefill_steps']} "
           f"steps, decode {res['decode_steps']} steps at mean batch {res['decode_seqs'] / max(1, res['decode_steps']):.1f})"
           f" + late launches {res['late_s']:.3f} s + no work {res['starved_s']:.3f} s")
    if "ttft_ms" in res:
        out += f"  | TTFT {res['ttft_ms']:.0f} ms TPOT {res['tpot_ms']:.2f} ms ITL {res['itl_ms']:.2f} ms"
        out += f"  | CPU s: client {res['client_cpu_s']:.2f}, loop {res['loop_cpu_s']:.2f},"
    else:
        out += "  | CPU s:"
    return out + f" engine {res['engine_cpu_s']:.2f} ({res['engine_cpu_s'] / max(1, res['steps']) * 1e3:.2f} ms/step)"


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
                    print("  no work at (s after start, ms): " + ", ".join(
                        f"{t:.3f}:{sec * 1e3:.0f}" for t, sec in res["starved_periods"]), flush=True)
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
