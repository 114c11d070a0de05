"""Where a throughput run's wall time went: the engine's per-step timeline (StepTrace)
summarised by step kind and decode batch size.

Each step's period (time since the previous step was read back) is charged to its band,
so the bands add up to the traced wall time. Within a period the host waited `blocked`
seconds in `runner.collect` for the device; a step blocked for less than
HOST_BOUND_BLOCKED_S found the device already done: the host was the bottleneck."""

from __future__ import annotations

from dataclasses import dataclass

from agent_infer.bench.table import render_table

HOST_BOUND_BLOCKED_S = 0.2e-3
DECODE_BANDS = ((1, 8), (9, 32), (33, 64), (65, 128), (129, 256))  # batch sizes, inclusive
_FLOAT_COLUMNS = ("t_s", "blocked_s", "period_s")


@dataclass
class StepBand:
    label: str
    steps: int = 0
    total_s: float = 0.0  # sum of the steps' periods
    blocked_s: float = 0.0  # sum of the time blocked on the device
    host_bound: int = 0  # steps blocked less than the threshold

    def add(self, period_s: float, blocked_s: float, host_bound: bool) -> None:
        self.steps += 1
        self.total_s += period_s
        self.blocked_s += blocked_s
        self.host_bound += host_bound

    def as_dict(self) -> dict:
        n = self.steps
        return {
            "band": self.label,
            "steps": n,
            "total_s": self.total_s,
            "mean_ms": self.total_s / n * 1e3 if n else None,
            "blocked_ms": self.blocked_s / n * 1e3 if n else None,
            "host_bound_share": self.host_bound / n if n else None,
        }


def band_label(prefill: bool, seqs: int) -> str:
    if prefill:
        return "prefill"
    for lo, hi in DECODE_BANDS:
        if lo <= seqs <= hi:
            return f"decode {lo}-{hi}"
    return f"decode >{DECODE_BANDS[-1][1]}"


def summarise_step_trace(columns: dict[str, list], host_bound_s: float = HOST_BOUND_BLOCKED_S) -> list[StepBand]:
    """Bands in order (prefill, then decode by batch size; the band above the largest
    only when some step is in it), then a total row."""
    bands = {label: StepBand(label) for label in ["prefill"] + [band_label(False, lo) for lo, _ in DECODE_BANDS]}
    total = StepBand("total")
    for prefill, seqs, blocked, period in zip(
        columns["prefill"], columns["seqs"], columns["blocked_s"], columns["period_s"]
    ):
        label = band_label(bool(prefill), seqs)
        host_bound = blocked < host_bound_s
        bands.setdefault(label, StepBand(label)).add(period, blocked, host_bound)
        total.add(period, blocked, host_bound)
    return [*bands.values(), total]


def trace_for_json(columns: dict[str, list]) -> dict[str, list]:
    """The trace's columns with times rounded to microseconds (a 1,000-step trace stays small)."""
    return {name: [round(v, 6) for v in values] if name in _FLOAT_COLUMNS else list(values)
            for name, values in columns.items()}


def format_step_summary(bands: list[StepBand], wall_s: float, host_bound_s: float = HOST_BOUND_BLOCKED_S) -> str:
    table = [("step band", "steps", "total s", "mean ms/step", "blocked ms/step", "host-bound")]
    for band in bands:
        d = band.as_dict()
        if not d["steps"]:
            table.append((d["band"], "0", "-", "-", "-", "-"))
            continue
        table.append((d["band"], f"{d['steps']:,}", f"{d['total_s']:,.3f}", f"{d['mean_ms']:,.3f}",
                      f"{d['blocked_ms']:,.3f}", f"{d['host_bound_share'] * 100:.1f} %"))
    note = (f"blocked: time the host waited for the device in runner.collect; host-bound: steps blocked "
            f"< {host_bound_s * 1e3:g} ms. The steps' periods cover {bands[-1].total_s:.3f} s of the {wall_s:.3f} s wall.")
    return f"{render_table(table)}\n{note}"
