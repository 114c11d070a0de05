"""Random checkpoints of real model shapes, so full-size benchmarks need no download.

`ensure_random_model(name)` writes, once, a Hugging Face directory under
`$AGENT_INFER_CACHE/random/NAME` (default `~/.cache/agent-infer/random/NAME`):
config.json (the classic transformers 4.x layout, which 5.x converts on load),
generation_config.json, bf16 safetensors shards of at most ~4 GB with
model.safetensors.index.json, and, when given, a tokenizer's files. With `fp8_blocks`
(directory NAME-fp8-block) the checkpoint is laid out as DeepSeek-V3's and Qwen3's FP8
releases are: every projection of the attention and MLP blocks (the experts' included)
in e4m3 with one float32 scale per 128 x 128 block in `<name>.weight_scale_inv`, the
same random values quantized; embeddings, norms, router gates and the LM head in bf16.

The shards are written by hand (the safetensors format is an 8-byte header length, a
JSON header and the raw bytes), one tensor at a time, so the host never holds more
than one tensor: the 16 GB of Qwen3-8B stream through a few hundred MB of memory.
Tensors are drawn on the GPU when one is present (fast), on the CPU otherwise.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import sys
import tempfile
import zlib
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from agent_infer.config import ConfigError, ModelConfig
from agent_infer.loader.default_model import cache_root
from agent_infer.models.registry import resolve_model_class
from agent_infer.quantization.fp8 import quantize_block

SHARD_BYTES = 4 * 10**9  # like HF's "4GB" shards
STD = 0.02  # normal std of weight matrices (the usual initializer_range)
NORM_NOISE = 0.02  # norm weights are 1 +- this, uniform
_DONE = ".agent-infer-random.json"  # written last: its presence means the directory is complete
_FORMAT = 1  # bump when the layout written here changes, so old caches are rewritten
_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
)


@dataclass(frozen=True)
class RandomPreset:
    """The shape of a dense decoder checkpoint (Llama / Qwen2 / Qwen3 layout)."""

    architecture: str
    model_type: str  # llama | qwen2 | qwen3
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    bos_token_id: int
    eos_token_id: int
    rope_scaling: dict | None = field(default=None, hash=False)


@dataclass(frozen=True)
class HubPreset:
    """A checkpoint shape given as the hub's config.json (a family with more to say than
    the dense fields above: DeepSeek's latent attention and experts)."""

    architecture: str
    config: dict = field(hash=False)

    def __getattr__(self, name: str):
        key = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads"}.get(name, name)
        if key in self.__dict__.get("config", {}):
            return self.config[key]
        raise AttributeError(name)


_DEEPSEEK_V2_LITE = {  # deepseek-ai/DeepSeek-V2-Lite's config.json (its code's 4.x spelling)
    "model_type": "deepseek_v2", "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
    "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 64,
    "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "vocab_size": 102400, "max_position_embeddings": 163840, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    "rms_norm_eps": 1e-6, "topk_method": "greedy", "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
    "scoring_func": "softmax", "norm_topk_prob": False, "aux_loss_alpha": 0.001, "seq_aux": True, "ep_size": 1,
    "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 100000, "eos_token_id": 100001,
}
# DeepSeek-V3's layout (q low-rank, sigmoid routing with a bias over grouped experts, a
# scaled and renormalised top-8, dense first layers) at a size one GPU loads in seconds.
_DEEPSEEK_V3_SMALL = {
    "model_type": "deepseek_v3", "hidden_size": 1024, "intermediate_size": 2816, "moe_intermediate_size": 256,
    "num_hidden_layers": 6, "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 64,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "kv_lora_rank": 512, "q_lora_rank": 384, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "vocab_size": 49152, "max_position_embeddings": 16384, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "rms_norm_eps": 1e-6, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid", "norm_topk_prob": True, "hidden_act": "silu", "attention_bias": False,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1,
    "num_nextn_predict_layers": 1,  # V3's MTP layer (loaded only for --speculative-config method mtp)
}

_QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B's config.json
    "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645,
}


