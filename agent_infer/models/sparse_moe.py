"""Decoders with the dense family's attention and mixture-of-experts MLPs: Qwen3-MoE (GQA
with per-head q/k norms; softmax top-k, renormalised when `norm_topk_prob`; dense MLPs in
`mlp_only_layers` and off the `decoder_sparse_step`) and Mixtral (Llama attention; every
layer's MLP sparse, softmax over the top-k logits, i.e. renormalised top-k). No shared
experts. The layers are the dense family's (models/llama.py) with `layers/moe.py`'s MoE
as the MLP, so tensor parallelism, expert parallelism (`--moe-parallel ep`, the routed
experts split by expert) and the fused MoE kernels are the DeepSeek family's."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from agent_infer.config import ConfigError, ModelConfig
from agent_infer.distributed.state import ParallelState
from agent_infer.layers.moe import MoE, RouterConfig, expert_rules
from agent_infer.loader.load import WeightMap
from agent_infer.models.llama import LlamaFamilyConfig, LlamaForCausalLM, LlamaModel

_MIXTRAL = "MixtralForCausalLM"
_READS = frozenset({"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                    "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob"})
# Mixtral's checkpoints name the MoE MLP `block_sparse_moe` and its projections w1 (gate),
# w3 (up) and w2 (down); Qwen3-MoE's `mlp` and gate_proj / up_proj / down_proj.
_EXPERT_NAMES = {_MIXTRAL: ("w1", "w3", "w2")}
_PROJ_NAMES = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class SparseMoeFamilyConfig(LlamaFamilyConfig):
    moe_intermediate_size: int
    router: RouterConfig
    sparse_layers: tuple[bool, ...]  # per layer: a MoE MLP (else the dense one)

    @staticmethod
    def from_hf(hf: dict[str, Any]) -> "SparseMoeFamilyConfig":
        arch = (hf.get("architectures") or [""])[0]
        dense = LlamaFamilyConfig.from_hf(hf, "Qwen3-MoE/Mixtral", _READS)
        if hf.get("sliding_window") is not None and (arch == _MIXTRAL or hf.get("use_sliding_window")):
            raise ConfigError(f"sliding-window attention (sliding_window: {hf['sliding_window']}) is not supported")
        experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
        if experts < 1:
            raise ConfigError(f"{arch} needs num_experts (or num_local_experts) >= 1")
        top_k = int(hf["num_experts_per_tok"])
        if not 1 <= top_k <= experts:
            raise ConfigError(f"num_experts_per_tok {top_k} must be between 1 and the {experts} experts")
        layers = int(hf["num_hidden_layers"])
        if arch == _MIXTRAL:
            sparse, inter, norm = (True,) * layers, dense.intermediate_size, True
        else:
            step = int(hf.get("decoder_sparse_step") or 1)
            dense_only = set(hf.get("mlp_only_layers") or ())
            sparse = tuple(i not in dense_only and (i + 1) % step == 0 for i in range(layers))
            inter, norm = int(hf["moe_intermediate_size"]), bool(hf.get("norm_topk_prob"))
        return SparseMoeFamilyConfig(
            **asdict(dense),
            moe_intermediate_size=inter,
            router=RouterConfig(num_experts=experts, top_k=top_k, scoring="softmax", norm_topk_prob=norm),
            sparse_layers=sparse,
        )


class SparseMoeForCausalLM(LlamaForCausalLM):
    """Qwen3MoeForCausalLM and MixtralForCausalLM."""

    config_class = SparseMoeFamilyConfig

    def __init__(self, cfg: ModelConfig, tp: ParallelState, max_pos: int):
        f: SparseMoeFamilyConfig = cfg.family
        model = LlamaModel(cfg, tp, max_pos, lambda i: (MoE(cfg.hidden_size, f.moe_intermediate_size, f.router, 0, tp)
                                                        if f.sparse_layers[i] else None))
        super(LlamaForCausalLM, self).__init__(cfg, model, tp)

    def weight_map(self) -> WeightMap:
        dense = super().weight_map()
        gate, up, down = _EXPERT_NAMES.get(self.config.architecture, _PROJ_NAMES)
        rules = expert_rules(r"model\.layers\.\d+\.mlp", gate, up, down, shared_joined=False)
        renames = dense.renames + ((r"\.block_sparse_moe\.", ".mlp."),)
        return WeightMap(rules=rules + dense.rules, skip=dense.skip, renames=renames)

    def warmup_prompt_lengths(self) -> tuple[int, ...]:
        """As DeepSeek's: one step per bucket of the fused-MoE tile table."""
        return tuple(2**i for i in range(16))

    @classmethod
    def check_parallel(cls, cfg: ModelConfig, tp: int, moe_parallel: str) -> None:
        """The attention as the dense family splits it; the routed experts split evenly
        (EP) or their intermediate size (TP experts); the dense layers' MLPs too."""
        super().check_parallel(cfg, tp, moe_parallel)
        if tp == 1:
            return
        f: SparseMoeFamilyConfig = cfg.family
        sizes = ({"routed experts": f.router.num_experts} if moe_parallel == "ep"
                 else {"routed experts' intermediate size": f.moe_intermediate_size})
        if not all(f.sparse_layers):
            sizes["dense MLP intermediate size"] = f.intermediate_size
        bad = {k: v for k, v in sizes.items() if v % tp}
        if bad:
            what = ", ".join(f"{v} {k}" for k, v in bad.items())
            raise ConfigError(f"tensor-parallel size {tp} does not divide this model's {what} "
                              f"(--moe-parallel {moe_parallel})")

    @classmethod
    def checkpoint_tensors(cls, cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
        """The dense family's list with each sparse layer's MLP replaced by the router and
        its experts, under the hub's names."""
        f: SparseMoeFamilyConfig = cfg.family
        h, inter = cfg.hidden_size, f.moe_intermediate_size
        mixtral = cfg.architecture == _MIXTRAL
        gate, up, down = _EXPERT_NAMES.get(cfg.architecture, _PROJ_NAMES)
        out = []
        for name, shape in super().checkpoint_tensors(cfg):
            parts = name.split(".")
            if len(parts) > 3 and parts[3] == "mlp" and f.sparse_layers[int(parts[2])]:
                if not name.endswith("gate_proj.weight"):
                    continue  # the router and experts replace the dense MLP once, at its first tensor
                pre = ".".join(parts[:3]) + (".block_sparse_moe." if mixtral else ".mlp.")
                out.append((pre + "gate.weight", (f.router.num_experts, h)))
                for e in range(f.router.num_experts):
                    out += [(f"{pre}experts.{e}.{gate}.weight", (inter, h)),
                            (f"{pre}experts.{e}.{up}.weight", (inter, h)),
                            (f"{pre}experts.{e}.{down}.weight", (h, inter))]
                continue
            out.append((name, shape))
        return out
