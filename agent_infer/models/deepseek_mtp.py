"""DeepSeek-V3's multi-token-prediction layer, used as a draft model.

The checkpoint stores it after the decoder layers (`model.layers.{num_hidden_layers}.*`).
At position p it takes the main model's final (normed) hidden state h_p and the token
t_{p+1}, and predicts t_{p+2}:

    x = eh_proj([enorm(embed(t_{p+1})), hnorm(h_p)]),   one decoder layer (MLA + MoE),
    logits = lm_head(shared_head.norm(x)).

The embedding and the output head are the main model's (DeepSeek-V3 shares them; the
checkpoint's copies are not loaded). Its attention has a latent cache of its own in the
same blocks as the main layers': the K/V at position p is written when p's next token is
known, right after the step that computed p (speculative/mtp.py).
"""

from __future__ import annotations

import torch
from torch import nn

from agent_infer.config import ModelConfig
from agent_infer.layers.linear import ReplicatedLinear
from agent_infer.layers.norm import RMSNorm


class DeepseekMTP(nn.Module):
    def __init__(self, cfg: ModelConfig, block: nn.Module):
        super().__init__()
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(2 * h, h, False)
        self.block = block  # a decoder layer of the main model's kind, at index num_hidden_layers
        self.head_norm = RMSNorm(h, cfg.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The embeddings of t_{p+1} and the main model's h_p, [T, hidden] each -> the
        normed hidden state the LM head turns into logits for t_{p+2}."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        residual = x
        x = self.block.input_layernorm(x)
        x, _ = self.block(positions, x, residual, self.head_norm)
        return x


def mtp_weight_renames(first: int) -> tuple[tuple[str, str], ...]:
    """Checkpoint names of the MTP layer at index `first` onto the `mtp` module."""
    pre = rf"^model\.layers\.{first}\."
    return ((pre + r"(self_attn|mlp|input_layernorm|post_attention_layernorm)\.", r"mtp.block.\1."),
            (pre + r"shared_head\.norm\.", "mtp.head_norm."),
            (pre, "mtp."))


# The checkpoint's copies of the shared embedding and head.
MTP_SHARED = (r"mtp\.embed_tokens\.weight", r"mtp\.shared_head\.head\.weight")