PRESETS: dict[str, RandomPreset | HubPreset] = {
    "qwen3-8b": RandomPreset(
        "Qwen3ForCausalLM", "qwen3", hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
        num_kv_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645,
    ),
    "qwen3-0.6b": RandomPreset(
        "Qwen3ForCausalLM", "qwen3", hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
        num_kv_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6,
        rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645,
    ),
    "llama3-8b": RandomPreset(
        "LlamaForCausalLM", "llama", hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    ),
    "qwen2-7b": RandomPreset(
        "Qwen2ForCausalLM", "qwen2", hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
        num_kv_heads=4, head_dim=128, vocab_size=152064, max_position_embeddings=32768, rope_theta=1e6,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151643,
    ),
    # The default model's shape (SmolLM2-135M-Instruct): its step costs on a GPU without
    # its weights (a 135M model's kernels are latency, not bytes: random values time alike).
    "smollm2-135m": RandomPreset(
        "LlamaForCausalLM", "llama", hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    ),
    # A few MB, for tests. The vocabulary is SmolLM2's (49152) so the copied tokenizer's
    # ids are all valid and text prompts work too.
    "tiny": RandomPreset(
        "Qwen3ForCausalLM", "qwen3", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=32, vocab_size=49152, max_position_embeddings=4096, rope_theta=1e6,
        rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    ),
    "deepseek-v2-lite": HubPreset("DeepseekV2ForCausalLM", _DEEPSEEK_V2_LITE),
    "deepseek-v3-small": HubPreset("DeepseekV3ForCausalLM", _DEEPSEEK_V3_SMALL),
    "qwen3-30b-a3b": HubPreset("Qwen3MoeForCausalLM", _QWEN3_30B_A3B),
}


def get_preset(name: str) -> RandomPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown --random-weights preset {name!r}; choose one of {', '.join(PRESETS)}") from None


# DeepSeek-V3's `quantization_config`, which Qwen3's FP8 checkpoints share.
FP8_BLOCK = (128, 128)
FP8_BLOCK_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": list(FP8_BLOCK)}
# The tensors such a checkpoint stores in e4m3: the matrices of the layers' attention and
# MLP blocks but the router gates (`mlp.gate.weight`); not norms, embeddings or LM head.
_FP8_STORED = re.compile(r"\.(self_attn|mlp)\.(?!gate\.weight$).*\.weight$")
_BYTES = {"BF16": 2, "F8_E4M3": 1, "F32": 4}
Entry = tuple[str, tuple[int, ...], str]  # a stored tensor: name, shape, safetensors dtype


def random_model_dir(name: str, fp8_blocks: bool = False) -> str:
    return os.path.join(cache_root(), "random", name + ("-fp8-block" if fp8_blocks else ""))


# ---- what the checkpoint holds --------------------------------------------------------


def tensor_shapes(p: RandomPreset) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the checkpoint in file order, with HF names: what the family's own
    model expects of a checkpoint of this shape (its biases, norms and ties included)."""
    cfg = ModelConfig.from_dict(hf_config(p))
    return resolve_model_class(cfg.architecture, cfg.impl).checkpoint_tensors(cfg)


def tensor_entries(p: RandomPreset, fp8_blocks: bool = False) -> list[Entry]:
    """(name, shape, safetensors dtype) of every tensor the checkpoint stores, in file
    order: `tensor_shapes` in bf16, or with `fp8_blocks` each projection in e4m3 followed
    by its block scales."""
    out = []
    for name, shape in tensor_shapes(p):
        if fp8_blocks and len(shape) == 2 and _FP8_STORED.search(name):
            scales = tuple(-(-n // b) for n, b in zip(shape, FP8_BLOCK))
            out += [(name, shape, "F8_E4M3"), (name + "_scale_inv", scales, "F32")]
        else:
            out.append((name, shape, "BF16"))
    return out


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    return math.prod(shape) * _BYTES[dtype]


def checkpoint_bytes(p: RandomPreset, fp8_blocks: bool = False) -> int:
    return sum(_nbytes(s, d) for _, s, d in tensor_entries(p, fp8_blocks))


def plan_shards(entries: list[Entry], max_bytes: int) -> list[list[Entry]]:
    """Greedy split in file order; a tensor bigger than max_bytes gets a shard of its own."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        n = _nbytes(entry[1], entry[2])
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += n
    return shards


