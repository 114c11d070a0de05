"""Grammars for structured outputs, compiled by llguidance and cached.

llguidance (one dependency-free abi3 wheel) was chosen over xgrammar by measurement on
our vocabularies (benchmarks/grammar_masks.py, docs/PERFORMANCE.md): it compiles a new
schema ~10x faster (it builds masks lazily from a token trie instead of precomputing
them), which matters when every agent request brings its own tool schemas, and fills a
batch of masks faster on a 152k vocabulary.

A `GrammarCompiler` may be shared by threads (a front end validates in a worker thread, so
that a bad schema is a 400 before anything is queued; the engine keeps one matcher per
sequence), so its cache is guarded by a lock. The tokenizer side (LLTokenizer, ~0.3-0.5 s to build) is
built on first use: engines that never see a constraint never pay for it.

Sequences get copies of a compiled template, but copies of one llguidance matcher share
its lexer (and the DFA it builds lazily) behind one mutex, so the parallel mask fill of
rows copied from one template runs one row at a time, and slower than a plain loop with
more threads contending (on the 16-core GPU host, 64 such rows of the benchmark's
schema took 6.8 ms a step with 12 threads, 4.9 ms in a plain loop). A grammar therefore
keeps up to `shards` templates compiled independently, each with its own lexer, and
hands them out in turn; the mask fill gives each shard's rows to one thread
(`Constraints`). A grammar only one request uses is compiled once.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable

from agent_infer.sampling_params import StructuredOutputsParams

log = logging.getLogger(__name__)

# JSON is written as json.dumps writes it (", " and ": ", no other whitespace): the form
# tool-call training data uses, the fewest tokens, and no way for a model to loop on
# whitespace until max_tokens (what vLLM users met with free whitespace).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHE_SIZE = 512


def default_shards() -> int:
    """Templates per grammar and mask-fill threads: 80 % of the CPUs this process may run
    on (llguidance's executor default), at most 8. On the 16-core GPU host, 64 rows of
    the structured_output benchmark's schema took 5.3 / 3.9 / 2.8 / 2.0 / 2.2 ms a step
    with 1 / 2 / 4 / 8 / 12 shards and threads; with 12 threads over copies of one
    template, 6.8 ms."""
    return max(1, min(8, len(os.sched_getaffinity(0)) * 4 // 5))


class GrammarError(ValueError):
    """A schema, regex or grammar that cannot be compiled; the message says why."""

    def __init__(self, message: str, param: str = "structured_outputs"):
        super().__init__(message)
        self.param = param


class CompiledGrammar:
    """llguidance's grammar text and its templates (fresh, validated LLMatchers that
    sequences get deep copies of), one per shard compiled so far."""

    def __init__(self, key: str, grammar: str, template: object):
        self.key = key
        self.grammar = grammar
        self.templates = [template]
        self.handed_out = 0


def close_objects(schema):
    """OpenAI's strict mode: every object schema that leaves additionalProperties unset
    admits no other property. Returns a copy."""
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: close_objects(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


_LITERAL_KEYWORDS = frozenset({"const", "enum", "default", "examples"})  # values, not schemas


def rebase_refs(schema, pointer: str):
    """`schema` placed at JSON pointer `pointer` inside a larger document: its local
    references ("#", "#/$defs/X") rewritten to point where they now live, so that each
    part resolves inside itself and not against the new root. Returns a copy."""
    if isinstance(schema, list):
        return [rebase_refs(s, pointer) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _LITERAL_KEYWORDS else rebase_refs(v, pointer) for k, v in schema.items()}
    ref = out.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):  # a named anchor needs no rebasing
        out["$ref"] = "#" + pointer + ref[1:]
    return out


def _lark_literal(text: str) -> str:
    return json.dumps(text)  # Lark string literals take JSON's escapes


class GrammarCompiler:
    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int, eos_token_ids: list[int],
                 shards: int | None = None):
        """`load_tokenizer` returns a fast Hugging Face tokenizer (called once, on first
        use); masks cover `vocab_size` (the model's, which may exceed the tokenizer's:
        tokens beyond the tokenizer are never allowed); `shards`: independent templates
        per grammar at most (the mask fill's threads; default `default_shards()`)."""
        shards = default_shards() if shards is None else shards
        if shards < 1:
            raise ValueError(f"shards must be >= 1, got {shards}")
        self.shards = shards
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer = None
        self.grammar_eos: int | None = None  # the EOS id llguidance knows (set with the tokenizer)
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self.hits = 0
        self.misses = 0

    @property
    def ll_tokenizer(self):
        if self._tokenizer is None:
            with self._lock:
                if self._tokenizer is None:
                    import llguidance.hf

                    hf = self._load_tokenizer()
                    # One EOS for llguidance (older releases take a single id); Constraints
                    # allows every EOS of the engine wherever the grammar allows this one.
                    eos = hf.eos_token_id if hf.eos_token_id in self.eos_token_ids else (
                        self.eos_token_ids[0] if self.eos_token_ids else None)
                    self.grammar_eos = eos
                    self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size, eos_token=eos)
        return self._tokenizer

    def token_id(self, text: str) -> int | None:
        """The id of `text` when it is exactly one token (e.g. a special token), else None."""
        ids = self.ll_tokenizer.tokenize_str(text, parse_special=True)
        return ids[0] if len(ids) == 1 else None

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of `spec`, from the cache when seen before. Raises GrammarError."""
        key = _cache_key(spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit
        grammar = self._grammar_text(spec)
        matcher = _matcher(self.ll_tokenizer, grammar)
        if matcher.is_error():
            raise GrammarError(f"invalid {_describe(spec)}: {matcher.get_error().strip()}")
        compiled = CompiledGrammar(key, grammar, matcher)
        with self._lock:
            self.misses += 1
            self._cache[key] = compiled
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def new_matcher(self, compiled: CompiledGrammar) -> tuple[object, int]:
        """A matcher for one sequence and its shard: a copy of the next template in turn,
        compiling that template first if this is the shard's first use."""
        tok = self.ll_tokenizer  # outside the lock: its first build takes it
        with self._lock:  # templates are shared across threads
            shard = compiled.handed_out % self.shards
            compiled.handed_out += 1
            if shard == len(compiled.templates):
                compiled.templates.append(_matcher(tok, compiled.grammar))
            return compiled.templates[shard].deep_copy(), shard

    @staticmethod
    def _grammar_text(spec: StructuredOutputsParams) -> str:
        import llguidance

        M = llguidance.LLMatcher
        kind = spec.kind
        if kind == "json" or kind == "json_object":
            schema = {"type": "object"} if kind == "json_object" else spec.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise GrammarError("a JSON schema must be a JSON object")
            if spec.strict:
                schema = close_objects(schema)
            try:
                return M.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            except ValueError as e:
                raise GrammarError(f"invalid JSON schema: {e}") from None
        if kind == "regex":
            # \d and \w mean ASCII digits and word characters, as in JSON schema and for
            # most clients (Rust's regex, which llguidance uses, would take any Unicode digit).
            return M.grammar_from_lark(f"start: /{llguidance.regex_to_lark(spec.regex, 'dw')}/")
        if kind == "choice":
            return M.grammar_from_lark("start: " + " | ".join(_lark_literal(c) for c in spec.choice))
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            text = any_to_lark(spec.grammar)  # GBNF (llama.cpp's, vLLM's "grammar") to Lark; Lark as is
        except Exception as e:  # the converter raises its own error types
            raise GrammarError(f"invalid grammar: {e}") from None
        return M.grammar_from_lark(text)


def _matcher(tokenizer, grammar: str):
    import llguidance

    return llguidance.LLMatcher(tokenizer, grammar, log_level=0)


def _cache_key(spec: StructuredOutputsParams) -> str:
    value = spec.json if spec.kind == "json" else getattr(spec, spec.kind)
    if spec.kind == "json" and not isinstance(value, str):
        value = json.dumps(value, sort_keys=True)
    return json.dumps([spec.kind, spec.strict, value])


def _describe(spec: StructuredOutputsParams) -> str:
    return {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
            "choice": "choice", "grammar": "grammar"}[spec.kind]
