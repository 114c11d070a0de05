"""Structured outputs and the other logits constraints in the engine (offline API):
unconstrained rows are untouched by constrained neighbours, a batch without constraints
takes the plain launch path, masks are built while the forward pass is queued and wait
for the previous step only when a grammar needs its token, masks cover the model's
vocabulary (tokens beyond the tokenizer never allowed), a complete grammar stops the
request, bad grammars are refused without disturbing the engine."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from agent_infer.config import EngineConfig
from agent_infer.engine.llm_engine import LLMEngine, RequestError
from agent_infer.engine.structs import Sequence
from agent_infer.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams as SO
from agent_infer.structured.constraints import Constraints
from agent_infer.structured.grammar import GrammarCompiler, GrammarError

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}
PLAIN = ["The capital of France is", "1, 2, 3, 4,", "My favourite food is"]
PLAIN_PARAMS = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=10, ignore_eos=True),
                SamplingParams(temperature=1.0, seed=6, max_tokens=10, ignore_eos=True, logprobs=2)]
CONSTRAINED = ["A person as JSON:", "Phone:", "Pick:"]
CONSTRAINED_PARAMS = [SamplingParams(temperature=0.8, seed=1, max_tokens=30, structured_outputs=SO(json=SCHEMA)),
                      SamplingParams(temperature=0, max_tokens=12, structured_outputs=SO(regex=r"\d{3}-\d{4}")),
                      SamplingParams(temperature=0, max_tokens=6, logit_bias={100: 100.0}, min_tokens=6)]


class LaunchLog:
    """Records, per launch, whether it got a logits hook, and the order of forward
    passes, read-backs and sampling."""

    def __init__(self, engine: LLMEngine):
        self.hooks: list[bool] = []
        self.events: list[str] = []
        runner = engine.runner
        launch, execute, resolve = runner.launch, runner.execute, engine._resolve

        def log_launch(step, seqs, process=None, drafts=None):
            self.hooks.append(process is not None)
            out = launch(step, seqs, process, drafts)
            self.events.append("sampled")
            return out

        def log_execute(step):
            self.events.append("forward")
            return execute(step)

        def log_resolve():
            self.events.append("read back")
            return resolve()

        runner.launch, runner.execute, engine._resolve = log_launch, log_execute, log_resolve


@pytest.fixture(scope="module")
def sync_engine(default_model_dir):
    return LLMEngine(EngineConfig(model=default_model_dir, device="cpu", dtype="float32", num_kv_blocks=512,
                                  async_scheduling=False))


@pytest.mark.parametrize("which", ["async", "sync"])
def test_unconstrained_rows_get_exactly_their_tokens(smol_engine, sync_engine, which):
    engine = smol_engine if which == "async" else sync_engine
    alone = [engine.generate([p], sp)[0] for p, sp in zip(PLAIN, PLAIN_PARAMS)]
    mixed = engine.generate(PLAIN + CONSTRAINED, PLAIN_PARAMS + CONSTRAINED_PARAMS)
    for a, b in zip(alone, mixed):
        assert a.token_ids == b.token_ids
        # (logprobs move by fp32 rounding with the batch's shape, constrained or not)
        assert all(abs(x.logprob - y.logprob) < 1e-4 for x, y in zip(a.logprobs or [], b.logprobs or []))
    person, phone, biased = mixed[3:]
    obj = json.loads(person.text)
    assert set(obj) == {"name", "n"} and 0 <= obj["n"] <= 99 and len(obj["name"]) <= 12
    assert re.fullmatch(r"\d{3}-\d{4}", phone.text) and phone.finish_reason == "stop"
    assert biased.token_ids == [100] * 6


def test_plain_batches_take_the_plain_path(smol_engine):
    log = LaunchLog(smol_engine)
    try:
        smol_engine.generate(PLAIN, PLAIN_PARAMS)
        assert log.hooks and not any(log.hooks)
        log.hooks.clear()
        smol_engine.generate(PLAIN[:1] + CONSTRAINED[1:2], [PLAIN_PARAMS[0], CONSTRAINED_PARAMS[1]])
        assert any(log.hooks)
        log.hooks.clear()
        # Once the constrained request is done, the steps after it go back to the plain path.
        smol_engine.generate(PLAIN[:2], [PLAIN_PARAMS[0], SamplingParams(temperature=0, max_tokens=3,
                                                                         structured_outputs=SO(choice=["ab"]))])
        assert log.hooks[0] and not log.hooks[-1]
    finally:
        del smol_engine.runner.launch, smol_engine.runner.execute, smol_engine._resolve


def test_masks_are_built_while_the_forward_pass_runs(smol_engine):
    """Async scheduling: a decode step with a grammar row queues its forward pass, then
    reads the previous step back (the matcher needs that token), then samples; a plain
    step samples first and reads back after."""
    log = LaunchLog(smol_engine)
    try:
        smol_engine.generate(["Phone:"], SamplingParams(temperature=0, max_tokens=12,
                                                        structured_outputs=SO(regex=r"\d{3}-\d{4}")))
        constrained = "".join(e[0] for e in log.events)
        log.events.clear()
        smol_engine.generate(["Phone:"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        plain = "".join(e[0] for e in log.events)
    finally:
        del smol_engine.runner.launch, smol_engine.runner.execute, smol_engine._resolve
    assert "frs" in constrained  # forward, read back (inside the launch), sample
    assert "frs" not in plain and "fsr" in plain
    assert smol_engine.constraints.stats.masked_rows > 0


def test_complete_grammar_stops_even_without_eos(smol_engine):
    out = smol_engine.generate(["Answer:"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                           structured_outputs=SO(choice=["yes", "no way"])))[0]
    assert out.text in ("yes", "no way") and out.finish_reason == "stop"


def test_n_copies_and_stop_strings(smol_engine):
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=30, structured_outputs=SO(json=SCHEMA))
    outs = smol_engine.generate(["A person as JSON:"] * 3, [SamplingParams(**{**params.__dict__, "seed": s})
                                                              for s in (1, 2, 3)])
    assert all(set(json.loads(o.text)) == {"name", "n"} for o in outs)
    cut = smol_engine.generate(["Phone:"], SamplingParams(temperature=0, max_tokens=12, stop=["-"],
                                                          structured_outputs=SO(regex=r"\d{3}-\d{4}")))[0]
    assert re.fullmatch(r"\d{3}", cut.text) and cut.stop_reason == "-"


def test_masks_cover_the_model_vocabulary(smol_engine):
    """A model vocabulary larger than the tokenizer's (the random Qwen3-8B checkpoint with
    SmolLM2's tokenizer): the tokens past the tokenizer are never allowed."""
    from agent_infer.loader.tokenizer import load_tokenizer

    tok = smol_engine.tokenizer
    vocab = len(tok) + 777
    compiler = GrammarCompiler(lambda: load_tokenizer(smol_engine.config.model), vocab, [tok.eos_token_id])
    constraints = Constraints(compiler, vocab, [tok.eos_token_id], torch.device("cpu"), 4)
    seq = Sequence("v", tok.encode("x"), SamplingParams(max_tokens=4, structured_outputs=SO(json_object=True)), 4, 0)
    seq.output_token_ids = [-1]  # the placeholder of the token being sampled
    constraints.add(seq)
    logits = torch.zeros(1, vocab)
    constraints.apply([seq], logits)
    allowed = torch.isfinite(logits[0]).nonzero().flatten()
    assert len(allowed) > 0 and allowed.max() < len(tok)
    assert all(tok.decode([t]).lstrip().startswith("{") for t in allowed.tolist())


