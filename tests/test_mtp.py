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
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [100, 20, 30], list(range(40, 75))]


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


def test_mtp_drafts_are_the_reference_and_tokens_those_of_plain_decoding(mtp_dir):
    plain = _engine(mtp_dir).generate(PROMPTS, GREEDY)
    engine = _engine(mtp_dir, speculative_config=MTP)
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
    spec = engine.generate(PROMPTS, GREEDY)
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
    assert checked >= len(PROMPTS) * 10


def test_decode_steps_draft_on_the_device_within_the_step(mtp_dir):
    """A decode step's draft pass runs right after its sampler, over the step's own rows
    and attention metadata (no pass of its own, no second read-back): only steps with
    prompt rows take the separate pass over what they computed."""
    engine = _engine(mtp_dir, speculative_config=MTP)
    engine.draft_policy.batch_drafts = lambda num_decoding: True
    separate: list[bool] = []
    run = engine.runner.draft_with_mtp

    def counted(batch, row_drafts):
        if row_drafts is None:
            separate.append(batch.is_prefill)
        return run(batch, row_drafts)

    engine.runner.draft_with_mtp = counted
    with_device = []
    after = engine.drafter.after_step
    engine.drafter.after_step = lambda batch, row_drafts: (with_device.append(row_drafts is not None),
                                                           after(batch, row_drafts))
    out = engine.generate(PROMPTS, GREEDY)
    assert [len(o.token_ids) for o in out] == [GREEDY.max_tokens] * len(PROMPTS)
    assert separate and all(separate)  # prefill steps only
    assert sum(with_device) >= GREEDY.max_tokens - 1  # every decode step drafted with its own pass
    assert engine.draft_policy.stats.num_drafts >= GREEDY.max_tokens // 2


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
