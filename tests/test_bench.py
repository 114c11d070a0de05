"""`agent-infer bench`: the random-weights writer, the roofline arithmetic, and the
latency / throughput commands really run on the tiny random preset on CPU."""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from agent_infer.bench import random_weights as rw
from agent_infer.bench.cli import PRESETS as CLI_PRESETS
from agent_infer.bench.cli import add_bench_parser
from agent_infer.bench.hf_baseline import left_pad
from agent_infer.bench.monitor import GpuMonitor, GpuSeries, parse_smi_line
from agent_infer.bench.offline import (
    LatencyRun, fresh_prompts, format_table, json_text, latency_rows, nano_vllm_workload, roofline_bandwidth,
    run_throughput, summarise_latency, uniform_workload,
)
from agent_infer.bench.roofline import decode_roofline, decode_weight_params, gpu_bandwidth_tbs
from agent_infer.bench.step_trace import format_step_summary, summarise_step_trace, trace_for_json
from agent_infer.arguments import add_engine_args
from agent_infer.config import ConfigError, EngineConfig, ModelConfig
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.loader.default_model import DEFAULT_MODEL_NAME
from agent_infer.sampling_params import SamplingParams
from tests.scheduling import record_batches
from tests.tiny_models import VOCAB


def _use_cache(monkeypatch, root, default_model_dir: str) -> None:
    """A private cache in which the default model (for its tokenizer) is a link to the real
    one, so nothing is converted or written outside tmp."""
    monkeypatch.setenv("AGENT_INFER_CACHE", str(root))
    models = root / "models"
    models.mkdir(parents=True, exist_ok=True)
    if not (models / DEFAULT_MODEL_NAME).exists():
        (models / DEFAULT_MODEL_NAME).symlink_to(default_model_dir)


