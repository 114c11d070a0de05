"""Configuration as data: one frozen dataclass per concern, validated on construction."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from agent_infer.checkpoint_files import ConfigError, read_json_object, require_directory  # noqa: F401 (re-exported)
from agent_infer.models.registry import MODEL_IMPLS
from agent_infer.quantization.fp8 import Fp8Config
from agent_infer.speculative.config import SpeculativeConfig

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}


# --kv-cache-dtype: "auto" keeps the model's dtype. "fp8" stores K and V as float8 e4m3,
# divided by each layer's scales where the checkpoint has them (compressed-tensors'
# kv_cache_scheme), else by scales computed at start-up (calculate_kv_scales) or by 1,
# saturating at +-448: half the bytes per cached token, so
# twice the tokens fit and decode attention reads half as much.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown dtype {name!r}; choose one of bfloat16, float16, float32") from None


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, normalised from both transformers 4.x
    (`rope_theta` + `rope_scaling`) and 5.x (`rope_parameters`) config layouts."""

    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0
    original_max_position: int | None = None
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True
    partial_rotary_factor: float = 1.0

    SUPPORTED = ("default", "linear", "llama3", "yarn")

    @staticmethod
    def from_hf(hf: dict[str, Any]) -> "RopeConfig":
        params: dict[str, Any] = {}
        if isinstance(hf.get("rope_scaling"), dict):
            params.update(hf["rope_scaling"])
        if isinstance(hf.get("rope_parameters"), dict):
            params.update(hf["rope_parameters"])
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type not in RopeConfig.SUPPORTED:
            raise ConfigError(
                f"rope type {rope_type!r} is not supported; supported: {', '.join(RopeConfig.SUPPORTED)}"
            )
        return RopeConfig(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            original_max_position=params.get("original_max_position_embeddings"),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=float(params.get("mscale") or 1.0),
            mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
            attention_factor=params.get("attention_factor"),
            truncate=bool(params.get("truncate", True)),
            partial_rotary_factor=float(
                params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
            ),
        )


# config.json fields that change what a checkpoint computes beyond the dense decoder
# (attention over a compressed latent, mixtures of experts, extra prediction heads). A
# family whose model does not read one of them would serve such a checkpoint wrongly and
# silently, so `refuse_unread_fields` turns it away instead.
ARCHITECTURE_FIELDS = frozenset({
    "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "n_routed_experts", "n_shared_experts", "num_experts", "num_local_experts", "num_experts_per_tok",
    "moe_intermediate_size", "shared_expert_intermediate_size", "first_k_dense_replace", "moe_layer_freq",
    "decoder_sparse_step", "mlp_only_layers", "routed_scaling_factor", "topk_method", "n_group", "topk_group",
    "scoring_func", "norm_topk_prob", "num_nextn_predict_layers",
})


def refuse_unread_fields(hf: dict[str, Any], family: str, reads: frozenset[str]) -> None:
    """ConfigError naming the architecture fields `hf` sets (not null or false) that the
    family's model does not read (`reads`)."""
    unread = sorted(k for k in ARCHITECTURE_FIELDS - reads if hf.get(k) not in (None, False))
    if unread:
        raise ConfigError(
            f"config.json sets {', '.join(unread)}, which the {family} model does not read: "
            f"architectures[0] does not match this checkpoint, or the family is not supported"
        )


