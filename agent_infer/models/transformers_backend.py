"""Any decoder-only causal LM that transformers can build, served on our paged cache
(`--model-impl transformers`; `auto` picks it for architectures without a native family).

transformers' own model class is built and its checkpoint loaded by transformers itself
(so its own renames and conversions of checkpoint names apply), in the engine's dtype and
on its device, and every attention module's score computation routed through our paged
attention: the engine's attention function is registered with transformers'
`AttentionInterface`, so each attention module projects and rotates q and k itself (its
norms, biases, partial rotary, its scaling) and hands them to us; we write k and v into
the layer's cache blocks and attend over them with the engine's backend. Continuous
batching, the paged and prefix caches, chunked prefill, sampling, structured outputs and
the server are the engine's. Its linear layers, RMSNorms and LM head are the engine's too
(models/transformers_layers.py), and tensor parallelism follows the architecture's own
published split; every rank loads the whole checkpoint on the CPU and keeps its part.
On a GPU the base model is compiled (torch.compile) around the engine's kernels, and
decode steps run in CUDA graphs once one has shown no host sync.

Refused by name: encoder-decoders; models whose attention does not go through the
interface; sliding-window attention and attention-logit soft-capping (the paged kernels
do neither); --tp > 1 for an architecture without a published split, or a size that does
not divide it. The final-logit soft-capping (Gemma), `logits_scaling` (Granite) and
`logit_scale` (Cohere) of the LM head are applied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from agent_infer.attention.metadata import get_attention_metadata
from agent_infer.config import ConfigError, ModelConfig
from agent_infer.distributed.state import ParallelState
from agent_infer.kernels import ops
from agent_infer.kvcache.layouts import DenseKVCache, DenseKVLayout
from agent_infer.loader.weights import checkpoint_files
from agent_infer.models.base import CausalLM
from agent_infer.models.transformers_layers import SplitPlan, plan_split, tp_plan_of, use_engine_layers

ATTENTION_NAME = "agent_infer_paged"


@dataclass(frozen=True)
class TransformersFamilyConfig:
    """What the engine needs of a config.json it does not model itself: the attention
    heads the cache is laid out for, and the LM head's output scaling."""

    architecture: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    logit_softcap: float | None
    logit_multiplier: float

    @staticmethod
    def from_hf(hf: dict[str, Any]) -> "TransformersFamilyConfig":
        import transformers

        arch = (hf.get("architectures") or [""])[0]
        cls = getattr(transformers, arch, None)
        if cls is None:
            from agent_infer.models.registry import supported_architectures

            raise ConfigError(f"unsupported architecture {arch!r}: no native family "
                              f"({', '.join(supported_architectures())}), and this transformers "
                              f"({transformers.__version__}) has no class of that name")
        if hf.get("is_encoder_decoder"):
            raise ConfigError(f"{arch} is an encoder-decoder; only decoder-only causal LMs are served")
        if not getattr(cls, "_supports_attention_backend", False):
            raise ConfigError(f"{arch}'s attention does not go through transformers' attention interface, so it "
                              f"cannot run on the paged cache")
        for key in ("sliding_window", "attn_logit_softcapping"):
            if hf.get(key) is not None and (key != "sliding_window" or hf.get("use_sliding_window", True)):
                raise ConfigError(f"{arch} sets {key} ({hf[key]}): the paged attention kernels do not "
                                  f"support it")
        heads = int(hf["num_attention_heads"])
        head_dim = hf.get("head_dim") or int(hf["hidden_size"]) // heads
        # Granite divides the logits by logits_scaling, Cohere multiplies them by logit_scale.
        scaling = hf.get("logits_scaling")
        multiplier = 1.0 / float(scaling) if scaling else float(hf.get("logit_scale") or 1.0)
        return TransformersFamilyConfig(
            architecture=arch, num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(head_dim), logit_softcap=hf.get("final_logit_softcapping"), logit_multiplier=multiplier,
        )


class PagedCacheAttention(nn.Module):
    """One transformers attention module's cache and the engine's backend over it: k and v
    (already projected, normalised and rotated by the module) into the cache blocks, then
    attention of q over the sequence's cached context."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.cache_layout = DenseKVLayout(num_kv_heads, head_dim)
        self.cache: DenseKVCache | None = None
        self.backend = None

    def bind(self, cache: DenseKVCache | None, backend) -> None:
        self.cache, self.backend = cache, backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> [T, H, D]."""
        if self.cache is None:
            raise RuntimeError("attention has no KV cache bound; run the model through the engine")
        meta = get_attention_metadata()
        ops.store_kv(k, v, self.cache.k, self.cache.v, meta.slot_mapping, self.cache.k_scale, self.cache.v_scale)
        return self.backend.attend(q, self.cache, meta, scale)


# Where torch.compile breaks the graph (one break a layer): the attention reads the
# engine's step metadata and launches its own kernels.
@torch.compiler.disable
def _paged_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [1, H, T, D], key/value [1, Hkv, T,
    D] (the step's tokens as one row) -> ([1, T, H, D], None). The mask is ignored: the
    engine's metadata says which cached tokens each query sees."""
    for key_name in ("sliding_window", "softcap"):
        if kwargs.get(key_name) is not None:
            raise NotImplementedError(f"{key_name} attention is not supported on the paged cache")
    paged: PagedCacheAttention = module.paged_attention
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    # The cache write takes k and v as strided views; the attention kernels want q whole.
    return paged(q.contiguous(), k, v, scale)[None], None


def _no_mask(*args, **kwargs) -> None:
    """The mask transformers would build for the step's tokens as one sequence: none (the
    paged attention masks by the engine's metadata)."""
    return None


def _register_attention() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, _paged_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)