@pytest.fixture(scope="module")
def bench_cache(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("bench-cache")
    with pytest.MonkeyPatch.context() as mp:
        _use_cache(mp, root, default_model_dir)
        yield root


def run_bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command", required=True), add_engine_args)
    args = parser.parse_args(["bench", *argv])
    return args.handler(args)


# ---- random checkpoints ---------------------------------------------------------------


def test_cli_presets_are_the_writers_presets():
    assert set(CLI_PRESETS) == set(rw.PRESETS)


DENSE_PRESETS = sorted(n for n, p in rw.PRESETS.items() if isinstance(p, rw.RandomPreset))
HUB_PRESETS = sorted(n for n, p in rw.PRESETS.items() if isinstance(p, rw.HubPreset))


@pytest.mark.parametrize("name", DENSE_PRESETS)
def test_preset_config_loads_everywhere_and_names_match_transformers(tmp_path, name):
    from transformers import AutoConfig, AutoModelForCausalLM

    preset = rw.PRESETS[name]
    rw.write_config(preset, str(tmp_path))
    ours = ModelConfig.from_hf(str(tmp_path))
    assert ours.architecture == preset.architecture
    assert (ours.hidden_size, ours.num_layers, ours.family.num_heads, ours.family.num_kv_heads, ours.family.head_dim) == (
        preset.hidden_size, preset.num_layers, preset.num_heads, preset.num_kv_heads, preset.head_dim)
    assert ours.vocab_size == preset.vocab_size and ours.tie_word_embeddings == preset.tie_word_embeddings
    assert ours.rope.theta == preset.rope_theta
    assert ours.checkpoint_dtype == torch.bfloat16
    assert ours.family.qkv_bias == (preset.model_type == "qwen2") and ours.family.qk_norm == (preset.model_type == "qwen3")
    if name == "llama3-8b":
        assert ours.rope.rope_type == "llama3" and ours.rope.factor == 8.0 and ours.rope.original_max_position == 8192

    hf = AutoConfig.from_pretrained(str(tmp_path))
    assert type(hf).__name__ == preset.architecture.replace("ForCausalLM", "Config")
    assert hf.num_hidden_layers == preset.num_layers and hf.intermediate_size == preset.intermediate_size
    # transformers' own model, built on the meta device, has exactly our tensors.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    theirs = {k: tuple(v.shape) for k, v in model.state_dict().items() if "rotary_emb" not in k}
    if preset.tie_word_embeddings:
        theirs.pop("lm_head.weight")
    assert theirs == dict(rw.tensor_shapes(preset))


@pytest.mark.parametrize("name", HUB_PRESETS)
def test_hub_presets_load_everywhere_and_hold_transformers_tensors(tmp_path, name):
    """The hub-spelled config parses here and in transformers, and the checkpoint holds
    exactly the tensors transformers' own model has (its experts stacked, ours one by one)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    preset = rw.PRESETS[name]
    rw.write_config(preset, str(tmp_path))
    ours = ModelConfig.from_hf(str(tmp_path))
    assert ours.architecture == preset.architecture and ours.num_layers == preset.num_layers
    if "deepseek" in name:
        assert ours.family.kv_lora_rank + ours.family.qk_rope_head_dim == 576
    else:
        assert ours.family.router.num_experts == 128 and ours.family.head_dim == 128
    hf = AutoConfig.from_pretrained(str(tmp_path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    theirs = {}
    for k, v in model.state_dict().items():
        if k.endswith("mlp.experts.gate_up_proj"):
            e, two_i, h = v.shape
            for i in range(e):
                pre = k.removesuffix("gate_up_proj") + f"{i}."
                theirs[pre + "gate_proj.weight"] = theirs[pre + "up_proj.weight"] = (two_i // 2, h)
        elif k.endswith("mlp.experts.down_proj"):
            for i in range(v.shape[0]):
                theirs[k.removesuffix("down_proj") + f"{i}.down_proj.weight"] = tuple(v.shape[1:])
        elif "rotary_emb" not in k:
            theirs[k] = tuple(v.shape)
    # transformers has no class for V3's MTP layer (it drops those tensors at load).
    mtp = f"model.layers.{ours.num_layers}."
    assert theirs == {n: s for n, s in rw.tensor_shapes(preset) if not n.startswith(mtp)}


def test_writer_shards_index_values_and_cache_reuse(tmp_path, monkeypatch, default_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("AGENT_INFER_CACHE", str(tmp_path))
    preset = rw.PRESETS["tiny"]
    logs: list[str] = []
    path = rw.ensure_random_model("tiny", tokenizer_from=default_model_dir, max_shard_bytes=60_000, log=logs.append)
    assert path == str(tmp_path / "random" / "tiny")
    assert not [p for p in os.listdir(tmp_path / "random") if p != "tiny"], "no partial directory left behind"

    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    shapes = dict(rw.tensor_shapes(preset))
    assert set(index["weight_map"]) == set(shapes)
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 4, "a 60 kB shard limit must split the checkpoint"
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    total = 0
    for shard in shards:
        file = os.path.join(path, shard)
        with safe_open(file, "pt") as f:
            names = set(f.keys())
            assert names == {n for n, s in index["weight_map"].items() if s == shard}
            # within the limit, unless one tensor alone is bigger (the embedding)
            assert sum(math.prod(shapes[n]) * 2 for n in names) <= 60_000 or len(names) == 1
            for n in names:
                t = f.get_tensor(n)
                assert t.dtype == torch.bfloat16 and tuple(t.shape) == shapes[n]
                total += t.numel() * 2
                if n.endswith("norm.weight"):
                    assert (t.float() - 1).abs().max() <= rw.NORM_NOISE + 1e-2
                elif t.numel() > 1000:
                    assert abs(t.float().std().item() - rw.STD) < 0.002 and abs(t.float().mean().item()) < 0.002
    assert total == index["metadata"]["total_size"] == rw.checkpoint_bytes(preset)

    # transformers loads every weight (nothing missing, nothing unexpected) and the tokenizer came along.
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with safe_open(os.path.join(path, index["weight_map"]["model.layers.1.mlp.down_proj.weight"]), "pt") as f:
        assert torch.equal(model.model.layers[1].mlp.down_proj.weight, f.get_tensor("model.layers.1.mlp.down_proj.weight").float())
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) <= preset.vocab_size and max(tok.encode("Hello world")) < preset.vocab_size
    assert os.path.isfile(os.path.join(path, "generation_config.json"))

    # Second call: the cache is used as is.
    stamp = os.path.getmtime(os.path.join(path, shards[0]))
    logs.clear()
    assert rw.ensure_random_model("tiny", log=logs.append) == path
    assert logs == [] and os.path.getmtime(os.path.join(path, shards[0])) == stamp
    assert rw.random_model_ready("tiny") and not rw.random_model_ready("tiny", seed=1)


def test_writer_lays_out_block_fp8_as_the_published_checkpoints(tmp_path, monkeypatch):
    """`fp8_blocks`: the projections (the experts' too) in e4m3 with 128 x 128 block scales
    beside them as `weight_scale_inv`, the same random values quantized; router gates,
    norms, embeddings and the LM head in bf16; the block-fp8 quantization_config; its own
    directory next to the bf16 one. The engine loads it as an fp8 checkpoint."""
    from agent_infer.quantization import fp8 as F8
    from tests.deepseek_models import write_deepseek_model

    monkeypatch.setenv("AGENT_INFER_CACHE", str(tmp_path))
    # Merged projections (gate and up, q_a and kv_a) meet on block boundaries, as at full size.
    src = write_deepseek_model("v3", str(tmp_path / "v3"), hub_spelling=True, intermediate_size=128,
                               moe_intermediate_size=128, q_lora_rank=128)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    monkeypatch.setitem(rw.PRESETS, "v3-test", rw.HubPreset(config["architectures"][0], config))
    path = rw.ensure_random_model("v3-test", max_shard_bytes=200_000, log=lambda _: None, fp8_blocks=True)
    assert path == str(tmp_path / "random" / "v3-test-fp8-block") and rw.random_model_ready("v3-test", fp8_blocks=True)
    assert not rw.random_model_ready("v3-test")
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3",
                                                       "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    stored = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(os.path.join(path, shard), "pt") as f:
            stored |= {n: f.get_tensor(n) for n in f.keys()}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in stored.values()) \
        == rw.checkpoint_bytes(rw.PRESETS["v3-test"], fp8_blocks=True)
    fp8 = {n for n, t in stored.items() if t.dtype == torch.float8_e4m3fn}
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in fp8 and "model.layers.0.self_attn.kv_b_proj.weight" in fp8
    for name, shape in rw.tensor_shapes(rw.PRESETS["v3-test"]):
        t = stored[name]
        if name in fp8:
            scale = stored[name + "_scale_inv"]
            want = F8.quantize_block(rw.random_tensor(name, shape, 0, torch.device("cpu")), (128, 128))
            assert torch.equal(t.view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(scale, want[1]), name
        else:
            assert t.dtype == torch.bfloat16 and name + "_scale_inv" not in stored, name
            assert name.endswith(("norm.weight", "mlp.gate.weight", "embed_tokens.weight", "lm_head.weight",
                                  "e_score_correction_bias")) or ".layers.3." in name, name  # layer 3: the MTP layer
    assert len(fp8) > 20
    engine = LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", num_kv_blocks=32, block_size=16))
    assert engine.model_config.quantization.layout == "block" and engine.model_config.quantization.block == (128, 128)
    out = engine.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3


def test_writer_is_deterministic_and_rewrites_stale_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENT_INFER_CACHE", str(tmp_path))
    path = rw.ensure_random_model("tiny", log=lambda _: None)
    name = "model.layers.0.self_attn.q_proj.weight"
    file = os.path.join(path, "model-00001-of-00001.safetensors")
    with safe_open(file, "pt") as f:
        first = f.get_tensor(name)
    rw.ensure_random_model("tiny", seed=1, log=lambda _: None)  # other settings: rewritten
    with safe_open(file, "pt") as f:
        other = f.get_tensor(name)
    assert not torch.equal(first, other)
    assert torch.equal(rw.random_tensor(name, first.shape, 0, torch.device("cpu")), first)


def test_writer_refuses_clearly_without_disk_space(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENT_INFER_CACHE", str(tmp_path))
    real = rw.shutil.disk_usage
    monkeypatch.setattr(rw.shutil, "disk_usage", lambda p: real(p)._replace(free=10 * 10**9))
    with pytest.raises(ConfigError, match=r"qwen3-8b needs 16\.4 GB .* only 10\.0 GB is free"):
        rw.ensure_random_model("qwen3-8b", log=lambda _: None)
    assert not os.path.exists(rw.random_model_dir("qwen3-8b"))
    assert os.listdir(tmp_path / "random") == []


def test_plan_shards_keeps_order_and_limit():
    shapes = [("a", (10,), "BF16"), ("b", (20,), "BF16"), ("c", (30,), "BF16"), ("d", (100,), "BF16"),
              ("e", (5,), "BF16")]
    shards = rw.plan_shards(shapes, max_bytes=80)
    assert [[n for n, _, _ in s] for s in shards] == [["a", "b"], ["c"], ["d"], ["e"]]


# ---- roofline -------------------------------------------------------------------------


def _config(tmp_path, name: str) -> ModelConfig:
    rw.write_config(rw.PRESETS[name], str(tmp_path / name))
    return ModelConfig.from_hf(str(tmp_path / name))


def test_roofline_qwen3_8b_figure(tmp_path):
    cfg = _config(tmp_path, "qwen3-8b")
    roof = decode_roofline(cfg, dtype_bytes=2, bandwidth_tbs=4.26)
    # 15.1 GB read per token: 3.55 ms, ~281 tok/s at 4.26 TB/s (docs/PERFORMANCE.md).
    assert 15.05e9 < roof.bytes_per_token < 15.2e9
    assert roof.step_seconds * 1e3 == pytest.approx(3.55, abs=0.01)
    assert roof.tokens_per_second(1) == pytest.approx(281, abs=1)
    assert roof.tokens_per_second(8) == pytest.approx(8 * roof.tokens_per_second(1))
    assert decode_roofline(cfg, 2, 4.26, tp=2).tokens_per_second(1) == pytest.approx(2 * roof.tokens_per_second(1))
    # all weights minus the embedding table (untied: the LM head is its own tensor)
    total = sum(math.prod(s) for _, s in rw.tensor_shapes(rw.PRESETS["qwen3-8b"]))
    assert decode_weight_params(cfg) == total - cfg.vocab_size * cfg.hidden_size


def test_roofline_bandwidth_is_the_gpus_own():
    """A GPU model with a stored copy rate takes it without measuring (the same roofline
    every run); any other GPU is measured; a CPU has none unless given."""
    def never():
        raise AssertionError("a stored model must not be measured")

    assert gpu_bandwidth_tbs("NVIDIA H200", never)[0] == 4.26
    tbs, source = gpu_bandwidth_tbs("NVIDIA H100 80GB HBM3", lambda: 3.0149)
    assert tbs == 3.01 and "H100 80GB HBM3" in source
    assert gpu_bandwidth_tbs("NVIDIA H2000", lambda: 1.5)[0] == 1.5  # a whole word, not a prefix
    cpu = SimpleNamespace(device=torch.device("cpu"))
    assert roofline_bandwidth(SimpleNamespace(bandwidth_tbs=None), cpu)[0] is None
    assert roofline_bandwidth(SimpleNamespace(bandwidth_tbs=0.02), cpu) == (0.02, "--bandwidth-tbs")


@pytest.mark.parametrize("name", ["tiny", "qwen3-0.6b", "qwen2-7b", "llama3-8b"])
def test_roofline_counts_every_tensor_but_the_embedding(tmp_path, name):
    cfg = _config(tmp_path, name)
    total = sum(math.prod(s) for _, s in rw.tensor_shapes(rw.PRESETS[name]))
    embed = cfg.vocab_size * cfg.hidden_size
    # Tied: the one table is still read in full as the LM head.
    expected = total if cfg.tie_word_embeddings else total - embed
    assert decode_weight_params(cfg) == expected


@pytest.mark.parametrize("name", ["llama", "qwen3"])  # untied and tied
def test_roofline_through_the_transformers_backend_counts_what_native_counts(tiny_model_dirs, name):
    """The backend's model keeps transformers' own input embedding (an nn.Embedding): it is
    gathered, not read, as the native family's is."""
    native = ModelConfig.from_hf(tiny_model_dirs[name], "native")
    backend = ModelConfig.from_hf(tiny_model_dirs[name], "transformers")
    assert backend.impl == "transformers"
    assert decode_weight_params(backend) == decode_weight_params(native)


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "deepseek-v3-small"])
@pytest.mark.parametrize("batch", [1, 8, 256])
def test_moe_roofline_counts_the_touched_routed_experts_and_all_the_rest(tmp_path, name, batch):
    """Every checkpoint tensor but the embedding and the MTP layer (which plain decoding
    never runs), the routed experts' at the share a step of `batch` tokens touches under
    uniform routing; the shared experts, which one GPU stores among the routed ones,
    always in full."""
    cfg = _config(tmp_path, name)
    f = cfg.family
    e, k = f.n_routed_experts, f.router.top_k
    touched = 1 - (1 - k / e) ** batch
    expected = 0.0
    mtp = f"model.layers.{cfg.num_layers}."
    for tensor, shape in rw.tensor_shapes(rw.PRESETS[name]):
        if tensor == "model.embed_tokens.weight" or tensor.startswith(mtp):
            continue
        expected += math.prod(shape) * (touched if ".mlp.experts." in tensor else 1.0)
    assert decode_weight_params(cfg, batch) == pytest.approx(expected, rel=1e-12)


