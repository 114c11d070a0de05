"""Structured outputs and the other per-request logits constraints (allowed tokens,
min_tokens, logit bias): grammars compiled by llguidance, masks built on the host
while the device runs the forward pass and applied on the device for the batch."""

from agent_infer.structured.constraints import Constraints
from agent_infer.structured.grammar import CompiledGrammar, GrammarCompiler, GrammarError

__all__ = ["CompiledGrammar", "Constraints", "GrammarCompiler", "GrammarError"]