def hf_config(p: RandomPreset, fp8_blocks: bool = False) -> dict:
    """config.json in the layout both transformers 4.x (rope_theta + rope_scaling) and 5.x
    (which converts those into rope_parameters) read; with `fp8_blocks`, the block-fp8
    `quantization_config`."""
    if fp8_blocks:
        return {**hf_config(p), "quantization_config": dict(FP8_BLOCK_CONFIG)}
    if isinstance(p, HubPreset):
        return {"architectures": [p.architecture], **p.config}
    cfg = {
        "architectures": [p.architecture],
        "model_type": p.model_type,
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_layers,
        "num_attention_heads": p.num_heads,
        "num_key_value_heads": p.num_kv_heads,
        "head_dim": p.head_dim,
        "vocab_size": p.vocab_size,
        "max_position_embeddings": p.max_position_embeddings,
        "rope_theta": p.rope_theta,
        "rms_norm_eps": p.rms_norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": p.tie_word_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": STD,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "bos_token_id": p.bos_token_id,
        "eos_token_id": p.eos_token_id,
    }
    if p.rope_scaling is not None:
        cfg["rope_scaling"] = dict(p.rope_scaling)
    if p.model_type in ("llama", "qwen3"):
        cfg["attention_bias"] = False
    if p.model_type == "llama":
        cfg["mlp_bias"] = False
    if p.model_type in ("qwen2", "qwen3"):
        cfg["use_sliding_window"] = False
        cfg["max_window_layers"] = p.num_layers
    return cfg


def write_config(p: RandomPreset, out_dir: str, fp8_blocks: bool = False) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config(p, fp8_blocks), f, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": p.bos_token_id, "eos_token_id": p.eos_token_id, "do_sample": False}, f, indent=2)


# ---- writing ----------------------------------------------------------------------------


def _generator_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def random_tensor(name: str, shape: tuple[int, ...], seed: int, device: torch.device) -> torch.Tensor:
    """bf16: norm weights 1 +- NORM_NOISE, everything else N(0, STD). Seeded per tensor, so
    the same preset and seed give the same bytes whichever order tensors are drawn in."""
    g = torch.Generator(device=device)
    g.manual_seed(zlib.crc32(f"{seed}:{name}".encode()))  # 32 bits: all the CPU generator uses
    t = torch.empty(shape, dtype=torch.bfloat16, device=device)
    if name.endswith("norm.weight"):
        return t.uniform_(1.0 - NORM_NOISE, 1.0 + NORM_NOISE, generator=g)
    return t.normal_(0.0, STD, generator=g)