# ---- report pieces --------------------------------------------------------------------


def test_summarise_latency_medians_and_rates():
    runs = [LatencyRun(0.010, 1.0, 9, [10]), LatencyRun(0.030, 0.5, 9, [10]), LatencyRun(0.020, 2.0, 9, [10])]
    s = summarise_latency(runs, batch=4, output_len=10, input_len=100)
    assert s["ttft_ms"] == pytest.approx(20.0)
    assert s["decode_tok_s_per_seq"] == pytest.approx(9.0)  # median of 9, 18, 4.5
    assert s["decode_tok_s_total"] == pytest.approx(36.0)
    assert s["decode_step_ms"] == pytest.approx(1000 / 9)
    assert s["prefill_tok_s"] == pytest.approx(400 / 0.020)


def test_latency_rows_without_a_roofline():
    """A CPU run without --bandwidth-tbs has no roofline: the column says so with '-'
    instead of a GPU's figure."""
    results = {"ttft_ms": 300.0, "decode_tok_s_per_seq": 19.0, "decode_tok_s_total": 19.0, "decode_step_ms": 52.6,
               "e2e_s": 3.6}
    rows = latency_rows(results, None, None, {}, 1, 128)
    assert [r[0] for r in rows][:3] == ["TTFT ms (128-token prompt, batch 1)", "decode tok/s per sequence",
                                        "decode step ms"]
    assert all(r[4] is None for r in rows)


