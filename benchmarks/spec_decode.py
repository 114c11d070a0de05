"""Speculative decoding, measured.

  verify  what a verify step costs next to a plain decode step, at batch 1, for k = 1..8
          draft tokens (drafts that are always rejected: the step's own cost, one token
          out); with --random-weights qwen3-8b on a GPU, the issue's Qwen3-8B shape;
          --profile 0 1 4 then shows where each step's device time goes.
  agent   the agent-like workload on the default model's real weights: source files of
          this repository given in the prompt and asked back with one change. Tokens/s at
          batch 1 and 8 with and without prompt lookup, acceptance per draft position,
          and whether the greedy texts are identical. The engines live side by side and
          take each group of prompts in turn, so a drift in the host's pace falls on all
          of them; --compare-chain adds one that reads every verify step back before the
          next is launched; --host-profile N then profiles the host's work (cProfile) over
          N prompts at batch 1, plain and with drafts, to show what a verify step adds.
  mtp     DeepSeek-V3's MTP layer: a plain step, a verify step with its draft (and the
          draft layer's own pass), and a step of MTP mode with drafting off (the draft
          layer's pass alone) on --random-weights deepseek-v3-small.

Prints a table last; --output-json keeps the figures. Runs on CPU too (slowly).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import statistics
import sys
import time
from dataclasses import replace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from agent_infer.bench.step_trace import HOST_BOUND_BLOCKED_S, StepBand  # noqa: E402
from agent_infer.config import EngineConfig  # noqa: E402
from agent_infer.engine.llm_engine import LLMEngine  # noqa: E402
from agent_infer.sampling_params import SamplingParams  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def model_path(args) -> str:
    if args.random_weights:
        from agent_infer.bench.random_weights import ensure_random_model

        return ensure_random_model(args.random_weights)
    if args.model:
        return args.model
    from agent_infer.loader.default_model import ensure_default_model

    return ensure_default_model()


def engine(args, path: str, chain: bool | None = None, **kw) -> LLMEngine:
    """An engine of the benchmark; `chain`: whether a step may be launched before the
    verify step in flight is read back (None: the engine's default)."""
    config = EngineConfig(model=path, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
                          **{"batch_invariant": args.batch_invariant, **kw})
    if config.resolve_device().type == "cuda":
        # Two engines live side by side (plain and speculative): a fixed KV cache each,
        # where the default would give the first one nearly all of the GPU.
        config = replace(config, kv_cache_bytes=4 << 30)
    if chain is not None:
        config = replace(config, speculative_config=replace(config.speculative_config, chain_verify_steps=chain))
    return LLMEngine(config)


class FixedDrafts:
    """k drafts every step that the target never agrees with (token ids off its path)."""

    def __init__(self, k: int, vocab: int):
        self.k, self.vocab, self.n = k, vocab, 0

    def propose(self, request_id, prompt, tokens_at, total, k, known=None):
        # Behind a row in flight (`known` given) the engine drafts what follows the run's
        # first token, its guess of that row's own token.
        self.n += 1
        return [(7919 * (self.n + i)) % self.vocab for i in range(min(k, self.k + (known is not None)))]

    def after_step(self, batch, row_drafts):
        pass

    def forget(self, request_id):
        pass


def time_steps(eng: LLMEngine, prompt_len: int, steps: int) -> float:
    """Median wall time of a decode step of one request, prefill excluded."""
    eng.add_request(list(range(100, 100 + prompt_len)), SamplingParams(max_tokens=steps + 2, temperature=0,
                                                                     ignore_eos=True))
    eng.step()  # prefill
    times = []
    while eng.has_unfinished_requests():
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:-2] or times)


def force_drafting(eng: LLMEngine) -> None:
    eng.draft_policy.batch_drafts = lambda num_decoding: True
    eng.draft_policy.may_draft = lambda request_id, length: True


def cmd_verify(args) -> tuple[list[tuple], dict]:
    path = model_path(args)
    eng = engine(args, path, max_num_seqs=1, speculative_config={"method": "ngram", "num_speculative_tokens": 8,
                                                                 "prompt_lookup_max": 2, "prompt_lookup_min": 1})
    force_drafting(eng)
    vocab = eng.model_config.vocab_size
    ks = [0] + list(range(1, 9))
    for k in ks:  # warm-up of each shape
        eng.drafter = FixedDrafts(k, vocab)
        time_steps(eng, args.prompt_len, 8)
    # Rounds over every k, so that a drift of the GPU's or the host's pace within the run
    # falls on all of them, not on the plain step every ratio divides by.
    times: dict[int, list[float]] = {k: [] for k in ks}
    for _ in range(args.repeats):
        for k in ks:
            eng.drafter = FixedDrafts(k, vocab)
            times[k].append(time_steps(eng, args.prompt_len, args.steps))
    results = {k: statistics.median(times[k]) for k in ks}
    base = results[0]
    rows = [(f"k = {k}" if k else "plain decode step", results[k] * 1e3, results[k] / base) for k in results]
    payload = {"model": path, "step_s": results}
    if args.profile:
        payload["kernels_us_per_step"] = profile_verify_steps(eng, vocab, args.profile, args.prompt_len, args.steps)
    return [("step", "ms", "x plain")] + rows, payload


