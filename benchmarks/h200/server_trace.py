"""Diagnostic (GPU machine): `agent-infer serve ARGS...` with the engine's step launches,
step read-backs and request arrivals time-stamped; the events go to $TRACE_OUT as JSON
every second (uvicorn ends the process by re-raising SIGTERM, so no exit hook runs), for
`analyze` below. Where the server's throughput goes between waves of
requests: device idle with no work queued vs work queued but not launched.

    TRACE_OUT=/tmp/t.json python3 benchmarks/h200/server_trace.py --model M --port 8011 &
    ... load ...; kill %1
    python3 benchmarks/h200/server_trace.py analyze /tmp/t.json [FIRST]

FIRST: the index of the first request to look at (20 skips the server's start-up
warm-up requests, engine/warmup.py).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time


def install(out_path: str) -> None:
    from agent_infer.engine import llm_engine as le

    events: list[tuple] = []
    launch, resolve, add = le.LLMEngine._launch, le.LLMEngine._resolve, le.LLMEngine.add_request

    def traced_launch(self, batch):
        t = time.perf_counter()
        r = launch(self, batch)
        events.append(("launch", t, time.perf_counter(), batch.is_prefill, len(batch), batch.num_tokens,
                       batch.num_decode, len(self.scheduler.waiting)))
        return r

    def traced_resolve(self):
        t = time.perf_counter()
        r = resolve(self)
        events.append(("resolve", t, time.perf_counter()))
        return r

    def traced_add(self, *args, **kwargs):
        t = time.perf_counter()
        r = add(self, *args, **kwargs)
        events.append(("add", t, time.perf_counter()))
        return r

    le.LLMEngine._launch, le.LLMEngine._resolve, le.LLMEngine.add_request = traced_launch, traced_resolve, traced_add
    def dump_every_second() -> None:
        written = 0
        while True:
            time.sleep(1.0)
            if len(events) != written:
                written = len(events)
                with open(out_path + ".tmp", "w") as f:
                    json.dump(events[:written], f)
                os.replace(out_path + ".tmp", out_path)

    threading.Thread(target=dump_every_second, daemon=True).start()


def analyze(path: str, first: int = 0) -> None:
    """Print the stretches between a step's read-back and the next launch longer than
    5 ms, with the requests that arrived in them, the host time of each prefill launch,
    and the totals; from the `first`-th request's arrival on."""
    events = sorted(json.load(open(path)), key=lambda e: e[1])
    start = sorted(e[1] for e in events if e[0] == "add")[first]
    events = [e for e in events if e[1] >= start - 1e-3]
    launches = [e for e in events if e[0] == "launch"]
    adds = [e[1] for e in events if e[0] == "add"]
    t0 = launches[0][1]
    in_flight, last_done, idle, gaps = 0, None, 0.0, []
    for e in events:
        if e[0] == "launch":
            if in_flight == 0 and last_done is not None:
                gap = e[1] - last_done
                idle += gap
                if gap > 0.005:
                    n = sum(last_done <= a < e[1] for a in adds)
                    gaps.append((last_done - t0, gap, n, e[3], e[4], e[5]))
            in_flight += 1
        elif e[0] == "resolve":
            in_flight -= 1
            last_done = e[2]
    span = launches[-1][2] - t0
    for start, gap, n, pre, seqs, toks in gaps:
        print(f"t={start:7.3f}s  nothing in flight {gap * 1e3:7.1f} ms  ({n} requests arrived; next: "
              f"{'prefill' if pre else 'decode'} {seqs} seqs {toks} tokens)")
    steps = len(launches)
    prefill_ms = [1e3 * (e[2] - e[1]) for e in launches if e[3]]
    decode_ms = [1e3 * (e[2] - e[1]) for e in launches if not e[3]]
    print(f"span {span:.3f} s, {steps} steps, nothing in flight {idle:.3f} s ({100 * idle / span:.1f} %), "
          f"{len(adds)} requests")
    print("prefill launches, host ms (sequences): "
          + " ".join(f"{1e3 * (e[2] - e[1]):.0f}({e[4]})" for e in launches if e[3]))
    print(f"host time in launches: {len(prefill_ms)} prefill {sum(prefill_ms):.0f} ms (max {max(prefill_ms, default=0):.0f}), "
          f"{len(decode_ms)} decode {sum(decode_ms):.0f} ms (max {max(decode_ms, default=0):.1f})")


if __name__ == "__main__":
    if sys.argv[1:2] == ["analyze"]:
        analyze(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 0)
    else:
        install(os.environ["TRACE_OUT"])
        from agent_infer.cli import main

        sys.exit(main(["serve", *sys.argv[1:]]))
