"""The batch mask fill of structured outputs on this host's CPUs: 64 rows (the batch-64
case of benchmarks/structured_output.py, its schema) filled by llguidance per step, the
rows copied from one template, compiled each on its own, or spread over a pool of
independently compiled templates (what agent_infer.structured.grammar does), with 0
(a plain loop), 1, 2, 4, 8 and 12 executor threads. The figures behind
`grammar.default_shards` (docs/PERFORMANCE.md, "Structured outputs").

    python benchmarks/mask_fill.py [--tokenizer DIR] [--rows 64] [--steps 120]

Each step fills every row's mask, then advances each row by a token drawn uniformly from
its allowed set (a random model's greedy choice is as arbitrary), so the rows walk keys,
strings, numbers and enums of the schema. The default tokenizer is the embedded default
model's (SmolLM2, 49,152 tokens); masks cover 151,936 tokens, as for the Qwen3-8B shape.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from structured_output import DEFAULT_SCHEMA  # noqa: E402

from agent_infer.structured.grammar import JSON_OPTIONS  # noqa: E402

VOCAB = 151_936


def run(tok, grammar: str, how: str, threads: int, rows: int, steps: int) -> float:
    """Median ms per step of filling `rows` masks."""
    import llguidance

    if how == "copies":
        template = llguidance.LLMatcher(tok, grammar, log_level=0)
        matchers = [template.deep_copy() for _ in range(rows)]
    elif how == "fresh":
        matchers = [llguidance.LLMatcher(tok, grammar, log_level=0) for _ in range(rows)]
    else:  # a pool of `threads` templates, rows in contiguous groups per template
        pool = [llguidance.LLMatcher(tok, grammar, log_level=0) for _ in range(max(threads, 1))]
        matchers = [pool[k * len(pool) // rows].deep_copy() for k in range(rows)]
    words = (VOCAB + 31) // 32
    masks = np.zeros((rows, words), dtype=np.int32)
    executor = llguidance.LLExecutor(num_threads=threads) if threads else None
    rng = np.random.default_rng(0)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        if executor is None:
            for k, m in enumerate(matchers):
                m.unsafe_compute_mask_ptr(masks[k].ctypes.data, masks[k].nbytes)
        else:
            executor.unsafe_compute_mask_ptr([(m, k) for k, m in enumerate(matchers)], masks.ctypes.data, words * 4,
                                             rows)
        times.append(time.perf_counter() - t0)
        for k, m in enumerate(matchers):
            allowed = np.flatnonzero(np.unpackbits(masks[k].view(np.uint8), bitorder="little"))
            if not m.consume_token(int(rng.choice(allowed))):
                raise RuntimeError(f"row {k}: a token from its own mask was refused: {m.get_error()}")
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default=None, help="a Hugging Face tokenizer directory (default: the embedded model's)")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=120)
    args = ap.parse_args()
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    path = args.tokenizer
    if path is None:
        from agent_infer.loader.default_model import ensure_default_model

        path = ensure_default_model()
    tok = llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(path), n_vocab=VOCAB)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(DEFAULT_SCHEMA, defaults=JSON_OPTIONS)
    print(f"{len(os.sched_getaffinity(0))} CPUs, {args.rows} rows, median of {args.steps} steps")
    print(f"{'rows from':>16} {'threads':>7} {'ms/step':>8}")
    for how in ("copies", "fresh", "pool"):
        for threads in (0, 1, 2, 4, 8, 12):
            if how != "copies" and threads == 0:
                continue
            label = {"copies": "one template", "fresh": "own compile", "pool": "pool of threads"}[how]
            print(f"{label:>16} {threads:7d} {run(tok, grammar, how, threads, args.rows, args.steps):8.2f}", flush=True)


if __name__ == "__main__":
    main()