_TORCH_DTYPES = {"BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn, "F32": torch.float32}


def write_safetensors(path: str, entries: list[Entry], make: Callable[[str, tuple[int, ...], str], torch.Tensor]
                      ) -> None:
    """A safetensors file, tensor by tensor: the header is known from the shapes alone;
    `make(name, shape, dtype)` gives each tensor."""
    header: dict = {}
    offset = 0
    for name, shape, dtype in entries:
        n = _nbytes(shape, dtype)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape, dtype in entries:
            t = make(name, shape, dtype)
            if t.dtype != _TORCH_DTYPES[dtype] or tuple(t.shape) != tuple(shape):
                raise AssertionError(f"{name}: made {t.dtype} {tuple(t.shape)}, header says {dtype} {shape}")
            data = t.contiguous().cpu().view(torch.uint8).numpy()  # little-endian raw bytes
            f.write(memoryview(data).cast("B"))
            del t, data


def _check_disk(folder: str, needed: int, name: str) -> None:
    os.makedirs(folder, exist_ok=True)
    free = shutil.disk_usage(folder).free
    margin = 64 * 2**20
    if free < needed + margin:
        raise ConfigError(
            f"--random-weights {name} needs {needed / 1e9:.1f} GB of disk in {folder} but only "
            f"{free / 1e9:.1f} GB is free; free some space or point AGENT_INFER_CACHE at a larger disk"
        )


def _copy_tokenizer(src: str, dst: str) -> list[str]:
    copied = []
    for fname in _TOKENIZER_FILES:
        path = os.path.join(src, fname)
        if os.path.isfile(path):
            shutil.copyfile(path, os.path.join(dst, fname))
            copied.append(fname)
    return copied


def _provenance(name: str, p: RandomPreset, seed: int, fp8_blocks: bool = False) -> dict:
    stamp = {"format": _FORMAT, "preset": name, "seed": seed, "std": STD, "norm_noise": NORM_NOISE, "shape": asdict(p)}
    return stamp | ({"fp8_block": list(FP8_BLOCK)} if fp8_blocks else {})


def random_model_ready(name: str, seed: int = 0, fp8_blocks: bool = False) -> bool:
    """True when the cache holds NAME written with the current preset and seed."""
    done = os.path.join(random_model_dir(name, fp8_blocks), _DONE)
    if not os.path.isfile(done):
        return False
    with open(done) as f:
        return json.load(f) == _provenance(name, get_preset(name), seed, fp8_blocks)


def ensure_random_model(
    name: str,
    seed: int = 0,
    tokenizer_from: str | None = None,
    max_shard_bytes: int = SHARD_BYTES,
    device: torch.device | None = None,
    log: Callable[[str], None] | None = None,
    fp8_blocks: bool = False,
) -> str:
    """Path of the random checkpoint NAME, writing it first when it is missing or stale;
    `fp8_blocks`: in the block-fp8 layout (the module's docstring)."""
    preset = get_preset(name)
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    target = random_model_dir(name, fp8_blocks)
    want = _provenance(name, preset, seed, fp8_blocks)
    done = os.path.join(target, _DONE)
    if random_model_ready(name, seed, fp8_blocks):
        return target
    if os.path.exists(target):
        say(f"agent-infer: {target} is incomplete or was written with other settings; rewriting it")
        shutil.rmtree(target)
    parent = os.path.dirname(target)
    total = checkpoint_bytes(preset, fp8_blocks)
    _check_disk(parent, total, name)
    device = device or _generator_device()
    say(f"agent-infer: writing random {name} weights ({total / 1e9:.2f} GB {'block fp8' if fp8_blocks else 'bf16'}, "
        f"drawn on {device.type}) into {target} (once)...")
    work = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.partial-", dir=parent)
    try:
        _write_all(preset, work, seed, max_shard_bytes, device, say, fp8_blocks)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the engine sizes its KV cache from free memory next
        if tokenizer_from:
            copied = _copy_tokenizer(tokenizer_from, work)
            say(f"agent-infer: tokenizer files from {tokenizer_from}: {', '.join(copied) or 'none found'}")
        with open(os.path.join(work, _DONE), "w") as f:
            json.dump(want, f, indent=2)
        try:
            os.rename(work, target)
        except OSError:
            # Another process finished first; its copy is as good as ours.
            if not os.path.isfile(done):
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    say("agent-infer: random checkpoint ready.")
    return target


class _TensorMaker:
    """Tensors for `write_safetensors`: bf16 random ones, or a projection's random values
    quantized to e4m3 in FP8_BLOCK blocks, its scales kept for the entry that follows."""

    def __init__(self, seed: int, device: torch.device):
        self.seed, self.device = seed, device
        self.scales: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
        if dtype == "F32":
            return self.scales.pop(name)
        t = random_tensor(name, shape, self.seed, self.device)
        if dtype == "BF16":
            return t
        q, scale = quantize_block(t, FP8_BLOCK)
        self.scales[name + "_scale_inv"] = scale
        return q


def _write_all(
    p: RandomPreset, out_dir: str, seed: int, max_shard_bytes: int, device: torch.device, say: Callable[[str], None],
    fp8_blocks: bool = False,
) -> None:
    write_config(p, out_dir, fp8_blocks)
    shards = plan_shards(tensor_entries(p, fp8_blocks), max_shard_bytes)
    n = len(shards)
    weight_map: dict[str, str] = {}
    total = 0
    make = _TensorMaker(seed, device)
    for i, entries in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        write_safetensors(os.path.join(out_dir, fname), entries, make)
        for nm, sh, dtype in entries:
            weight_map[nm] = fname
            total += _nbytes(sh, dtype)
        if n > 1:
            say(f"agent-infer:   shard {i}/{n} written")
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
