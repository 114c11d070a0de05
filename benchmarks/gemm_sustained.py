"""Sustained bf16 GEMM throughput on one GPU: one prefill-sized layer's four Qwen3-8B
GEMMs (M = 8,192) back to back for a number of seconds, the achieved TFLOP/s printed per
half second beside the SM clock and board power (NVML). A short benchmark measures the
GPU's boost; a long run (the throughput workload's 3.5 s of prefill) meets its power
limit.

    python benchmarks/gemm_sustained.py [--seconds 10] [--rows 8192]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

# Qwen3-8B: (N, K) of qkv, o, gate_up, down.
SHAPES = ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rows", type=int, default=8192)
    args = parser.parse_args()
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    dev, dt, m = "cuda", torch.bfloat16, args.rows
    ws = [torch.randn(n, k, dtype=dt, device=dev) * k**-0.5 for n, k in SHAPES]
    xs = [torch.randn(m, k, dtype=dt, device=dev) for _, k in SHAPES]
    flops = sum(2 * m * n * k for n, k in SHAPES)
    print(torch.cuda.get_device_name(0), f"M={m}, one layer's four GEMMs = {flops / 1e12:.3f} TFLOP")
    start = time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        t0, e0 = time.perf_counter(), torch.cuda.Event(enable_timing=True)
        e1 = torch.cuda.Event(enable_timing=True)
        e0.record()
        n = 0
        while time.perf_counter() - t0 < 0.5:
            for x, w in zip(xs, ws):
                F.linear(x, w)
            n += 1
            if n % 8 == 0:
                torch.cuda.synchronize()
        e1.record()
        e1.synchronize()
        ms = e0.elapsed_time(e1)
        clock = pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)
        power = pynvml.nvmlDeviceGetPowerUsage(handle) / 1000
        temp = pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
        print(f"  t={time.perf_counter() - start:5.1f} s: {n * flops / ms / 1e9:6.0f} TFLOP/s, SM clock {clock} MHz, "
              f"{power:5.0f} W, {temp} C", flush=True)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
