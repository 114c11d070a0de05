"""The paged KV cache: per-layer cache layouts and the pool that allocates them."""