def test_table_ratio_means_times_faster():
    text = format_table([
        ("rate", 300.0, 10.0, "rate", "281.0 (106.8 %)"),
        ("time ms", 4.0, 100.0, "time", None),
        ("no hf", 5.0, None, "rate", None),
    ])
    lines = text.splitlines()
    assert [c.strip() for c in lines[0].strip("|").split("|")] == ["metric", "agent-infer", "HF", "ratio", "roofline"]
    assert "30.00x" in lines[2] and "281.0 (106.8 %)" in lines[2]
    assert "25.00x" in lines[3]
    assert lines[4].rstrip(" |").endswith("-")


def test_left_padding_for_transformers():
    b = left_pad([[5, 6, 7], [8]], pad_id=0, device=torch.device("cpu"))
    assert b.input_ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert b.attention_mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_monitor_parsing_and_cpu_note():
    assert parse_smi_line("0, 81234, 97\n") == (0, 81234.0, 97.0)
    assert parse_smi_line("1, 512, [N/A]") == (1, 512.0, None)
    assert parse_smi_line("garbage") is None
    s = GpuSeries(0, "H200", mem_mib=[1024.0, 3072.0, 2048.0], util_pct=[10.0, 90.0, 50.0]).summary()
    assert s["peak_memory_gib"] == 3.0 and s["mean_util_pct"] == 50.0 and s["max_util_pct"] == 90.0
    if not torch.cuda.is_available():
        with GpuMonitor(0.01) as mon:
            time.sleep(0.02)
        summary = mon.summary()
        assert summary["gpus"] == [] and "no CUDA GPU" in summary["note"]


def _synthetic_trace(steps: list[tuple[int, int, float, float]]) -> dict[str, list]:
    """Trace columns from (prefill, seqs, blocked_s, period_s) per step."""
    t, cols = 0.0, {name: [] for name in ("t_s", "prefill", "seqs", "tokens", "decode_rows", "blocked_s", "period_s")}
    for prefill, seqs, blocked, period in steps:
        t += period
        for name, v in zip(cols, (t, prefill, seqs, seqs, 0, blocked, period)):
            cols[name].append(v)
    return cols


