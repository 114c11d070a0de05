"""`--profile DIR`: a torch.profiler trace of a few decode steps, and where their GPU
time goes (top CUDA kernels by total time)."""

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


def profile_decode(engine, prompts: list[list[int]], params, num_steps: int, out_dir: str, tag: str) -> dict:
    """Prefill `prompts` unprofiled, trace `num_steps` decode steps, then abort the rest.
    Writes DIR/trace-TAG.json (chrome://tracing or ui.perfetto.dev)."""
    os.makedirs(out_dir, exist_ok=True)
    ids = [engine.add_request(p, params).request_id for p in prompts]
    started: set[str] = set()
    while len(started) < len(ids) and engine.has_unfinished_requests():
        for out in engine.step():
            if out.error:
                raise RuntimeError(f"profiling request rejected: {out.error}")
            if out.token_ids:
                started.add(out.request_id)
    _sync(engine.device)
    activities = [ProfilerActivity.CPU]
    if engine.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    steps = 0
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(num_steps):
            if not engine.has_unfinished_requests():
                break
            engine.step()
            steps += 1
        _sync(engine.device)
        wall = time.perf_counter() - t0
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished_requests():
        engine.step()
    trace = os.path.join(out_dir, f"trace-{tag}.json")
    prof.export_chrome_trace(trace)
    kernels = top_kernels(prof.events())
    busy_us = sum(k["total_us"] for k in kernels)
    return {
        "trace": trace,
        "decode_steps": steps,
        "batch": len(prompts),
        "wall_ms": wall * 1e3,
        "wall_ms_per_step": wall * 1e3 / max(steps, 1),
        "gpu_kernel_ms_per_step": busy_us / 1e3 / max(steps, 1),
        "top_kernels": kernels[:15],
    }


def top_kernels(events) -> list[dict]:
    """GPU-side events (kernels, memcpy, memset) grouped by name, largest total first."""
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for evt in events:
        if evt.device_type != DeviceType.CUDA:
            continue
        total[evt.name] += evt.time_range.end - evt.time_range.start
        count[evt.name] += 1
    grand = sum(total.values()) or 1.0
    rows = [
        {"name": n, "calls": count[n], "total_us": t, "avg_us": t / count[n], "pct": 100.0 * t / grand}
        for n, t in total.items()
    ]
    return sorted(rows, key=lambda r: r["total_us"], reverse=True)


def format_profile(result: dict) -> list[str]:
    lines = [
        f"profile: {result['decode_steps']} decode steps at batch {result['batch']}: "
        f"{result['wall_ms_per_step']:.3f} ms/step wall, {result['gpu_kernel_ms_per_step']:.3f} ms/step of GPU kernels; "
        f"trace {result['trace']}"
    ]
    if not result["top_kernels"]:
        lines.append("  (no CUDA kernels recorded: CPU run)")
        return lines
    lines.append(f"  {'total ms':>9} {'%':>6} {'calls':>6} {'avg us':>8}  kernel")
    for k in result["top_kernels"]:
        name = k["name"] if len(k["name"]) <= 100 else k["name"][:97] + "..."
        lines.append(f"  {k['total_us'] / 1e3:9.3f} {k['pct']:6.1f} {k['calls']:6d} {k['avg_us']:8.1f}  {name}")
    return lines