def profile_verify_steps(eng: LLMEngine, vocab: int, ks: list[int], prompt_len: int, steps: int) -> dict:
    """Where a step's device time goes at each k of `ks`: kernels grouped by name, each
    with the time it adds past every kernel started before it (`bench.profiling`), per
    decode step of one request's run (its prefill included, a few µs a step). Prints the
    table; returns {k: {kernel: µs a step}}."""
    from torch.profiler import ProfilerActivity, profile

    from agent_infer.bench.profiling import top_kernels

    per_step = {}
    for k in ks:
        eng.drafter = FixedDrafts(k, vocab)
        gpu = [ProfilerActivity.CUDA] if eng.device.type == "cuda" else []  # on a CPU: no kernels, an empty table
        with profile(activities=[ProfilerActivity.CPU, *gpu]) as prof:
            time_steps(eng, prompt_len, steps)
        per_step[k] = {r["name"]: r["exposed_us"] / steps for r in top_kernels(prof.events())}
    names = sorted(set().union(*per_step.values()), key=lambda n: -max(per_step[k].get(n, 0.0) for k in ks))
    print(f"{'kernel (us a step, exposed)':60s}" + "".join(f"{'k = ' + str(k):>10s}" for k in ks))
    print(f"{'all':60s}" + "".join(f"{sum(per_step[k].values()):10.1f}" for k in ks))
    for name in names[:16]:
        print(f"{name[:60]:60s}" + "".join(f"{per_step[k].get(name, 0.0):10.1f}" for k in ks))
    return per_step


