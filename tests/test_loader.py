"""Weight loading: sharded checkpoints, dtypes, tied embeddings, missing weights,
pre-sliced tensors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from agent_infer.config import ConfigError, EngineConfig, ModelConfig
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.loader.weights import iter_weights
from agent_infer.sampling_params import SamplingParams
from agent_infer.distributed.state import ParallelState
from agent_infer.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPT = [5, 17, 33, 101, 250, 7, 9]


def _copy_config(src: str, dst: str) -> None:
    for f in os.listdir(src):
        if f.endswith(".json") and "index" not in f:
            with open(os.path.join(src, f)) as a, open(os.path.join(dst, f), "w") as b:
                b.write(a.read())


def _shard(src: str, dst: str, num_shards: int) -> None:
    os.makedirs(dst, exist_ok=True)
    _copy_config(src, dst)
    state = load_file(os.path.join(src, "model.safetensors"))
    names = sorted(state)
    weight_map = {}
    for i in range(num_shards):
        part = names[i::num_shards]
        fname = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: state[n] for n in part}, os.path.join(dst, fname))
        weight_map.update({n: fname for n in part})
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def _run(path: str, **kw) -> list[int]:
    eng = LLMEngine(EngineConfig(model=path, device="cpu", num_kv_blocks=64, **kw))
    return eng.generate([PROMPT], GREEDY)[0].token_ids


def test_sharded_checkpoint_gives_the_same_tokens(tiny_model_dirs, tmp_path):
    src = tiny_model_dirs["qwen2"]
    _shard(src, str(tmp_path / "sharded"), 3)
    assert len([f for f in os.listdir(tmp_path / "sharded") if f.endswith(".safetensors")]) == 3
    assert _run(src, dtype="float32") == _run(str(tmp_path / "sharded"), dtype="float32")


def test_lazy_weights_read_slices(tiny_model_dirs):
    for name, w in iter_weights(tiny_model_dirs["qwen2"]):
        if name.endswith("q_proj.weight"):
            full = w.load()
            assert torch.equal(w.narrow(0, 64, 32), full[64:96])
            assert torch.equal(w.narrow(1, 10, 5), full[:, 10:15])
            break
    else:
        pytest.fail("no q_proj weight found")


@pytest.mark.parametrize("dtype,torch_dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_dtype_option(tiny_model_dirs, dtype, torch_dtype):
    eng = LLMEngine(EngineConfig(model=tiny_model_dirs["llama"], device="cpu", dtype=dtype, num_kv_blocks=64))
    assert all(p.dtype == torch_dtype for p in eng.runner.model.parameters())
    assert eng.runner.pool.dtype == torch_dtype
    out = eng.generate([PROMPT], GREEDY)[0]
    assert len(out.token_ids) == 16


def test_tied_embeddings_share_one_tensor(tiny_model_dirs):
    eng = LLMEngine(EngineConfig(model=tiny_model_dirs["qwen3"], device="cpu", num_kv_blocks=16))
    model = eng.runner.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    eng2 = LLMEngine(EngineConfig(model=tiny_model_dirs["qwen3_untied"], device="cpu", num_kv_blocks=16))
    m2 = eng2.runner.model
    assert m2.lm_head.weight is not m2.model.embed_tokens.weight
    assert not torch.equal(m2.lm_head.weight, m2.model.embed_tokens.weight)


def test_missing_norm_weight_is_an_error_not_silent_ones(tiny_model_dirs, tmp_path):
    # q_norm/k_norm silently left at ones would be an accuracy bug no error shows.
    src = tiny_model_dirs["qwen3"]
    dst = tmp_path / "broken"
    dst.mkdir()
    _copy_config(src, str(dst))
    state = load_file(os.path.join(src, "model.safetensors"))
    state = {k: v for k, v in state.items() if "q_norm" not in k}
    save_file(state, str(dst / "model.safetensors"))
    with pytest.raises(ValueError, match="q_norm"):
        LLMEngine(EngineConfig(model=str(dst), device="cpu", num_kv_blocks=16))


def test_pre_sliced_weights_are_not_sliced_twice():
    # A rank that receives its own shard must copy it as is (a pre-sliced checkpoint).
    tp = ParallelState(rank=1, world_size=2)
    col = ColumnParallelLinear(8, 6, bias=False, tp=tp)
    full = torch.randn(6, 8)
    col.weight_loader(col.weight, full)
    assert torch.equal(col.weight, full[3:])
    col.weight_loader(col.weight, full[3:].clone())  # already this rank's shard
    assert torch.equal(col.weight, full[3:])
    row = RowParallelLinear(8, 4, bias=False, tp=tp)
    w = torch.randn(4, 8)
    row.weight_loader(row.weight, w)
    assert torch.equal(row.weight, w[:, 4:])


def test_qkv_replicates_kv_heads_when_tp_exceeds_them():
    # 4 query heads, 1 KV head, tp = 2: each rank keeps 2 query heads and the one KV head.
    d = 4
    q, k, v = torch.randn(4 * d, 8), torch.randn(d, 8), torch.randn(d, 8)
    for rank in (0, 1):
        layer = QKVParallelLinear(8, d, 4, 1, bias=False, tp=ParallelState(rank=rank, world_size=2))
        for shard, w in (("q", q), ("k", k), ("v", v)):
            layer.weight_loader(layer.weight, w, shard)
        assert torch.equal(layer.weight[: 2 * d], q[rank * 2 * d : (rank + 1) * 2 * d])
        assert torch.equal(layer.weight[2 * d : 3 * d], k)
        assert torch.equal(layer.weight[3 * d :], v)


def test_heads_not_divisible_by_tp_is_a_clear_error():
    with pytest.raises(ValueError, match=r"9 attention heads do not divide by tensor-parallel size 2.*\[1, 3, 9\]"):
        QKVParallelLinear(576, 64, 9, 3, bias=False, tp=ParallelState(rank=0, world_size=2))


def test_config_reads_transformers_4_and_5_rope_layouts(tmp_path):
    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
            "num_hidden_layers": 1, "vocab_size": 10, "intermediate_size": 8}
    v4 = dict(base, rope_theta=5e5, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    v5 = dict(base, rope_parameters={"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    cfgs = []
    for name, c in (("v4", v4), ("v5", v5)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(c))
        cfgs.append(ModelConfig.from_hf(str(tmp_path / name)).rope)
    assert cfgs[0] == cfgs[1] and cfgs[0].theta == 5e5 and cfgs[0].rope_type == "llama3"


def test_unknown_rope_type_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 8,
                                                      "num_attention_heads": 2, "num_hidden_layers": 1, "vocab_size": 4,
                                                      "rope_scaling": {"rope_type": "longrope"}}))
    with pytest.raises(ConfigError, match="longrope"):
        ModelConfig.from_hf(str(tmp_path))


# ---- loading fails clearly ------------------------------------------------------------


def _copy_model(src: str, dst) -> str:
    import shutil

    shutil.copytree(src, dst)
    return str(dst)


def _load_error(path: str) -> str:
    from agent_infer.loader.weights import CheckpointError

    with pytest.raises(CheckpointError) as e:
        LLMEngine(EngineConfig(model=path, device="cpu", num_kv_blocks=16))
    msg = str(e.value)
    assert "\n" not in msg, "one line"
    return msg


def test_truncated_safetensors_file_names_the_file(tiny_model_dirs, tmp_path):
    path = _copy_model(tiny_model_dirs["qwen2"], tmp_path / "m")
    file = os.path.join(path, "model.safetensors")
    with open(file, "rb") as f:
        data = f.read()
    with open(file, "wb") as f:
        f.write(data[: len(data) // 2])
    msg = _load_error(path)
    assert file in msg and "not a readable safetensors file" in msg and "not fully covered" in msg


def test_corrupt_safetensors_file_names_the_file(tiny_model_dirs, tmp_path):
    path = _copy_model(tiny_model_dirs["qwen2"], tmp_path / "m")
    file = os.path.join(path, "model.safetensors")
    with open(file, "wb") as f:
        f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}!!" + os.urandom(64))
    msg = _load_error(path)
    assert file in msg and "not a readable safetensors file" in msg


def test_missing_shard_named_by_the_index(tiny_model_dirs, tmp_path):
    path = str(tmp_path / "sharded")
    _shard(tiny_model_dirs["qwen2"], path, 3)
    os.remove(os.path.join(path, "model-00002-of-00003.safetensors"))
    msg = _load_error(path)
    assert "model.safetensors.index.json names model-00002-of-00003.safetensors" in msg and path in msg


def test_index_that_is_not_json_names_the_file(tiny_model_dirs, tmp_path):
    path = str(tmp_path / "sharded")
    _shard(tiny_model_dirs["qwen2"], path, 2)
    index = os.path.join(path, "model.safetensors.index.json")
    with open(index, "w") as f:
        f.write('{"weight_map": ')
    msg = _load_error(path)
    assert index in msg and "not valid JSON" in msg


def test_cli_reports_a_broken_checkpoint_in_one_line(tiny_model_dirs, tmp_path):
    from tests.test_cli import cli

    path = _copy_model(tiny_model_dirs["qwen2"], tmp_path / "m")
    file = os.path.join(path, "model.safetensors")
    os.truncate(file, os.path.getsize(file) - 100)
    r = cli("generate", "--model", path, "--prompt", "hi", "--device", "cpu", timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("agent-infer: error: ") and file in lines[0]


# ---- the weight map: whole names, never substrings ---------------------------------------


def test_weight_map_matches_whole_names():
    from agent_infer.loader.load import WeightMap, WeightRule

    m = WeightMap(rules=(
        WeightRule(r"(?P<pre>.+)\.mlp\.(?P<shard>gate|up)_proj\.weight", "{pre}.mlp.gate_up_proj.weight",
                   shards={"gate": 0, "up": 1}),
        WeightRule(r"(?P<pre>.+)\.mlp\.experts\.(?P<expert>\d+)\.(?P<shard>gate|up)_proj\.weight",
                   "{pre}.mlp.experts.w13", shards={"gate": 0, "up": 1}),
    ), skip=(r".*\.rotary_emb\.inv_freq",), renames=((r"^model\.language_model\.", "model."),))
    assert m.resolve("model.layers.3.mlp.up_proj.weight") == ("model.layers.3.mlp.gate_up_proj.weight", 1, None)
    # The first rule's `.gate_proj.` must not catch an expert's: it is the expert rule's, with its id.
    assert m.resolve("model.layers.3.mlp.experts.7.gate_proj.weight") == ("model.layers.3.mlp.experts.w13", 0, 7)
    assert m.resolve("model.language_model.layers.0.mlp.gate_proj.weight") == (
        "model.layers.0.mlp.gate_up_proj.weight", 0, None)
    assert m.resolve("model.layers.0.self_attn.rotary_emb.inv_freq") is None
    assert m.resolve("model.norm.weight") == ("model.norm.weight", None, None)


def test_a_missing_shard_of_a_merged_projection_is_an_error(tiny_model_dirs, tmp_path):
    """Loading k_proj alone into the merged QKV is not enough: its q and v parts would stay
    uninitialised."""
    src = tiny_model_dirs["llama"]
    dst = tmp_path / "no_v"
    dst.mkdir()
    _copy_config(src, str(dst))
    state = load_file(os.path.join(src, "model.safetensors"))
    del state["model.layers.1.self_attn.v_proj.weight"]
    save_file(state, str(dst / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks 1 weights the model needs: model\.layers\.1\.self_attn\.qkv_proj\.weight"):
        LLMEngine(EngineConfig(model=str(dst), device="cpu", num_kv_blocks=16))
