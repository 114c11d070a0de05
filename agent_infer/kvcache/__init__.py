"""The paged KV cache: per-layer cache layouts, the pool that allocates them, and where a
token sits in it."""