def test_bad_specs_are_refused_and_the_engine_carries_on(smol_engine):
    while smol_engine.has_unfinished_requests():  # a step still in flight from an earlier test
        smol_engine.step()
    for spec, words in ((SO(regex="a(b"), "unclosed"), (SO(json={"type": "strin"}), "strin"),
                        (SO(grammar="start: foo"), "foo"), (SO(json="{not json"), "JSON")):
        with pytest.raises(RequestError, match=words):
            smol_engine.add_request("x", SamplingParams(max_tokens=2, structured_outputs=spec))
    with pytest.raises(RequestError, match="allowed_token_ids"):
        smol_engine.add_request("x", SamplingParams(max_tokens=2, allowed_token_ids=[10**7]))
    with pytest.raises(SamplingParamsError):
        SO(regex="a", choice=["b"])
    assert not smol_engine.has_unfinished_requests()
    assert smol_engine.generate(["Hi"], SamplingParams(temperature=0, max_tokens=2))[0].finish_reason == "length"


def test_grammars_are_compiled_once(smol_engine):
    g = smol_engine.grammar
    spec = SO(json={"type": "object", "properties": {"cached": {"type": "boolean"}}})
    g.compile(spec)
    misses = g.misses
    for _ in range(3):
        g.compile(SO(json={"properties": {"cached": {"type": "boolean"}}, "type": "object"}))  # same, reordered
    assert g.misses == misses and g.hits >= 3


