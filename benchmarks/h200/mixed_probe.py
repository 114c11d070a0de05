"""Diagnostic (GPU machine): time each engine step while a second wave of requests joins
a running wave, with and without mixed batches, and count the Triton kernel variants
compiled after start-up (the warm-up should leave none). Usage: mixed_probe.py MODEL_DIR"""

import random
import sys
import time

import torch
import triton

from agent_infer.config import EngineConfig
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.sampling_params import SamplingParams


def wave(engine: LLMEngine, rng: random.Random, n: int, tag: str) -> None:
    params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0)
    for i in range(n):
        engine.add_request("", params, request_id=f"{tag}-{i}",
                           prompt_token_ids=[rng.randrange(1000, 100000) for _ in range(256)])


def run(model: str, mixed: bool) -> None:
    engine = LLMEngine(EngineConfig(model=model, max_num_seqs=64, mixed_batches=mixed,
                                    gpu_memory_utilization=0.4,
                                    async_scheduling=False))
    rng = random.Random(0)
    COMPILED.clear()
    for rnd in range(3):
        wave(engine, rng, 32, f"a{rnd}")
        for _ in range(8):
            engine.step()
        wave(engine, rng, 32, f"b{rnd}")
        rows = []
        while engine.has_unfinished_requests():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.step()
            torch.cuda.synchronize()
            s = engine.stats
            rows.append((s.last_batch_prefill, s.last_batch_decode_rows, s.last_batch_size, s.last_batch_tokens,
                         1e3 * (time.perf_counter() - t0)))
        pre = [r for r in rows if r[0]]
        dec = [r for r in rows if not r[0]]
        print(f"mixed={mixed} round={rnd} steps={len(rows)} prefill-type: "
              + " ".join(f"[d{r[1]} s{r[2]} t{r[3]} {r[4]:.1f}ms]" for r in pre)
              + f" decode: n={len(dec)} mean={sum(r[4] for r in dec) / max(1, len(dec)):.2f}ms"
              + f" | kernels compiled since start-up: {len(COMPILED)} {sorted(set(COMPILED))}", flush=True)
    engine.shutdown()
    del engine
    torch.cuda.empty_cache()


COMPILED: list[str] = []


def on_compile(*args, **kwargs) -> bool:
    """Triton's hook before it compiles (or loads from disk) a variant not yet in memory."""
    COMPILED.append(kwargs.get("repr", "").split("[")[0])
    return False


if __name__ == "__main__":
    triton.knobs.runtime.jit_cache_hook = on_compile
    run(sys.argv[1], False)
    run(sys.argv[1], True)