def _attention_modules(base: nn.Module) -> list[tuple[str, nn.Module]]:
    """transformers' attention modules of a base model, with their names, in layer order."""
    return [(name, m) for name, m in base.named_modules()
            if hasattr(m, "layer_idx") and hasattr(m, "is_causal") and "Attention" in type(m).__name__]


def _split(hf: nn.Module, cfg: ModelConfig, tp: int) -> SplitPlan | None:
    """How `hf` splits over `tp` ranks (None for one rank); a ConfigError when it cannot."""
    if tp == 1:
        return None
    f: TransformersFamilyConfig = cfg.family
    plan = tp_plan_of(hf)
    if plan is None:
        raise ConfigError(f"{f.architecture} runs through the transformers backend, whose tensor parallelism "
                          f"follows the architecture's published split (base_model_tp_plan); this one has none, "
                          f"so it runs on one rank: --tp {tp} is not supported for it")
    names = [name for name, _ in _attention_modules(hf.base_model)]
    return plan_split(hf.base_model, plan, names, tp, f.num_heads, f.num_kv_heads, f.architecture)


class TransformersCausalLM(CausalLM):
    """transformers' model class for the checkpoint, on our paged cache (see the module
    docstring). `hf` is the transformers model; each of its attention modules holds a
    `paged_attention` (listed, in layer order, by `attention_layers`)."""

    config_class = TransformersFamilyConfig
    # transformers' modules may read values on the host (dynamic rotary scaling does):
    # a decode step must show it does not before graphs are captured.
    graphs_after_sync_check = True

    def __init__(self, cfg: ModelConfig, tp: ParallelState, max_pos: int):
        super().__init__()
        import transformers

        self.config = cfg
        self._tp_size = tp.world_size
        f: TransformersFamilyConfig = cfg.family
        checkpoint_files(cfg.path)  # a missing or unreadable checkpoint is named before transformers reads it
        _register_attention()
        # Built where the engine builds its models (the default device and dtype of the
        # caller's context), but loaded, and split over ranks, on the CPU first.
        device, dtype = torch.get_default_device(), torch.get_default_dtype()
        with torch.device("cpu"):
            hf = getattr(transformers, f.architecture).from_pretrained(cfg.path, attn_implementation=ATTENTION_NAME,
                                                                       dtype=dtype)
            split = _split(hf, cfg, tp.world_size)
            use_engine_layers(hf, split, tp)
        self.hf = hf.to(device).eval()
        # A 4-D mask is taken as already built: transformers then skips its own mask
        # preparation, which reads position ids on the host (a sync every step). The
        # paged attention ignores it; its metadata says what each query sees.
        self._prepared_mask = torch.empty((1, 1, 0, 0), device=device, dtype=dtype)
        self._layers: list[PagedCacheAttention] = []
        for name, module in _attention_modules(self.hf.base_model):
            parts = tp.world_size if split is not None and name in split.split_heads else 1
            module.paged_attention = PagedCacheAttention(f.num_heads // parts, f.num_kv_heads // parts, f.head_dim)
            self._layers.append(module.paged_attention)
        if len(self._layers) != cfg.num_layers:
            raise ConfigError(f"{f.architecture}: found {len(self._layers)} attention modules for "
                              f"{cfg.num_layers} layers; this model cannot run on the paged cache")

    @property
    def attention_layers(self) -> list[nn.Module]:
        return self._layers

    def load_weights(self, weights) -> None:
        """Nothing to do: transformers loaded the checkpoint when the model was built."""

    def use_fp8(self, config, stored_fp8) -> list[str]:
        raise ConfigError(f"{self.config.architecture} runs through the transformers backend, which does not "
                          f"quantize: --quantization fp8 and fp8 checkpoints need a native family")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.hf.base_model(input_ids=input_ids[None], position_ids=positions[None],
                                 attention_mask=self._prepared_mask, use_cache=False)
        return out.last_hidden_state[0]

    def use_batch_invariance(self, rows: int) -> None:
        raise ConfigError("batch_invariant covers the native families; transformers' classes run their own "
                          "projections and norms (model_impl transformers)")

    def use_torch_compile(self, backend: str = "inductor") -> None:
        """Compile the base model (dynamic in the step's token count): the elementwise work
        transformers leaves between kernels (rotary embedding, activations, residual adds
        with the RMSNorms after them) fuses into few kernels, around the engine's linear
        layers and attention. On one rank: a split model's collectives stay uncompiled."""
        if self._tp_size == 1:
            self.hf.base_model.compile(dynamic=True, backend=backend)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        f: TransformersFamilyConfig = self.config.family
        logits = self.hf.get_output_embeddings()(hidden)
        if f.logit_multiplier != 1.0:
            logits = logits * f.logit_multiplier
        if f.logit_softcap:
            logits = torch.tanh(logits / f.logit_softcap) * f.logit_softcap
        return logits

    @classmethod
    def check_parallel(cls, cfg: ModelConfig, tp: int, moe_parallel: str) -> None:
        """The published split checked against the model's structure, built on the meta
        device (no weights read)."""
        if tp == 1:
            return
        import transformers

        hf_config = transformers.AutoConfig.from_pretrained(cfg.path)
        with torch.device("meta"):
            model = getattr(transformers, cfg.family.architecture)(hf_config)
        _split(model, cfg, tp)

    @classmethod
    def checkpoint_tensors(cls, cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
        raise ConfigError(f"random weights are written for native families only, not {cfg.architecture}")
