"""The paged KV cache: per-layer cache specs and their groups, the pools (K/V, MLA latents,
recurrent state), attention over them, the SSD tier's files. Imports kernels."""
