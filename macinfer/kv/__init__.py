"""The paged KV cache: per-layer cache specs and their groups, the pools, attention over them."""