def agent_prompts(eng: LLMEngine, n: int, max_chars: int) -> list[list[int]]:
    """Chat prompts: a source file of this repository, asked back with one change."""
    from agent_infer.loader.tokenizer import ChatFormatter

    files = sorted(glob.glob(os.path.join(REPO, "agent_infer", "**", "*.py"), recursive=True))
    files = [f for f in files if os.path.getsize(f) > max_chars // 2][:n]
    fmt = ChatFormatter(eng.tokenizer)
    prompts = []
    for f in files:
        src = open(f).read()[:max_chars]
        src = src[: src.rfind("\n") + 1]
        ask = (f"Here is the start of {os.path.relpath(f, REPO)}:\n\n```python\n{src}```\n\nWrite it out again "
               "exactly, with one change: put the line `# reviewed` at the very top. Reply with the code only.")
        text = fmt.render([{"role": "user", "content": ask}])
        prompts.append(eng.tokenizer.encode(text, add_special_tokens=False))
    return prompts


def run_agent(engines: list[LLMEngine], prompts, batch: int, max_tokens: int) -> list[tuple[float, list[list[int]]]]:
    """Each group of `batch` prompts through every engine in turn, the order rotating from
    group to group: (tok/s, token ids per prompt) for each engine."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    n = len(engines)
    outs, tokens, wall = [[] for _ in engines], [0] * n, [0.0] * n
    for g, i in enumerate(range(0, len(prompts), batch)):
        for e in [(g + j) % n for j in range(n)]:
            t0 = time.perf_counter()
            got = engines[e].generate(prompts[i : i + batch], params)
            wall[e] += time.perf_counter() - t0
            tokens[e] += sum(len(o.token_ids) for o in got)
            outs[e] += [o.token_ids for o in got]
    return [(tokens[e] / wall[e], outs[e]) for e in range(n)]


def cmd_agent(args) -> tuple[list[tuple], dict]:
    path = model_path(args)
    plain = engine(args, path, max_num_seqs=8)
    config = {**NGRAM, "num_speculative_tokens": args.num_speculative_tokens}
    specs = {"spec": engine(args, path, False if args.no_chain else None, max_num_seqs=8, speculative_config=config)}
    if args.compare_chain:
        specs["spec, no chaining"] = engine(args, path, False, max_num_seqs=8, speculative_config=config)
    # With --batch-invariant, the default engine's plain decoding too: the mode's own plain
    # decoding is slower, so its speed-up alone would flatter the drafts.
    anchor = engine(args, path, max_num_seqs=8, batch_invariant=False) if args.batch_invariant else None
    prompts = agent_prompts(plain, args.num_prompts, args.max_chars)
    for eng in [plain, *specs.values(), *([anchor] if anchor else [])]:
        run_agent([eng], prompts[:1], 1, 16)  # warm-up
    for spec in specs.values():
        if args.force_drafting:
            force_drafting(spec)
        spec.draft_policy.stats.__init__()
    # "plain = first": plain decoding's text at this batch size against its text at the
    # first one, the variation that batch shapes alone give (bf16 rounding differs with the
    # number of rows; speculation's verify rows are such a change too).
    head = ["batch", "tok/s plain"]
    for name in specs:
        head += [f"tok/s {name}", "speed-up", "identical"]
    if anchor:
        head += ["tok/s plain, default engine", "spec / that"]
    rows = [tuple(head + ["plain = first"])]
    # The prompts quote this checkout's files, so an edit to one changes the workload: the
    # digest of their token ids tells whether two runs' prompts were the same.
    digest = hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:12]
    payload = {"model": path, "dtype": args.dtype, "k": args.num_speculative_tokens, "prompt_digest": digest}
    first = None
    step_rows = [("prompts: digest of their token ids", digest, "", "")]
    for batch in args.batches:
        engines = [plain, *specs.values(), *([anchor] if anchor else [])]
        names = ["plain", *specs, *(["plain, default engine"] if anchor else [])]
        for eng in engines:
            eng.stats.start_trace()
        kept0 = {name: _kept_plain(spec) for name, spec in specs.items()}
        (rate_p, out_p), *spec_runs = run_agent(engines, prompts, batch, args.max_tokens)
        steps = {name: step_kinds(eng.stats.stop_trace()) for name, eng in zip(names, engines)}
        first = first or out_p
        stable = sum(a == b for a, b in zip(out_p, first))
        row, result = [batch, rate_p], {"plain_tok_s": rate_p, "plain_same_as_first_batch": stable}
        for name, (rate_s, out_s) in zip(specs, spec_runs):
            same = sum(a == b for a, b in zip(out_p, out_s))
            row += [rate_s, rate_s / rate_p, f"{same}/{len(prompts)}"]
            key = _json_key(name)
            result |= {f"{key}_tok_s": rate_s, f"{key}_identical": same}
        if anchor:
            rate_a = spec_runs[len(specs)][0]
            row += [rate_a, spec_runs[0][0] / rate_a]
            result |= {"plain_default_engine_tok_s": rate_a}
        rows.append(tuple(row + [f"{stable}/{len(prompts)}"]))
        result["steps"] = steps
        payload[f"batch_{batch}"] = result
        step_rows += [(f"batch {batch}, {name}: {kind} steps", f"{d['steps']}", f"{d['mean_ms']:.3f} ms",
                       f"blocked {d['blocked_ms']:.3f} ms") for name, kinds in steps.items()
                      for kind, d in kinds.items() if d["steps"]]
        for name, spec in specs.items():
            # The steps the batch rule kept plain (drafting did not pay by its timings) and
            # what it compared, at this batch size's bucket.
            rule = spec.draft_policy.batch_rule().get(1 << (batch.bit_length() - 1))
            kept = _kept_plain(spec) - kept0[name]
            result[f"{_json_key(name)}_kept_plain_by_batch_rule"] = kept
            if rule:
                step_rows.append((f"batch {batch}, {name}: kept plain by the batch rule", f"{kept}",
                                  _ms(rule["plain_ms"]) + " plain", _ms(rule["drafting_ms"]) + " drafting, "
                                  f"{rule['tokens_per_row']:.2f} tokens a row"))
    for name, spec in specs.items():
        s = spec.draft_policy.stats
        per_pos = [a / s.num_drafts for a in s.accepted_per_pos] if s.num_drafts else []
        payload[_json_key(name)] = {"acceptance_per_position": per_pos,
                                    "tokens_per_verify_row": s.mean_acceptance_length,
                                    "chained_rows": s.num_chained_rows}
        step_rows += [(f"{name}: acceptance by position", " / ".join(f"{a:.2f}" for a in per_pos), "", ""),
                      (f"{name}: tokens per verify row", s.mean_acceptance_length, "", ""),
                      (f"{name}: chained verify rows", f"{s.num_chained_rows}", "", "")]
    if args.host_profile:
        for name, eng in [("plain", plain), *specs.items()]:
            host_profile(name, eng, prompts[: args.host_profile], args.max_tokens)
    width = len(rows[0])
    return rows + [tuple(list(r) + [""] * (width - len(r))) for r in step_rows], payload


def host_profile(name: str, eng: LLMEngine, prompts: list[list[int]], max_tokens: int, top: int = 25) -> None:
    """The host's own time by function (cProfile's tottime) over `prompts` at batch 1: on
    a GPU the device's share shows as the wait for read-back, the rest is what the host
    spends on a step (cProfile slows Python code alike in both engines, so compare the
    two lists, not absolute figures)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    steps = eng.stats.steps
    prof.enable()
    run_agent([eng], prompts, 1, max_tokens)
    prof.disable()
    print(f"\n== host profile, {name}: {len(prompts)} prompts at batch 1, {eng.stats.steps - steps} steps")
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def _kept_plain(eng: LLMEngine) -> int:
    return sum(r["kept_plain"] for r in eng.draft_policy.batch_rule().values())


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} ms"