def read_config_json(path: str) -> dict[str, Any]:
    """A model directory's config.json as a dict; a missing or unreadable file is a
    ConfigError naming it."""
    require_directory(path, "model", "--model takes the checkpoint's directory (the one holding config.json "
                      "and the *.safetensors weights)", "config.json")
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise ConfigError(f"no config.json in {path}: not a Hugging Face model directory")
    return read_json_object(cfg_file)


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know about a checkpoint, read from its config.json: the
    core every family shares, and the family's own section (`family`, a frozen dataclass
    its model module parses: heads and biases for the dense decoders; latent attention
    and experts for DeepSeek)."""

    path: str
    architecture: str
    model_type: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    checkpoint_dtype: torch.dtype
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    family: Any
    quantization: Fp8Config | None = None  # the checkpoint's fp8 scheme
    impl: str = "native"  # native | transformers (models/registry.py)
    hf: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)

    @staticmethod
    def from_hf(path: str, model_impl: str = "auto") -> "ModelConfig":
        return ModelConfig.from_dict(read_config_json(path), path, model_impl)

    @staticmethod
    def from_dict(hf: dict[str, Any], path: str = "", model_impl: str = "auto") -> "ModelConfig":
        """Parse a config.json's contents (`path`: where it came from, for messages;
        `model_impl`: auto | native | transformers, see models/registry.py)."""
        # The families' modules import this one: find them only when a config is parsed.
        from agent_infer.models.registry import model_impl_of, resolve_model_class

        archs = hf.get("architectures") or []
        if not archs:
            raise ConfigError(f"{os.path.join(path, 'config.json')} has no 'architectures' entry")
        # Multimodal Qwen2-VL style configs nest the language model in text_config.
        text = dict(hf)
        if isinstance(hf.get("text_config"), dict):
            text.update(hf["text_config"])
        eos = text.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        dtype_name = text.get("torch_dtype") or text.get("dtype") or "float32"
        impl = model_impl_of(archs[0], model_impl)
        try:
            family = resolve_model_class(archs[0], impl).config_class.from_hf(text)
            return ModelConfig(
                path=path,
                architecture=archs[0],
                model_type=text.get("model_type", ""),
                hidden_size=int(text["hidden_size"]),
                num_layers=int(text["num_hidden_layers"]),
                vocab_size=int(text["vocab_size"]),
                max_position_embeddings=int(text.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
                # The transformers backend's modules rotate for themselves.
                rope=RopeConfig.from_hf(text) if impl == "native" else RopeConfig(),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
                checkpoint_dtype=parse_dtype(dtype_name),
                bos_token_id=text.get("bos_token_id"),
                eos_token_ids=eos_ids,
                family=family,
                quantization=Fp8Config.from_hf(hf.get("quantization_config") or text.get("quantization_config")),
                impl=impl,
                hf=text,
            )
        except KeyError as e:
            raise ConfigError(f"{os.path.join(path, 'config.json')} lacks {e.args[0]!r}") from None


PreemptionMode = Literal["none", "recompute"]
ALL_REDUCE_MODES = ("auto", "nccl", "symm_mem", "symm_mem_fused")


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes one engine instance. Validated when built."""

    model: str
    dtype: str = "auto"  # auto: bf16 on GPU, fp32 on CPU
    kv_cache_dtype: str = "auto"  # auto: the model's dtype | fp8 (e4m3, see KV_CACHE_DTYPES)
    # An fp8 cache's per-layer scales computed at start-up where the checkpoint has none
    # (vLLM's --calculate-kv-scales; kvcache/calibration.py). False: they stay 1.
    calculate_kv_scales: bool = False
    # "fp8": a full-precision checkpoint's projections quantized as they load (e4m3, one
    # scale per output row, activations per token); None: as the checkpoint stores them.
    quantization: str | None = None
    # auto: the native family where there is one, else transformers' class on the paged
    # cache | native | transformers (models/registry.py)
    model_impl: str = "auto"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    tokenizer: str | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    gpu_memory_utilization: float = 0.90
    kv_cache_bytes: int | None = None  # explicit KV budget; overrides utilisation
    num_kv_blocks: int | None = None  # explicit pool size in blocks; overrides both
    enable_prefix_caching: bool = True
    preemption_mode: PreemptionMode = "none"
    # False: a step is a prefill batch or a decode batch. True:
    # while prompts wait, a step carries every running decode as well (one token each,
    # first) and fills the rest of the token budget with prefill, so decodes never
    # stall behind a prefill step (decodes come first: a budget no larger than the number
    # of running sequences leaves prompts waiting until some finish).
    mixed_batches: bool = False
    enforce_eager: bool = False
    # GPU: a few made-up requests at start-up compile the kernel variants that the first
    # real requests would otherwise wait for (engine/warmup.py).
    warmup: bool = True
    async_scheduling: bool = True  # launch step N+1 before reading step N's tokens back
    attention_backend: str = "auto"  # auto | torch | triton
    tensor_parallel_size: int = 1
    # auto (symmetric memory with the fused all-reduce + add + RMSNorm where each works,
    # else NCCL) | nccl | symm_mem (unfused) | symm_mem_fused (fails if the fusion does not work)
    all_reduce: str = "auto"
    # Mixture-of-experts models under tensor parallelism: "ep" splits the routed experts
    # over the ranks (each builds and loads only its own), "tp" splits every expert's
    # intermediate dimension.
    moe_parallel: str = "ep"
    seed: int = 0
    # Speculative decoding (vLLM's --speculative-config): a SpeculativeConfig, or vLLM's
    # dict or its JSON text, parsed on construction. None: off.
    speculative_config: SpeculativeConfig | None = None
    # Decode and verify steps compute each row exactly as a step of that row alone would
    # (projections, attention splits, LM head), so a decoded token does not depend on
    # what else shares its step, nor on speculation: greedy text with drafts equals
    # greedy text without, in bf16 too (as vLLM's VLLM_BATCH_INVARIANT and SGLang's
    # --enable-deterministic-inference aim at). A prefill step takes one prompt (its
    # projections' rounding depends on every row of the step), so a prompt is prefilled as
    # it would be alone; a prompt that finds its start in the prefix cache computes only
    # the rest, which rounds apart from a whole prefill (enable_prefix_caching off: a text
    # never depends on what ran before). Costs speed at larger batches and in bursts of
    # prompts; dense models on one device, no mixed steps (CausalLM.use_batch_invariance).
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.preemption_mode not in ("none", "recompute"):
            raise ConfigError(f"preemption_mode must be 'none' or 'recompute', got {self.preemption_mode!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")
        # None, not 0, asks for the default budget: an empty cache cannot hold one token.
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ConfigError(f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes} (None: the default budget)")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks} (None: what the budget holds)")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ConfigError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")
        if self.all_reduce not in ALL_REDUCE_MODES:
            raise ConfigError(f"all_reduce must be one of {', '.join(ALL_REDUCE_MODES)}, got {self.all_reduce!r}")
        if self.moe_parallel not in ("ep", "tp"):
            raise ConfigError(f"moe_parallel must be ep or tp, got {self.moe_parallel!r}")
        if self.dtype != "auto":
            parse_dtype(self.dtype)
        if self.model_impl not in MODEL_IMPLS:
            raise ConfigError(f"model_impl must be one of {', '.join(MODEL_IMPLS)}, got {self.model_impl!r}")
        if self.quantization not in (None, "fp8"):
            raise ConfigError(f"quantization must be 'fp8' or None, got {self.quantization!r}")
        spec = self.speculative_config
        if spec is not None and spec.method == "mtp" and self.tensor_parallel_size > 1:
            raise ConfigError("speculative method mtp runs on one GPU only for now (its draft layer is not split "
                              "over tensor-parallel ranks); use method ngram with --tp")
        if self.batch_invariant and self.mixed_batches:
            raise ConfigError("batch_invariant needs mixed_batches off: a mixed step's decode rows share the "
                              "prefill's projections, whose rounding depends on the whole step")
        if self.batch_invariant and self.tensor_parallel_size > 1:
            raise ConfigError("batch_invariant runs on one device for now: how an all-reduce orders its sums "
                              "may depend on the size of what it reduces")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.calculate_kv_scales and KV_CACHE_DTYPES[self.kv_cache_dtype] is None:
            raise ConfigError("calculate_kv_scales scales an fp8 KV cache; it needs kv_cache_dtype fp8")

    @property
    def max_decode_rows(self) -> int:
        """The most one-token rows a decode step holds: every sequence with its verify rows
        (k + 1 each under speculative decoding)."""
        spec = self.speculative_config
        return self.max_num_seqs * (1 + (spec.num_speculative_tokens if spec is not None else 0))

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dev = torch.device(self.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda was asked for but no CUDA GPU is visible")
        return dev

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return parse_dtype(self.dtype)

    def resolve_quantization(self, checkpoint: Fp8Config | None) -> Fp8Config | None:
        """The weights' fp8 scheme: the checkpoint's own, or the one `quantization` asks
        for on a full-precision checkpoint (an fp8 checkpoint already is fp8)."""
        if checkpoint is not None or self.quantization is None:
            return checkpoint
        return Fp8Config.online_channel()

    def resolve_kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or model_dtype