def test_step_summary_bands_totals_and_host_bound_share():
    cols = _synthetic_trace([
        (1, 100, 0.030, 0.040), (1, 50, 0.0001, 0.010),                     # prefill: one host-bound
        (0, 256, 0.009, 0.010), (0, 129, 0.008, 0.010),                     # 129-256
        (0, 128, 0.0, 0.005), (0, 65, 0.0001, 0.004), (0, 100, 0.003, 0.006),  # 65-128: two host-bound
        (0, 8, 0.0, 0.002), (0, 1, 0.0019, 0.002),                          # 1-8
        (0, 9, 0.001, 0.003),                                               # 9-32
    ])
    bands = {b.label: b.as_dict() for b in summarise_step_trace(cols)}
    assert list(bands) == ["prefill", "decode 1-8", "decode 9-32", "decode 33-64", "decode 65-128",
                           "decode 129-256", "total"]  # no ">256" band: no step is in it
    p = bands["prefill"]
    assert (p["steps"], p["total_s"], p["mean_ms"]) == (2, pytest.approx(0.050), pytest.approx(25.0))
    assert p["blocked_ms"] == pytest.approx(15.05) and p["host_bound_share"] == 0.5
    mid = bands["decode 65-128"]
    assert mid["steps"] == 3 and mid["total_s"] == pytest.approx(0.015)
    assert mid["host_bound_share"] == pytest.approx(2 / 3)
    assert mid["blocked_ms"] == pytest.approx(1.0333, abs=1e-4)
    assert bands["decode 1-8"]["host_bound_share"] == 0.5 and bands["decode 129-256"]["host_bound_share"] == 0.0
    assert bands["decode 33-64"] == {"band": "decode 33-64", "steps": 0, "total_s": 0.0, "mean_ms": None,
                                     "blocked_ms": None, "host_bound_share": None}
    total = bands["total"]
    assert total["steps"] == 10 and total["total_s"] == pytest.approx(cols["t_s"][-1]) == pytest.approx(0.092)
    assert total["host_bound_share"] == pytest.approx(0.4)
    assert sum(b["total_s"] for k, b in bands.items() if k != "total") == pytest.approx(total["total_s"])

    big = summarise_step_trace(_synthetic_trace([(0, 257, 0.01, 0.02), (0, 512, 0.0, 0.03)]))
    assert [(b.label, b.steps) for b in big][-2:] == [("decode >256", 2), ("total", 2)]
    assert summarise_step_trace(cols, host_bound_s=0.0)[-1].host_bound == 0  # nothing blocks < 0

    text = format_step_summary(summarise_step_trace(cols), wall_s=0.095)
    rows = _table_rows(text)
    assert rows["prefill"] == ["2", "0.050", "25.000", "15.050", "50.0 %"]
    assert rows["decode 33-64"] == ["0", "-", "-", "-", "-"]
    assert rows["total"][:2] == ["10", "0.092"] and "0.092 s of the 0.095 s wall" in text


def test_trace_for_json_rounds_times_only():
    cols = {"t_s": [0.1234567891], "prefill": [1], "seqs": [3], "blocked_s": [1e-9], "period_s": [0.0000014]}
    assert trace_for_json(cols) == {"t_s": [0.123457], "prefill": [1], "seqs": [3], "blocked_s": [0.0],
                                    "period_s": [0.000001]}


def test_json_text_puts_number_lists_on_one_line():
    payload = {"trace": {"t_s": [0.5, 1.25, -3e-05], "seqs": [256, 1]}, "names": ["a", "b"], "s": "[1,  2]", "e": []}
    text = json_text(payload)
    assert json.loads(text) == payload
    assert '"t_s": [0.5, 1.25, -3e-05]' in text and '"seqs": [256, 1]' in text
    assert '"names": [\n' in text  # lists of strings keep indent=2's layout


def test_uniform_workload_is_seeded_and_in_range():
    prompts, outs = uniform_workload(50, 100, 1024, vocab=1000, seed=3)
    assert len(prompts) == len(outs) == 50
    assert all(100 <= len(p) <= 1024 for p in prompts) and all(100 <= n <= 1024 for n in outs)
    assert all(0 <= t < 1000 and isinstance(t, int) for p in prompts for t in p)
    assert uniform_workload(50, 100, 1024, vocab=1000, seed=3) == (prompts, outs)


def test_nano_vllm_workload_is_its_bench_draw():
    """nano-vllm's bench.py: random.seed(0); the prompts (a length, then its ids), then the
    max_tokens, all from Python's global generator. 256 requests give 133,966 output tokens."""
    import random

    random.seed(0)
    expected = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
    expected_out = [random.randint(100, 1024) for _ in range(256)]
    prompts, outs = nano_vllm_workload(256, 100, 1024, vocab=151936, seed=0)
    assert prompts == expected and outs == expected_out
    assert sum(outs) == 133966
    # A small vocabulary keeps its ids in range.
    small, _ = nano_vllm_workload(8, 100, 1024, vocab=500, seed=0)
    assert max(max(p) for p in small) < 500


def test_fresh_prompts_keep_the_lengths_and_share_no_block():
    prompts, _ = nano_vllm_workload(32, 100, 1024, vocab=151936, seed=0)
    fresh = fresh_prompts(prompts, 151936, seed=101)
    assert [len(p) for p in fresh] == [len(p) for p in prompts]
    assert all(max(p) <= 10000 for p in fresh)
    first_blocks = {tuple(p[:16]) for p in prompts}
    assert not any(tuple(p[:16]) in first_blocks for p in fresh), "a fresh round would hit the prefix cache"
    assert fresh_prompts(prompts, 151936, seed=101) == fresh


# ---- the commands, really run -----------------------------------------------------------


