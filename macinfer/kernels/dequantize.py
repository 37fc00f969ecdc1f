"""Quantized weights expanded to float32: the CPU backend runs dense layers as BLAS sgemm
(`loading/loader.py`), and a GGUF tensor MLX cannot keep quantized is read as floats."""

from __future__ import annotations

import mlx.core as mx


def dequantize_f32(weight: mx.array, scales: mx.array, biases: mx.array | None, group_size: int, bits: int,
                   mode: str = "affine") -> mx.array:
    """`weight`'s values in float32: scale * q + bias computed in float32, as MLX's quantized
    matmul computes it with float16 scales and as llama.cpp dequantizes its blocks. In the
    scales' float16 a value would be off by up to ~1e-3 (a SmolLM2 logit by 0.05), and MLX's
    CPU float16 arithmetic is 3x slower (SmolLM2's load 2.2 -> 1.5 s). (mlx-lm's quantized
    embedding lookup does round to float16; its tied output head does not.)"""
    if mode == "affine":  # (the fp4/fp8 modes' scales are exponent bytes)
        scales = scales.astype(mx.float32)
        biases = None if biases is None else biases.astype(mx.float32)
    return mx.dequantize(weight, scales, biases, group_size, bits, mode=mode).astype(mx.float32)