def _json_key(name: str) -> str:
    """An engine's name ("spec, no chaining") as a JSON key ("spec_no_chaining")."""
    return name.replace(", ", "_").replace(" ", "_")


def step_kinds(trace) -> dict[str, dict]:
    """The speculating engine's decode steps split into verify steps (some row carried
    drafts) and plain ones, each a StepBand: how many, their mean period (read-back to
    read-back) and the mean time the host waited on the device for them."""
    kinds = {"verify": StepBand("verify"), "plain": StepBand("plain")}
    for prefill, seqs, tokens, blocked, period in zip(trace.prefill, trace.seqs, trace.tokens, trace.blocked_s,
                                                      trace.period_s):
        if not prefill:
            kinds["verify" if tokens > seqs else "plain"].add(period, blocked, blocked < HOST_BOUND_BLOCKED_S)
    return {name: band.as_dict() for name, band in kinds.items()}


def cmd_mtp(args) -> tuple[list[tuple], dict]:
    path = model_path(args)
    plain = engine(args, path, max_num_seqs=1)
    spec = engine(args, path, max_num_seqs=1, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    force_drafting(spec)
    for e in (plain, spec):
        time_steps(e, args.prompt_len, 8)
    t_plain = statistics.median(time_steps(plain, args.prompt_len, args.steps) for _ in range(args.repeats))
    t_spec = statistics.median(time_steps(spec, args.prompt_len, args.steps) for _ in range(args.repeats))
    s = spec.draft_policy.stats
    drafts = s.num_drafts
    # What MTP mode costs where the policy drafts nothing: its steps still run the draft
    # layer (its K/V must stay whole) and are read back one at a time.
    spec.draft_policy.batch_drafts = lambda num_decoding: False
    t_off = statistics.median(time_steps(spec, args.prompt_len, args.steps) for _ in range(args.repeats))
    rows = [("step", "ms", "x plain"), ("plain decode step", t_plain * 1e3, 1.0),
            ("verify step + MTP draft pass", t_spec * 1e3, t_spec / t_plain),
            ("MTP mode, drafting off: step + draft pass", t_off * 1e3, t_off / t_plain),
            ("break-even acceptance", t_spec / t_plain - 1, "")]
    return rows, {"model": path, "plain_s": t_plain, "verify_s": t_spec, "mtp_no_drafts_s": t_off, "drafts": drafts}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["verify", "agent", "mtp"])
    p.add_argument("--model", default=None)
    p.add_argument("--random-weights", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto: bf16 on a GPU, fp32 on a CPU")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-chars", type=int, default=2400)
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--num-speculative-tokens", type=int, default=NGRAM["num_speculative_tokens"],
                   help="agent: prompt lookup's k (drafts a step at most)")
    p.add_argument("--force-drafting", action="store_true",
                   help="agent: draft at every step whatever the policy measures (acceptance figures on a CPU, "
                        "where a verify step costs more than it saves)")
    p.add_argument("--compare-chain", action="store_true",
                   help="agent: a third engine beside the two, reading every verify step back before the next")
    p.add_argument("--no-chain", action="store_true",
                   help="agent: the speculating engine reads every verify step back before the next is launched")
    p.add_argument("--batch-invariant", action="store_true",
                   help="every engine with batch_invariant: decode and verify rows computed as one-row steps, so "
                        "greedy text with drafts equals text without in bf16 too (the 'identical' column); agent "
                        "also runs the default engine's plain decoding beside them, the fastest plain anchor")
    p.add_argument("--host-profile", type=int, default=0, metavar="N",
                   help="agent: after the timing, the host's time by function over N prompts at batch 1, "
                        "plain and with drafts (cProfile)")
    p.add_argument("--profile", type=int, nargs="*", default=[],
                   help="verify: after the timing, the kernels' device time per step at these k (a GPU's profiler)")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    rows, payload = {"verify": cmd_verify, "agent": cmd_agent, "mtp": cmd_mtp}[args.what](args)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"benchmark": f"spec_decode {args.what}", "args": vars(args), **payload}, f, indent=1)
    from agent_infer.bench.table import render_table

    print(render_table([tuple(x if isinstance(x, str) else str(x) if isinstance(x, int) else f"{x:,.3f}" for x in r)
                        for r in rows]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