def _table_rows(out: str) -> dict[str, list[str]]:
    rows = {}
    for line in out.splitlines():
        if line.startswith("| ") and not line.startswith("|-"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    return rows


def test_latency_command_on_tiny(bench_cache, tmp_path, capsys):
    out_json = tmp_path / "lat.json"
    prof = tmp_path / "prof"
    rc = run_bench([
        "latency", "--random-weights", "tiny", "--device", "cpu", "--kv-cache-gib", "0.02",
        "--input-len", "24", "--output-len", "6", "--batch-size", "2", "--num-iters", "2", "--num-warmup", "1",
        "--compare-hf", "--profile", str(prof), "--profile-steps", "3", "--output-json", str(out_json),
        "--bandwidth-tbs", "0.02",  # a CPU's roofline needs the machine's bandwidth
    ])
    assert rc == 0
    out = capsys.readouterr().out
    rep = json.loads(out_json.read_text())
    assert rep["roofline"]["bandwidth_tbs"] == 0.02
    r = rep["results"]
    assert rep["benchmark"] == "latency" and rep["model"]["random_weights"] == "tiny"
    assert rep["model"]["path"] == str(bench_cache / "random" / "tiny")
    assert rep["engine_config"]["max_num_seqs"] == 2  # latency defaults its slots to the batch
    assert rep["date_utc"] and "torch" in rep["environment"] and "commit" in rep["git"]
    assert len(r["iterations"]) == 2 and all(it["output_lens"] == [6] for it in r["iterations"])
    assert r["decode_steps"] == 5  # 6 tokens: 1 from prefill + 5 decode steps
    assert r["decode_tok_s_total"] == pytest.approx(2 * r["decode_tok_s_per_seq"])
    assert r["ttft_ms"] > 0 and r["e2e_s"] * 1e3 > r["ttft_ms"]
    roof = rep["roofline"]
    assert roof["bytes_per_token"] == decode_weight_params(ModelConfig.from_hf(rep["model"]["path"])) * 4  # fp32 on CPU
    assert roof["achieved_fraction"] == pytest.approx(r["decode_tok_s_total"] / roof["decode_tok_s_total"])
    # The cache beside the weights: 2 sequences at a mean context of 24 + 6 / 2 tokens, the
    # tiny preset's K and V (2 layers x 2 KV heads x 32 dims x 2 x fp32) for each.
    assert roof["cache_bytes_per_step"] == 2 * 27 * (2 * 2 * 32 * 2 * 4)
    step_with_cache = (roof["bytes_per_token"] + roof["cache_bytes_per_step"]) / (roof["bandwidth_tbs"] * 1e12)
    assert roof["decode_tok_s_per_seq_with_cache"] == pytest.approx(1 / step_with_cache)
    assert roof["achieved_fraction_with_cache"] > roof["achieved_fraction"]
    hf = rep["hf"]
    assert hf["ttft_ms"] > 0 and hf["decode_tok_s_per_seq"] > 0 and "transformers" in hf["description"]
    # the profile: a chrome trace of 3 decode steps at batch 2
    assert rep["profile"]["decode_steps"] == 3 and rep["profile"]["batch"] == 2
    assert "traceEvents" in json.loads((prof / "trace-latency.json").read_text())
    # the table is printed last, with the HF ratio
    assert out.rstrip().splitlines()[-1].startswith("| peak") or out.rstrip().splitlines()[-1].startswith("| end-to-end")
    rows = _table_rows(out)
    ttft = rows["TTFT ms (24-token prompts, batch 2)"]
    assert ttft[2] == f"{hf['ttft_ms'] / r['ttft_ms']:,.2f}x"
    assert rows["decode tok/s per sequence"][3].endswith("%)")


def test_throughput_command_on_tiny(bench_cache, tmp_path, capsys):
    out_json = tmp_path / "thr.json"
    rc = run_bench([
        "throughput", "--random-weights", "tiny", "--device", "cpu", "--kv-cache-gib", "0.02",
        "--num-seqs", "6", "--min-len", "24", "--max-len", "40", "--seed", "5", "--rounds", "2",
        "--compare-hf", "--hf-num-seqs", "3", "--profile", str(tmp_path / "prof"), "--profile-steps", "2",
        "--output-json", str(out_json),
    ])
    assert rc == 0
    out = capsys.readouterr().out
    rep = json.loads(out_json.read_text())
    r = rep["results"]
    # two traces: 2 decode steps at the full batch; the first 2 steps of 6 other prompts of
    # 32 tokens (two blocks each), whose 192 tokens take one prefill step, all computed (the
    # decode trace's prompts would have come from the prefix cache), so the second step decodes
    decode, prefill = rep["profile"], rep["profile_prefill"]
    assert decode["phase"] == "decode" and decode["decode_steps"] == 2 and decode["batch"] == 6
    assert decode["prompt_tokens_computed"] == 0  # their prefill ran before the trace
    assert prefill["phase"] == "prefill" and prefill["steps"] == 2 and prefill["prompt_tokens"] == 192
    assert prefill["prompt_tokens_computed"] == 192
    assert (prefill["prefill_steps"], prefill["decode_steps"]) == (1, 1)
    for tag in ("throughput", "throughput-prefill"):
        assert "traceEvents" in json.loads((tmp_path / "prof" / f"trace-{tag}.json").read_text())
    assert "2 steps from the start (1 prefill, 1 decode; 192 prompt tokens in all, 192 computed in the trace)" in out
    prompts, outs = nano_vllm_workload(6, 24, 40, rw.PRESETS["tiny"].vocab_size, seed=5)
    assert r["num_requests"] == 6
    # the first batch is the headline; the later round ran the same lengths with fresh ids
    (later,) = r["later_rounds"]
    assert later["output_tokens"] == r["output_tokens"] and later["input_tokens"] == r["input_tokens"]
    assert later["cached_prompt_tokens"] == 0 == r["cached_prompt_tokens"]
    assert r["later_output_tok_s"] == later["output_tok_s"]
    assert r["first_vs_later"] == pytest.approx(r["output_tok_s"] / later["output_tok_s"])
    assert r["kernel_compiles"] is None  # counted on GPUs only
    assert r["output_tokens"] == sum(outs) and r["input_tokens"] == sum(len(p) for p in prompts)
    assert r["output_tok_s"] == pytest.approx(r["output_tokens"] / r["wall_s"])
    assert r["total_tok_s"] == pytest.approx((r["input_tokens"] + r["output_tokens"]) / r["wall_s"])
    assert r["requests_s"] == pytest.approx(6 / r["wall_s"])
    hf = rep["hf"]
    assert hf["num_requests"] == 3 and hf["new_tokens_per_request"] == round(sum(outs[:3]) / 3)
    assert hf["padded_prompt_len"] == max(len(p) for p in prompts[:3])
    assert hf["output_tok_s"] == pytest.approx(hf["output_tokens"] / hf["seconds"])
    rows = _table_rows(out)
    assert rows["output tok/s, first batch"][2] == f"{r['output_tok_s'] / hf['output_tok_s']:,.2f}x"
    assert "output tok/s, later rounds (median of 1)" in rows
    assert "first 3 requests as one batch" in out
    # the step timeline: in the JSON, summarised there and in a table after the main one
    trace = r["step_trace"]
    assert len(trace["t_s"]) == r["engine_steps"] and sum(trace["prefill"]) == r["prefill_steps"]
    summary = {b["band"]: b for b in r["step_summary"]}
    assert summary["total"]["steps"] == r["engine_steps"] and summary["prefill"]["steps"] == r["prefill_steps"]
    assert summary["total"]["total_s"] == pytest.approx(r["wall_s"], rel=0.05)
    assert out.index("| output tok/s, first batch") < out.index("| step band")
    assert rows["total"][0] == str(r["engine_steps"]) and rows["prefill"][0] == str(r["prefill_steps"])


@pytest.mark.parametrize("mixed", [False, True], ids=["prefill-only", "mixed"])
def test_throughput_step_trace_matches_the_engine(tiny_model_dirs, mixed):
    """The timed run's trace: one entry per step the engine ran, in order, with that batch's
    shape; counts by kind equal the engine's stats; the periods add up to the wall time."""
    engine = LLMEngine(EngineConfig(model=tiny_model_dirs["qwen3"], device="cpu", dtype="float32", num_kv_blocks=96,
                                    block_size=16, max_num_batched_tokens=32, mixed_batches=mixed))
    batches = record_batches(engine)
    prompts, out_lens = uniform_workload(6, 4, 24, VOCAB, seed=2)
    r = run_throughput(engine, prompts, out_lens, temperature=0.6, seed=0)
    trace, stats = r["step_trace"], engine.stats
    assert stats.trace is None, "the trace stops with the timed run"
    assert len(trace["t_s"]) == len(batches) == stats.steps == r["engine_steps"]
    assert sum(trace["prefill"]) == stats.prefill_steps == r["prefill_steps"] > 1  # prompts came in chunks
    assert trace["prefill"].count(0) == stats.decode_steps == r["decode_steps"]
    assert trace["prefill"] == [int(b.is_prefill) for b in batches]
    assert trace["seqs"] == [len(b) for b in batches] and trace["tokens"] == [b.num_tokens for b in batches]
    assert trace["decode_rows"] == [b.num_decode for b in batches]
    assert any(trace["decode_rows"]) == mixed
    assert max(s for s, p in zip(trace["seqs"], trace["prefill"]) if not p) == stats.max_decode_batch
    assert all(0 <= b <= p for b, p in zip(trace["blocked_s"], trace["period_s"]))
    assert trace["t_s"] == sorted(trace["t_s"])
    # The periods cover the timed run up to the last step's read-back; only its bookkeeping is left.
    assert sum(trace["period_s"]) == pytest.approx(trace["t_s"][-1], abs=1e-5)
    assert trace["t_s"][-1] <= r["wall_s"] and r["wall_s"] - trace["t_s"][-1] < max(0.05 * r["wall_s"], 0.005)
    bands = summarise_step_trace(trace)
    assert bands[-1].steps == stats.steps and bands[0].steps == stats.prefill_steps
    # Times to first token: every request queued at once waits at least for the first step.
    first_step_ms = trace["t_s"][0] * 1e3
    assert first_step_ms * 0.5 <= r["ttft_ms"]["median"] <= r["ttft_ms"]["p99"] <= r["wall_s"] * 1e3
    print("\n" + format_step_summary(bands, r["wall_s"]))


def test_latency_rejects_model_and_random_weights_together(bench_cache):
    with pytest.raises(ConfigError, match="either --model or --random-weights"):
        run_bench(["latency", "--random-weights", "tiny", "--model", "/nowhere", "--device", "cpu"])


def test_bench_registers_latency_throughput_and_serve():
    parser = argparse.ArgumentParser()
    bench = add_bench_parser(parser.add_subparsers(dest="command"), add_engine_args)
    sub = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    assert set(sub.choices) == {"latency", "throughput", "serve"}
    args = parser.parse_args(["bench", "latency", "--random-weights", "qwen3-8b"])
    assert (args.input_len, args.output_len, args.batch_size, args.max_num_seqs) == (512, 256, 1, None)
    assert args.bandwidth_tbs is None and callable(args.handler)  # the GPU's own rate, no roofline on a CPU
    args = parser.parse_args(["bench", "throughput"])
    assert (args.num_seqs, args.min_len, args.max_len, args.temperature, args.max_num_seqs) == (256, 100, 1024, 0.6, None)  # None: the engine's 256
    assert (args.workload, args.rounds, args.num_warmup) == ("nano-vllm", 3, 0)


def test_monitor_nvml_path_with_a_fake_driver(monkeypatch):
    """The GPU-only sampling path, run on CPU against a stand-in pynvml with two GPUs."""
    import sys
    import types

    calls = {"init": 0, "shutdown": 0}
    used = {0: [1000, 5000, 3000], 1: [200, 200, 200]}
    util = {0: [10, 100, 40], 1: [0, 0, 0]}
    reads = {0: 0, 1: 0}

    def mem_info(h):
        i = min(reads[h], 2)
        return types.SimpleNamespace(used=used[h][i] * 2**20)

    def rates(h):
        i = min(reads[h], 2)
        reads[h] += 1
        return types.SimpleNamespace(gpu=util[h][i])

    fake = types.SimpleNamespace(
        nvmlInit=lambda: calls.__setitem__("init", calls["init"] + 1),
        nvmlShutdown=lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1),
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: b"NVIDIA H200" if h == 0 else "NVIDIA H200",
        nvmlDeviceGetMemoryInfo=mem_info,
        nvmlDeviceGetUtilizationRates=rates,
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda i=None: 0)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda i=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda i=None: 3 * 2**30)
    with GpuMonitor(0.005) as mon:
        deadline = time.time() + 5
        while min(reads.values()) < 3 and time.time() < deadline:
            time.sleep(0.005)
    s = mon.summary()
    assert s["source"] == "nvml" and calls == {"init": 1, "shutdown": 1}
    g0, g1 = s["gpus"]
    assert g0["name"] == g1["name"] == "NVIDIA H200"
    assert g0["peak_memory_gib"] == pytest.approx(5000 / 1024, abs=1e-3) and g0["max_util_pct"] == 100
    assert g1["peak_memory_gib"] == pytest.approx(200 / 1024, abs=1e-3) and g1["mean_util_pct"] == 0
    assert s["torch_peak_allocated_gib"] == {"cuda:0": 3.0}


