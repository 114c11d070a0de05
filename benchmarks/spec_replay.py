"""The draft policy replayed over the agent workload's greedy texts, at fixed step costs.

A run on a GPU gives one sample of the policy's decisions on one host's timings; this
replays them without a GPU. The texts are the default model's greedy answers to
`spec_decode.py agent`'s prompts (generated here on the CPU, or read from --texts), and
each step of batch 1 is replayed as the engine runs it: prompt lookup (`propose_ngram`),
the next row drafted behind a verify row still in flight (the host's lookup in the tokens
it knows says whether and how many to draft, the device looks them up in the real text;
`--guess`: the host's lookup after a guess of what the row in flight gives), the pause
rule and the batch rule of `DraftPolicy` as in this tree, each step charged a fixed cost
(--costs; a lookup that finds nothing, read back first, costs a plain step and
--lookup-ms).

    python benchmarks/spec_replay.py --dtype bfloat16 --costs 0.73,0.96 0.82,1.15 0.82,1.6 0.82,3.0
    python benchmarks/spec_replay.py --texts /tmp/texts.json --shuffle   # text that does not repeat
    python benchmarks/spec_replay.py --texts /tmp/texts.json --no-chain  # acceptance without chained rows
    python benchmarks/spec_replay.py --texts /tmp/texts.json --guess  # rows behind one in flight sized on a guess

Per cost pair: tokens per time against plain decoding's (× plain), the steps the batch
rule kept plain, tokens a verify row and acceptance at the first position, with and
without the batch rule.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from agent_infer.speculative.ngram import propose_ngram  # noqa: E402
from agent_infer.speculative.policy import DraftPolicy  # noqa: E402


def greedy_texts(dtype: str, num_prompts: int, max_chars: int, max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, greedy output) token ids of the agent workload on the CPU."""
    from agent_infer.config import EngineConfig
    from agent_infer.engine.llm_engine import LLMEngine
    from agent_infer.loader.default_model import ensure_default_model
    from agent_infer.sampling_params import SamplingParams
    from spec_decode import agent_prompts

    eng = LLMEngine(EngineConfig(model=ensure_default_model(), device="cpu", dtype=dtype, max_num_seqs=num_prompts))
    prompts = agent_prompts(eng, num_prompts, max_chars)
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
    return [(p, list(o.token_ids)) for p, o in zip(prompts, outs)]


class Replay:
    """Batch 1 through one DraftPolicy, prompt after prompt as `run_agent` sends them."""

    def __init__(self, k: int, min_n: int, max_n: int, costs: tuple[float, float, float], batch_rule: bool,
                 chain: bool = True, guess: bool = False):
        self.k, self.min_n, self.max_n, self.chain, self.guess = k, min_n, max_n, chain, guess
        self.plain_s, self.verify_s, self.lookup_s = costs
        self.batch_rule = batch_rule
        self.policy = DraftPolicy()
        self.time = 0.0
        self.tokens = 0

    def _look(self, tokens: list[int], k: int) -> list[int]:
        return propose_ngram(np.asarray(tokens, dtype=np.int64), k, self.min_n, self.max_n) if k > 0 else []

    def _step(self, seconds: float, drafting: bool, tokens: int) -> None:
        self.time += seconds
        self.tokens += tokens
        self.policy.record_step(1, seconds, drafting, tokens)

    def run(self, rid: str, seq: list[int], start: int) -> None:
        """One prompt's decode: seq is prompt + output, `start` tokens known after the prefill."""
        pol, end, pos = self.policy, len(seq), start
        self.tokens += 1  # the prefill's token
        flight = None  # a verify row in flight: (drafts, first position), placed as if all accepted
        while pos < end or flight:
            if flight:
                drafts, p0 = flight
                flight = None
                accepted = _accepted(drafts, seq, p0)
                pos = min(p0 + accepted + 1, end)
                pol.on_verified(rid, len(drafts), accepted, pos)
                self._step(self.verify_s, True, pos - p0)
                if pos >= end or not self.chain or not self._drafts_now(rid, pos, end):
                    continue
                # Drafted behind it, the room as if it accepted all its drafts: the host's
                # lookup says how many, the device looks them up in the real text, the host's
                # drafts left in the slots past what it finds.
                room = min(self.k, end - p0 - len(drafts) - 2)
                if self.guess:  # after its drafts as if accepted, then lookup's next token as its own
                    host = self._look(seq[:p0] + drafts, 1 + room)[1:]
                else:
                    host = self._look(seq[:p0], room)
                if not host:  # a miss: the row runs plain, the step keeps its overlap
                    pol.on_verified(rid, 0, 0, pos + 1)
                    self._step(self.plain_s, False, 1)
                    pos += 1
                    continue
                found = self._look(seq[:pos], len(host))
                flight = (found + host[len(found):], pos)
                continue
            room = min(self.k, end - pos - 1)
            if not self._drafts_now(rid, pos, end) or room <= 0:
                self._step(self.plain_s, False, 1)
                pos += 1
                continue
            drafts = self._look(seq[:pos], room)
            if not drafts:  # a miss: the pause rule counts it; the step runs plain
                pol.on_verified(rid, 0, 0, pos + 1)
                self._step(self.plain_s + self.lookup_s, False, 1)
                pos += 1
                continue
            flight = (drafts, pos)

    def _drafts_now(self, rid: str, pos: int, end: int) -> bool:
        return (not self.batch_rule or self.policy.batch_drafts(1)) and pos + 1 < end and self.policy.may_draft(rid, pos)