def test_pack_and_clear_bits():
    from agent_infer.structured.constraints import clear_bits, pack_token_ids, set_bit

    row = pack_token_ids([0, 31, 32, 100], 4)
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    assert np.nonzero(bits)[0].tolist() == [0, 31, 32, 100]
    clear_bits(row, np.array([31, 100]))
    set_bit(row, 64)
    assert np.nonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))[0].tolist() == [0, 32, 64]
    with pytest.raises(GrammarError):
        raise GrammarError("x")


def test_grammar_shards_are_independent_templates_with_the_same_masks(smol_engine):
    """A grammar many requests share is spread over `shards` independently compiled
    templates (copies of one llguidance matcher share its lexer's lock), handed out in
    turn and compiled on first use; every shard's copies give the same masks, and the
    batch fill (sorted by shard, through the executor) equals one row at a time."""
    from agent_infer.loader.tokenizer import load_tokenizer

    tok = smol_engine.tokenizer
    vocab = len(tok)
    compiler = GrammarCompiler(lambda: load_tokenizer(smol_engine.config.model), vocab, [tok.eos_token_id], shards=3)
    with pytest.raises(ValueError, match="shards"):
        GrammarCompiler(lambda: None, vocab, [0], shards=0)
    compiled = compiler.compile(SO(json=SCHEMA))
    handed = [compiler.new_matcher(compiled) for _ in range(7)]
    assert [s for _, s in handed] == [0, 1, 2, 0, 1, 2, 0]
    assert len(compiled.templates) == 3 and len({id(t) for t in compiled.templates}) == 3
    constraints = Constraints(compiler, vocab, [tok.eos_token_id], torch.device("cpu"), 8)
    seqs = []
    for i in range(7):
        seq = Sequence(f"s{i}", tok.encode("x"), SamplingParams(max_tokens=8, structured_outputs=SO(json=SCHEMA)), 4, 0)
        seq.output_token_ids = [-1]
        constraints.add(seq)
        seqs.append(seq)
    shards = [constraints._rows[s.request_id].lexer[0] for s in seqs]
    assert sorted(shards.count(j) for j in range(3)) == [2, 2, 3]  # in turn, continuing from above
    text = '{"name": "Ada", "n": 4'
    for t in tok.encode(text, add_special_tokens=False):
        logits = torch.zeros(len(seqs), vocab)
        constraints.apply(seqs, logits)
        alone = [torch.zeros(1, vocab) for _ in seqs]
        for s, row in zip(seqs, alone):
            constraints.apply([s], row)
        for k in range(len(seqs)):
            assert torch.equal(torch.isfinite(logits[k]), torch.isfinite(alone[k][0]))
            assert torch.isfinite(logits[k, t])  # the text is valid JSON for the schema so far
        for s in seqs:
            assert not constraints.on_token(s, t)


def test_rebased_refs_resolve_inside_their_own_schema():
    from agent_infer.structured.grammar import rebase_refs

    part = {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}, "self": {"$ref": "#"},
                                             "named": {"$ref": "#anchor"}, "$ref": {"type": "string"}},
            "$defs": {"A": {"type": "integer"}}}
    out = rebase_refs(part, "/items/anyOf/1/properties/parameters")
    assert out["properties"]["a"] == {"$ref": "#/items/anyOf/1/properties/parameters/$defs/A"}
    assert out["properties"]["self"] == {"$ref": "#/items/anyOf/1/properties/parameters"}
    assert out["properties"]["named"] == {"$ref": "#anchor"}  # anchors are found wherever they live
    assert out["properties"]["$ref"] == {"type": "string"}  # a property named $ref is not a reference
    assert part["properties"]["a"] == {"$ref": "#/$defs/A"}  # the input is left as it was