def test_monitor_falls_back_to_a_streaming_nvidia_smi(monkeypatch, tmp_path):
    """Without pynvml: one `nvidia-smi --loop-ms` process whose lines are parsed (a stand-in here)."""
    import stat
    import sys

    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\n"
        'case "$*" in *--loop-ms=*) ;; *) exit 3 ;; esac\n'
        "while true; do echo '0, 4096, 55'; echo '1, 1024, [N/A]'; sleep 0.01; done\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda i=None: 0)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda i=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda i=None: 0)
    with GpuMonitor(0.1) as mon:
        deadline = time.time() + 5
        while len(mon.series) < 2 and time.time() < deadline:
            time.sleep(0.02)
    proc = mon._proc  # noqa: SLF001
    assert proc is not None and proc.poll() is not None, "the sampler process is stopped"
    s = mon.summary()
    assert s["source"] == "nvidia-smi"
    g0, g1 = s["gpus"]
    assert g0["peak_memory_gib"] == 4.0 and g0["mean_util_pct"] == 55.0
    assert g1["peak_memory_gib"] == 1.0 and g1["max_util_pct"] is None


def _gpu_event(name: str, start: float, end: float, device_type=None):
    from torch.autograd import DeviceType

    return SimpleNamespace(name=name, device_type=device_type or DeviceType.CUDA,
                           time_range=SimpleNamespace(start=start, end=end))


