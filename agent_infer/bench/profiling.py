"""`--profile DIR`: a torch.profiler trace of a few engine steps (decode steps at the
full batch, or the first steps of a batch of prompts: their prefill), and where their
GPU time goes (top CUDA kernels by total time)."""

from __future__ import annotations

import os
import time
from collections import defaultdict

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_steps(
    engine, prompts: list[list[int]], params, num_steps: int, out_dir: str, tag: str, phase: str = "decode"
) -> dict:
    """Trace `num_steps` engine steps of `prompts` on an idle engine, then abort the rest.
    phase "decode": the prompts' prefill runs untraced first, so every traced step is a
    decode step at the full batch. phase "prefill": the trace starts with the first step,
    so it holds the prompts' prefill steps (as many as their tokens need at the engine's
    token budget per step); the result counts the traced steps of each kind. Writes
    DIR/trace-TAG.json (chrome://tracing or ui.perfetto.dev)."""
    if phase not in ("prefill", "decode"):
        raise ValueError(f"phase must be 'prefill' or 'decode', not {phase!r}")
    assert not engine.has_unfinished_requests(), "profile an idle engine"
    os.makedirs(out_dir, exist_ok=True)
    ids = [engine.add_request(p, params).request_id for p in prompts]
    started: set[str] = set()

    def advance() -> None:
        for out in engine.step():
            if out.error:
                raise RuntimeError(f"profiling request rejected: {out.error}")
            if out.token_ids:
                started.add(out.request_id)

    if phase == "decode":
        while len(started) < len(ids) and engine.has_unfinished_requests():
            advance()
    _sync(engine.device)
    # The engine counts a step when it reads the step's tokens back, one step() later
    # under async scheduling; counted after the drain below, the traced prefill run's
    # deltas cover exactly the steps it launched (nothing was in flight before them).
    before = (engine.stats.prefill_steps, engine.stats.decode_steps, engine.stats.prompt_tokens)
    activities = [ProfilerActivity.CPU]
    if engine.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    steps = 0
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(num_steps):
            if not engine.has_unfinished_requests():
                break
            advance()
            steps += 1
        _sync(engine.device)
        wall = time.perf_counter() - t0
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished_requests():
        engine.step()
    # Prompt tokens the traced steps computed: fewer than the prompts hold when the prefix
    # cache served some, which would make a "prefill" trace measure little prefill.
    computed = engine.stats.prompt_tokens - before[2]
    if phase == "prefill":
        prefill_steps, decode_steps = engine.stats.prefill_steps - before[0], engine.stats.decode_steps - before[1]
    else:
        prefill_steps, decode_steps = 0, steps
    trace = os.path.join(out_dir, f"trace-{tag}.json")
    prof.export_chrome_trace(trace)
    kernels = top_kernels(prof.events())
    kernel_us = sum(k["total_us"] for k in kernels)
    busy_us = sum(k["exposed_us"] for k in kernels)
    return {
        "trace": trace,
        "phase": phase,
        "steps": steps,
        "prefill_steps": prefill_steps,
        "decode_steps": decode_steps,
        "batch": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "prompt_tokens_computed": computed,
        "wall_ms": wall * 1e3,
        "wall_ms_per_step": wall * 1e3 / max(steps, 1),
        "gpu_kernel_ms_per_step": kernel_us / 1e3 / max(steps, 1),
        "gpu_busy_ms_per_step": busy_us / 1e3 / max(steps, 1),
        "top_kernels": kernels[:15],
    }


def top_kernels(events) -> list[dict]:
    """GPU-side events (kernels, memcpy, memset) grouped by name, largest total first.

    `exposed_us` is the part of an event's time that no earlier-starting event covers:
    what it adds to the device's busy span. Under programmatic dependent launch a kernel
    starts inside its predecessor's tail, so its own duration overstates its cost to the
    step. The exposed times of all rows add up to the busy span (overlaps counted once)."""
    gpu = sorted((e for e in events if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    total: dict[str, float] = defaultdict(float)
    exposed: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    frontier = float("-inf")
    for evt in gpu:
        start, end = evt.time_range.start, evt.time_range.end
        total[evt.name] += end - start
        exposed[evt.name] += max(0.0, end - max(start, frontier))
        frontier = max(frontier, end)
        count[evt.name] += 1
    grand = sum(total.values()) or 1.0
    rows = [
        {"name": n, "calls": count[n], "total_us": t, "avg_us": t / count[n], "pct": 100.0 * t / grand,
         "exposed_us": exposed[n], "exposed_avg_us": exposed[n] / count[n]}
        for n, t in total.items()
    ]
    return sorted(rows, key=lambda r: r["total_us"], reverse=True)


def format_profile(result: dict) -> list[str]:
    steps = (f"{result['decode_steps']} decode steps" if result.get("phase", "decode") == "decode" else
             f"{result['steps']} steps from the start ({result['prefill_steps']} prefill, {result['decode_steps']} "
             f"decode; {result['prompt_tokens']} prompt tokens in all, {result['prompt_tokens_computed']} computed "
             f"in the trace)")
    lines = [
        f"profile: {steps} at batch {result['batch']}: "
        f"{result['wall_ms_per_step']:.3f} ms/step wall, {result['gpu_kernel_ms_per_step']:.3f} ms/step of GPU kernels "
        f"({result['gpu_busy_ms_per_step']:.3f} ms/step busy: overlaps counted once); "
        f"trace {result['trace']}"
    ]
    if not result["top_kernels"]:
        lines.append("  (no CUDA kernels recorded: CPU run)")
        return lines
    lines.append(f"  {'total ms':>9} {'%':>6} {'calls':>6} {'avg us':>8} {'exposed':>8}  kernel")
    for k in result["top_kernels"]:
        name = k["name"] if len(k["name"]) <= 100 else k["name"][:97] + "..."
        lines.append(f"  {k['total_us'] / 1e3:9.3f} {k['pct']:6.1f} {k['calls']:6d} {k['avg_us']:8.1f} "
                     f"{k['exposed_avg_us']:8.1f}  {name}")
    return lines
