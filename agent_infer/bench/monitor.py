"""Per-GPU memory and utilisation sampled in the background during a timed region,
the evidence beside every GPU figure.

Every GPU the driver shows is sampled, through NVML (`pynvml`, package nvidia-ml-py)
or, without it, one long-running `nvidia-smi -lms` process whose lines are parsed.
NVML indices follow PCI order and may differ from CUDA ordinals; names are reported
beside them. torch's own peak allocation per device is reported as well. On a machine
without a CUDA GPU nothing is sampled and the summary says so.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field

import torch

_SMI_QUERY = ["--query-gpu=index,memory.used,utilization.gpu", "--format=csv,noheader,nounits"]


@dataclass
class GpuSeries:
    index: int
    name: str = ""
    mem_mib: list[float] = field(default_factory=list)
    util_pct: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        return {
            "index": self.index,
            "name": self.name,
            "samples": len(self.mem_mib),
            "peak_memory_gib": round(max(self.mem_mib) / 1024, 3) if self.mem_mib else None,
            "mean_util_pct": round(sum(self.util_pct) / len(self.util_pct), 1) if self.util_pct else None,
            "max_util_pct": max(self.util_pct) if self.util_pct else None,
        }


class GpuMonitor:
    """`with GpuMonitor() as mon: ...timed work...` then `mon.summary()`."""

    def __init__(self, interval_s: float = 0.1):
        self.interval_s = interval_s
        self.series: dict[int, GpuSeries] = {}
        self.source = "none"
        self.note = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._t0 = self._t1 = 0.0

    # ---- lifecycle -----------------------------------------------------------------

    def __enter__(self) -> "GpuMonitor":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self._t0 = time.perf_counter()
        if not torch.cuda.is_available():
            self.note = "no CUDA GPU visible: nothing sampled"
            return
        for i in _used_devices():
            torch.cuda.reset_peak_memory_stats(i)
        if self._start_nvml():
            return
        if self._start_smi():
            return
        self.note = "neither pynvml (nvidia-ml-py) nor nvidia-smi is available: no per-GPU sampling"

    def stop(self) -> None:
        self._t1 = time.perf_counter()
        self._stop.set()
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.source == "nvml":
            try:
                import pynvml

                pynvml.nvmlShutdown()
            except Exception:  # noqa: BLE001 - shutting down a sampler must never fail the benchmark
                pass

    # ---- NVML ----------------------------------------------------------------------

    def _start_nvml(self) -> bool:
        try:
            import pynvml

            pynvml.nvmlInit()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception as e:  # noqa: BLE001 - missing package or driver: try nvidia-smi next
            self.note = f"pynvml unavailable ({type(e).__name__}: {e})"
            return False
        for i, h in enumerate(handles):
            name = pynvml.nvmlDeviceGetName(h)
            self.series[i] = GpuSeries(i, name.decode() if isinstance(name, bytes) else str(name))
        self.source = "nvml"

        def sample() -> None:
            for i, h in enumerate(handles):
                mem = pynvml.nvmlDeviceGetMemoryInfo(h).used / 2**20
                util = pynvml.nvmlDeviceGetUtilizationRates(h).gpu
                with self._lock:
                    self.series[i].mem_mib.append(float(mem))
                    self.series[i].util_pct.append(float(util))

        def loop() -> None:
            while True:
                try:
                    sample()
                except Exception:  # noqa: BLE001 - one failed read is skipped, not fatal
                    pass
                if self._stop.wait(self.interval_s):
                    break

        self._thread = threading.Thread(target=loop, name="gpu-monitor", daemon=True)
        self._thread.start()
        return True

    # ---- nvidia-smi ----------------------------------------------------------------

    def _start_smi(self) -> bool:
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return False
        ms = max(100, int(self.interval_s * 1000))
        try:
            self._proc = subprocess.Popen(
                [exe, *_SMI_QUERY, f"--loop-ms={ms}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
            )
        except OSError as e:
            self.note += f"; nvidia-smi failed to start ({e})"
            return False
        self.source = "nvidia-smi"
        proc = self._proc

        def loop() -> None:
            for line in proc.stdout:  # one line per GPU per sample, until terminated
                parsed = parse_smi_line(line)
                if parsed is None:
                    continue
                idx, mem, util = parsed
                with self._lock:
                    s = self.series.setdefault(idx, GpuSeries(idx))
                    s.mem_mib.append(mem)
                    if util is not None:
                        s.util_pct.append(util)

        self._thread = threading.Thread(target=loop, name="gpu-monitor", daemon=True)
        self._thread.start()
        return True

    # ---- results -------------------------------------------------------------------

    def summary(self) -> dict:
        out: dict = {"source": self.source, "interval_s": self.interval_s, "seconds": round(self._t1 - self._t0, 3)}
        if self.note:
            out["note"] = self.note
        with self._lock:
            out["gpus"] = [self.series[i].summary() for i in sorted(self.series)]
        out["torch_peak_allocated_gib"] = torch_peak_allocated_gib()
        return out


def parse_smi_line(line: str) -> tuple[int, float, float | None] | None:
    """'0, 81234, 97' -> (0, 81234.0, 97.0); utilisation may read '[N/A]'."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 3:
        return None
    try:
        idx, mem = int(parts[0]), float(parts[1])
    except ValueError:
        return None
    try:
        util = float(parts[2])
    except ValueError:
        util = None
    return idx, mem, util


def torch_peak_allocated_gib() -> dict[str, float]:
    """torch.cuda.max_memory_allocated of each device this process allocated on."""
    if not torch.cuda.is_available():
        return {}
    peaks = {}
    for i in _used_devices():
        peaks[f"cuda:{i}"] = round(torch.cuda.max_memory_allocated(i) / 2**30, 3)
    return peaks


def _used_devices() -> list[int]:
    """The current device and any other holding our tensors; asking about the rest could
    create a CUDA context on a GPU another TP rank owns."""
    current = torch.cuda.current_device()
    return [i for i in range(torch.cuda.device_count()) if i == current or torch.cuda.memory_allocated(i) > 0]


def format_monitor(summary: dict) -> list[str]:
    """Lines for the console."""
    if not summary.get("gpus"):
        return [f"GPU monitor: {summary.get('note') or 'no samples'}"]
    lines = [f"GPU monitor ({summary['source']}, every {summary['interval_s'] * 1000:.0f} ms, {summary['seconds']:.1f} s):"]
    for g in summary["gpus"]:
        lines.append(
            f"  gpu {g['index']} {g['name']}: peak memory {g['peak_memory_gib']} GiB, "
            f"utilisation mean {g['mean_util_pct']} % max {g['max_util_pct']} % ({g['samples']} samples)"
        )
    for dev, gib in summary.get("torch_peak_allocated_gib", {}).items():
        lines.append(f"  torch max_memory_allocated {dev}: {gib} GiB")
    return lines
