"""The engine: requests in, tokens out. The scheduler, the block manager with its cache groups
(K/V and recurrent state), the runner, sampling and speculation, the paths chosen at load.
Imports kv, models, kernels, loading, text and distributed (the process group)."""
