"""Structured outputs and the other per-request logits constraints (allowed tokens,
min_tokens, logit bias): grammars compiled by llguidance (`grammar`, no torch: the
server's front ends validate with it), masks built on the host while the device runs the
forward pass and applied on the device for the batch (`constraints`)."""