def test_top_kernels_charge_overlapped_launches_only_what_runs_past_their_predecessor():
    from torch.autograd import DeviceType

    from agent_infer.bench.profiling import top_kernels

    # A kernel launched early (PDL) inside its predecessor's tail, a gap, a kernel wholly
    # inside another, and a host event that must not count.
    events = [
        _gpu_event("gemv", 0.0, 10.0),
        _gpu_event("attn", 8.0, 14.0),  # 2 us overlapped: exposed 4
        _gpu_event("gemv", 20.0, 30.0),  # after a gap: exposed 10
        _gpu_event("tiny", 22.0, 25.0),  # inside the gemv: exposed 0
        _gpu_event("host", 0.0, 100.0, DeviceType.CPU),
    ]
    rows = {r["name"]: r for r in top_kernels(reversed(events))}  # order of arrival must not matter
    assert set(rows) == {"gemv", "attn", "tiny"}
    assert rows["gemv"]["total_us"] == 20.0 and rows["gemv"]["exposed_us"] == 20.0 and rows["gemv"]["calls"] == 2
    assert rows["attn"]["total_us"] == 6.0 and rows["attn"]["exposed_us"] == 4.0
    assert rows["tiny"]["exposed_us"] == 0.0 and rows["tiny"]["avg_us"] == 3.0
    # The exposed times add up to the busy span: [0, 14] and [20, 30].
    assert sum(r["exposed_us"] for r in rows.values()) == 24.0
    assert [r["name"] for r in top_kernels(events)] == ["gemv", "attn", "tiny"]
