"""DeepSeek-V3's multi-token-prediction layer as the draft model: greedy tokens equal
plain decoding, and every draft equals a plain-PyTorch reference built from
transformers' own DeepseekV3 classes (the MTP layer is not one of them: its decoder
layer is, fed with the main model's final hidden states)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from agent_infer.config import ConfigError, EngineConfig
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.sampling_params import SamplingParams
from tests.deepseek_models import write_deepseek_model
from tests.hf_reference import load_hf_model

MTP = {"method": "mtp", "num_speculative_tokens": 1}
# Its first 32 tokens (two blocks) are PROMPTS[2]'s: its draft layer reads their K/V
# from the prefix cache, as the other request's draft passes wrote it.
SHARED = list(range(40, 75)) + [3, 4]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [100, 20, 30], list(range(40, 75)), list(range(200, 217))]  # 17: a chunk of 8 ends one short


def add_mtp_layer(path: str, seed: int = 5) -> str:
    """V3's layout: the MTP layer at index num_hidden_layers (a decoder layer, here a copy
    of the last one, and its own norms and eh_proj), with copies of the shared embedding
    and head."""
    from safetensors.torch import load_file, save_file

    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_nextn_predict_layers"] = 1
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    n = cfg["num_hidden_layers"]
    state = load_file(os.path.join(path, "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    extra = {k.replace(f"model.layers.{n - 1}.", f"model.layers.{n}."): v.clone() for k, v in state.items()
             if k.startswith(f"model.layers.{n - 1}.")}
    h = cfg["hidden_size"]
    pre = f"model.layers.{n}."
    for name in ("enorm", "hnorm", "shared_head.norm"):
        extra[pre + name + ".weight"] = torch.rand(h, generator=g) + 0.5
    extra[pre + "eh_proj.weight"] = torch.randn(h, 2 * h, generator=g) * 0.3
    extra[pre + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    extra[pre + "shared_head.head.weight"] = state["lm_head.weight"].clone()
    save_file({**state, **extra}, os.path.join(path, "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory) -> str:
    return add_mtp_layer(write_deepseek_model("v3", str(tmp_path_factory.mktemp("v3_mtp") / "m")))


def _engine(path: str, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", num_kv_blocks=256, **kw))


def reference_drafts(path: str, tokens: list[int]) -> list[int]:
    """For each position p < len - 1: the MTP layer's argmax for token p + 2 given the
    main model's final hidden state at p and token p + 1, attending causally over the
    positions before it."""
    from safetensors.torch import load_file

    model = load_hf_model(path)
    config = model.config
    n = config.num_hidden_layers
    state = load_file(os.path.join(path, "model.safetensors"))
    pre = f"model.layers.{n}."
    # The MTP block is a copy of the last decoder layer (add_mtp_layer): transformers'
    # own loaded layer is its reference.
    layer = model.model.layers[n - 1]
    eps = config.rms_norm_eps

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    ids = torch.tensor([tokens])
    with torch.no_grad():
        h = model(ids, output_hidden_states=True).hidden_states[-1][0]  # after the final norm
        t = len(tokens) - 1
        x = torch.cat([norm(model.model.embed_tokens(ids[0, 1:]), state[pre + "enorm.weight"]),
                       norm(h[:t], state[pre + "hnorm.weight"])], -1) @ state[pre + "eh_proj.weight"].T
        positions = torch.arange(t)[None]
        cos_sin = model.model.rotary_emb(x[None], positions)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        out = layer(x[None], attention_mask=mask, position_ids=positions, position_embeddings=cos_sin)
        out = out[0] if isinstance(out, tuple) else out
        logits = model.lm_head(norm(out[0], state[pre + "shared_head.norm.weight"]))
    return logits.argmax(-1).tolist()


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 8}, {"max_num_batched_tokens": 8, "mixed_batches": True}],
                         ids=["whole", "chunked", "chunked-mixed"])
def test_mtp_drafts_are_the_reference_and_tokens_those_of_plain_decoding(mtp_dir, kw):
    """Chunked, prompts are prefilled 8 tokens a step (steps that sample nothing, chunks
    whose next token is the next chunk's first; mixed, beside decode rows): the draft
    layer's K/V of every prompt row is what its later drafts attend to, also where a
    prompt's first blocks come from the prefix cache."""
    prompts = PROMPTS + [SHARED]
    plain = _engine(mtp_dir, **kw).generate(prompts, GREEDY)
    engine = _engine(mtp_dir, speculative_config=MTP, **kw)
    assert not engine.async_scheduling  # the draft layer runs on each step's tokens
    engine.draft_policy.batch_drafts = lambda num_decoding: True
    drafts: list[tuple[str, int, int]] = []  # (request, its token count, draft)
    after = engine.drafter.after_step

    def log(batch, row_drafts):
        after(batch, row_drafts)
        drafts.extend((rid, total, d[0]) for rid, (total, d) in engine.drafter._drafts.items())

    engine.drafter.after_step = log
    # Random weights rarely draft right: every other step takes the true next token
    # instead, so that the layer also catches up over accepted runs.
    propose = engine.drafter.propose

    def mixed(rid, prompt, tokens_at, total, k):
        mtp = propose(rid, prompt, tokens_at, total, k)
        out = next(o.token_ids for o in plain if o.prompt_token_ids == prompt)
        return [out[total - len(prompt)]] if total % 2 else mtp

    engine.drafter.propose = mixed
    spec = engine.generate(prompts, GREEDY)
    assert engine.stats.prompt_tokens <= sum(map(len, prompts)) - 32  # SHARED's two blocks were hits
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    stats = engine.draft_policy.stats
    assert stats.num_drafts > 20 and stats.num_draft_tokens == stats.num_drafts  # one token each
    assert stats.num_accepted_tokens >= stats.num_drafts // 3
    by_id = {o.request_id: o for o in spec}
    checked = 0
    for rid in by_id:
        out = by_id[rid]
        ref = reference_drafts(mtp_dir, out.prompt_token_ids + out.token_ids)
        for _, total, draft in {(r, t, d) for r, t, d in drafts if r == rid}:
            assert draft == ref[total - 2], (rid, total)  # drafted at position total - 2, for token total
            checked += 1
    assert checked >= len(prompts) * 10


def test_every_step_drafts_within_itself(mtp_dir):
    """The draft layer runs right after each step's sampler, over the step's own rows and
    attention metadata, and its drafts come back with the step's tokens (no pass of its
    own, no second read-back): every step that samples hands the drafter its drafts."""
    engine = _engine(mtp_dir, speculative_config=MTP)
    engine.draft_policy.batch_drafts = lambda num_decoding: True
    got: list[tuple[bool, bool]] = []  # (the step samples, it came with drafts)
    after = engine.drafter.after_step

    def log(batch, row_drafts):
        got.append((any(batch.samples), row_drafts is not None))
        after(batch, row_drafts)

    engine.drafter.after_step = log
    out = engine.generate(PROMPTS, GREEDY)
    assert [len(o.token_ids) for o in out] == [GREEDY.max_tokens] * len(PROMPTS)
    assert len(got) >= GREEDY.max_tokens // 2 and all(samples == drafted for samples, drafted in got)
    assert engine.draft_policy.stats.num_drafts >= GREEDY.max_tokens // 2


def test_a_chunk_one_token_short_of_its_prompt_beside_decode_rows(mtp_dir):
    """A mixed step whose chunk stops one token before its prompt ends: its last row's next
    token is known but it samples nothing, so no draft comes from it (the next step computes
    that token, then drafts), and both requests get plain decoding's tokens."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = []
    for spec in (None, MTP):
        engine = _engine(mtp_dir, speculative_config=spec, max_num_batched_tokens=8, mixed_batches=True)
        engine.draft_policy.batch_drafts = lambda num_decoding: True
        engine.add_request([5, 6, 7], params, request_id="a")
        engine.step()  # its prefill: it decodes from here on
        # 6 of its 7 tokens beside a's verify row (its draft came with a's prefill), then 1.
        engine.add_request(list(range(100, 107)), params, request_id="b")
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        outs.append(done)
    assert outs[1] == outs[0] and len(outs[0]) == 2


def test_mtp_layer_loads_only_when_asked_and_is_refused_where_it_cannot_run(mtp_dir, tiny_model_dirs):
    engine = _engine(mtp_dir, speculative_config=MTP)
    assert engine.runner.model.mtp is not None
    assert len(engine.runner.pool.views) == engine.model_config.num_layers + 1  # its own latent cache
    assert _engine(mtp_dir).runner.model.mtp is None
    with pytest.raises(ConfigError, match="has none"):
        _engine(tiny_model_dirs["qwen3"], speculative_config=MTP)
    with pytest.raises(ConfigError, match="num_speculative_tokens must be 1"):
        EngineConfig(model=mtp_dir, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="method mtp runs on one GPU"):
        EngineConfig(model=mtp_dir, speculative_config=MTP, tensor_parallel_size=2)
