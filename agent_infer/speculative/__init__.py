"""Speculative decoding: drafts proposed on the host (prompt lookup) or by the model's own
multi-token-prediction layer, checked by one forward pass of the target."""
