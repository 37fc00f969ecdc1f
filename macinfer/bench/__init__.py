"""`macinfer bench`: engine, serving and prefix-cache benchmarks, each against
mlx-lm on the same weights or any OpenAI-compatible server, written as JSON with
the full context (model, quantization, versions, flags, hardware, workload) and
PNG plots."""