def _accepted(drafts: list[int], seq: list[int], p0: int) -> int:
    a = 0
    while a < len(drafts) and p0 + a < len(seq) and drafts[a] == seq[p0 + a]:
        a += 1
    return a


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--texts", default=None, help="a JSON file of [prompt ids, output ids] pairs (written if absent)")
    p.add_argument("--dtype", default="bfloat16", help="the CPU engine's dtype for the greedy texts")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-chars", type=int, default=2400)
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--num-speculative-tokens", type=int, default=8)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--costs", nargs="+", default=["0.73,0.96", "0.82,1.15"],
                   help="plain,verify step costs in ms (a verify step's, whatever its drafts)")
    p.add_argument("--lookup-ms", type=float, default=0.015, help="what a lookup that finds nothing adds")
    p.add_argument("--shuffle", action="store_true", help="each output's tokens shuffled: text that does not repeat")
    p.add_argument("--guess", action="store_true",
                   help="rows behind one in flight sized by a lookup after a guess of what it gives")
    p.add_argument("--no-chain", action="store_true",
                   help="each verify row read back before the next row is drafted (its cost unchanged: only the "
                        "tokens a verify row and the acceptance compare)")
    args = p.parse_args()
    if args.texts and os.path.exists(args.texts):
        with open(args.texts) as f:
            texts = json.load(f)
    else:
        texts = greedy_texts(args.dtype, args.num_prompts, args.max_chars, args.max_tokens)
        if args.texts:
            with open(args.texts, "w") as f:
                json.dump(texts, f)
    if args.shuffle:
        rnd = random.Random(0)
        texts = [(prompt, rnd.sample(out, len(out))) for prompt, out in texts]
    from agent_infer.bench.table import render_table

    rows = [("costs plain / verify ms", "rule", "x plain", "kept plain", "tokens a verify row", "first position")]
    for pair in args.costs:
        plain_ms, verify_ms = (float(x) for x in pair.split(","))
        for name, batch_rule in (("this tree", True), ("no batch rule", False)):
            r = Replay(args.num_speculative_tokens, args.prompt_lookup_min, args.prompt_lookup_max,
                       (plain_ms, verify_ms, args.lookup_ms), batch_rule, chain=not args.no_chain, guess=args.guess)
            for i, (prompt, out) in enumerate(texts):
                r.run(str(i), list(prompt) + list(out), len(prompt) + 1)
            s = r.policy.stats
            kept = sum(v["kept_plain"] for v in r.policy.batch_rule().values())
            first = s.accepted_per_pos[0] / s.num_drafts if s.num_drafts else 0.0
            rows.append((f"{plain_ms} / {verify_ms}", name, f"{r.tokens * plain_ms / r.time:.3f}", str(kept),
                         f"{s.mean_acceptance_length:.2f}", f"{first:.2f}"))
    print(render_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
