"""The Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM) in plain MLX.

One ragged batch per forward: `input_ids` is a flat [T] vector holding the
decode tokens and prefill chunks of every scheduled sequence back to back,
with no padding. Per-token positions drive RoPE; attention reads and writes
the paged KV cache through `macinfer.kv.attention.paged_attention`.
Parameter names match Hugging Face / mlx-lm so the same weights load in both.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn

from macinfer.kv.attention import AttentionMetadata, paged_attention
from macinfer.kv.dense import LOG2E
from macinfer.kernels import quantized as quantized_kernels
from macinfer.kernels.call import launch
from macinfer.kv.spec import FullAttention, LayerKV
from macinfer.lora.layers import plain as lora_plain
from macinfer.lora.layers import rows as lora_rows
from macinfer.models.base import ModelArgs
from macinfer.models.mrope import MRoPE
from macinfer.models.rope import apply_rope_tables, make_rope, rope_tables


def fuse_linears(linears: list[nn.Module]) -> nn.Linear | None:
    """One Linear whose output is the concatenation of `linears`' outputs, or None
    when they are not all plain (unquantized) Linear layers. Fewer, larger matmuls:
    on the CPU backend decode is bound by per-op overhead."""
    if not all(type(lin) is nn.Linear for lin in linears):
        return None
    has_bias = ["bias" in lin for lin in linears]
    if any(has_bias) and not all(has_bias):
        return None
    weight = mx.concatenate([lin.weight for lin in linears], axis=0)
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=all(has_bias))
    fused.weight = weight
    if all(has_bias):
        fused.bias = mx.concatenate([lin.bias for lin in linears], axis=0)
    return fused


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = self.head_dim**-0.5
        bias = args.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        # Qwen2 has q/k/v biases but never an o_proj bias.
        o_bias = bias and args.model_type not in ("qwen2", "qwen3")
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=o_bias)
        if args.qk_norm:
            self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        rope_args = (self.head_dim, args.rope_theta, args.rope_traditional, args.rope_scaling,
                     args.max_position_embeddings, args.extra.get("rope_freq_factors"))
        self.rope = make_rope(*rope_args)
        # Layers with equal RoPE share a step's tables. A string: an nn.Module keeps
        # tuples in its parameter tree.
        self.rope_key = f"rope{rope_args!r}"

    def fuse(self) -> None:
        sizes = (self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.n_kv_heads * self.head_dim)
        fused = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        if fused is not None:
            self.qkv_proj = fused
            del self["q_proj"], self["k_proj"], self["v_proj"]
            # (a plain attribute, not a child: where each part's outputs lie, for LoRA adapters)
            object.__setattr__(self, "fused_parts", {"qkv_proj": tuple(zip(("q_proj", "k_proj", "v_proj"), sizes))})

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """q, k, v as flat rows [T, heads * head_dim]."""
        if "qkv_proj" in self:
            nq, nkv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
            q, k, v = mx.split(self.qkv_proj(x), [nq, nq + nkv], axis=-1)
            return q, k, v
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def __call__(self, x: mx.array, meta: AttentionMetadata, layer: int) -> mx.array:
        T = x.shape[0]
        q, k, v = self.project(x)
        q = q.reshape(T, self.n_heads, self.head_dim)
        k = k.reshape(T, self.n_kv_heads, self.head_dim)
        v = v.reshape(T, self.n_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q = self.q_norm(q)
            k = self.k_norm(k)
        # q and k share one call (one op fewer per layer).
        qk = mx.concatenate([q, k], axis=1)
        tables = meta.memo(self.rope_key, lambda: rope_tables(self.rope, meta.positions, self.head_dim)) \
            if meta.explicit_ops and not isinstance(self.rope, MRoPE) else None
        if isinstance(self.rope, MRoPE):  # a vision checkpoint's multimodal RoPE (`models/mrope.py`)
            qk = self.rope.turn(qk[:, :, None, :], meta, meta.positions)[:, :, 0, :]
        elif tables is not None:
            qk = apply_rope_tables(qk, tables, self.rope.traditional)
        else:  # each token is its own RoPE "batch" row so it gets its own position
            qk = self.rope(qk[:, :, None, :], offset=meta.positions)[:, :, 0, :]
        q, k = qk[:, : self.n_heads], qk[:, self.n_heads :]
        out = paged_attention(q, k, v, meta, layer, self.scale)
        return self.o_proj(out.reshape(T, -1))


@partial(mx.compile, shapeless=True)
def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """silu(gate) * up as one fused op, with exp(-x) written 2^(-x log2 e): the same
    value (within 4e-6 of `nn.silu`), one transcendental per element on any backend,
    and 40% faster on MLX's CPU backend, whose `exp` (~15 ns an element) and
    `sigmoid` (~18) cost three to four times its `power` (~5)."""
    return gate / (1 + mx.power(2.0, gate * -LOG2E)) * up


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, hidden, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.qmv: str | None = None  # the batched qmv kernel: "metal" | "emulate" (`Model.use_paths`)

    def fuse(self) -> None:
        hidden = self.gate_proj.weight.shape[0]
        fused = fuse_linears([self.gate_proj, self.up_proj])
        if fused is not None:
            self.gate_up_proj = fused
            del self["gate_proj"], self["up_proj"]
            object.__setattr__(self, "fused_parts", {"gate_up_proj": (("gate_proj", hidden), ("up_proj", hidden))})

    def __call__(self, x: mx.array) -> mx.array:
        if "gate_up_proj" in self:
            gate, up = mx.split(self.gate_up_proj(x), 2, axis=-1)
            return self.down_proj(swiglu(gate, up))
        if self.qmv is not None:
            gate, up = lora_plain(self.gate_proj), lora_plain(self.up_proj)  # (adapter rows: no kernel)
            if quantized_kernels.supported(gate, x.shape[0]) and quantized_kernels.supported(up, x.shape[0]):
                call = quantized_kernels.qmv_call(x, gate, up)
                return self.down_proj(launch([call], emulate=self.qmv == "emulate"))
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(
            args.hidden_size, eps=args.rms_norm_eps
        )

    def __call__(self, x: mx.array, meta: AttentionMetadata, layer: int) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), meta, layer)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, input_ids: mx.array, meta: AttentionMetadata) -> mx.array:
        h = self.embed_tokens(input_ids)
        if meta.image_rows is not None:  # image features in place of their placeholders (`engine/images.py`)
            h[meta.image_rows] = meta.image_features.astype(h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, meta, i)
        return self.norm(h)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = LlamaModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, input_ids: mx.array, meta: AttentionMetadata) -> mx.array:
        """Hidden states [T, hidden] for a flat ragged batch of tokens."""
        with lora_rows(meta.lora_slots):
            return self.model(input_ids, meta)

    def logits(self, hidden: mx.array) -> mx.array:
        """LM head on the rows that need a next token only (not every prompt token)."""
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
            weights.pop("lm_head.scales", None)
            weights.pop("lm_head.biases", None)
        return weights

    def use_paths(self, paths) -> None:
        """The paths its engine chose at load (`engine.choices.Paths`): the qmv kernel for
        quantized MLPs, on this model only."""
        for layer in self.layers:
            layer.mlp.qmv = paths.decode_attention if paths.qmv_kernel else None

    def fuse_projections(self) -> None:
        """After loading: merge q/k/v and gate/up into single matmuls where the
        layers are plain Linear (the CPU path); quantized layers stay separate."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    @property
    def layers(self) -> list[TransformerBlock]:
        return self.model.layers

    # A vision checkpoint's decoder (`vision/text_model.HAND_WRITTEN_DECODERS`): what the image
    # path reads and sets, as on `MlxLmModel` (these families read no ids beside the images'
    # rows and scale no text rows).
    image_pad_id = None
    token_embed_scale = 1.0

    @property
    def decoder_layers(self) -> list[TransformerBlock]:
        return self.model.layers

    def embed_module(self) -> nn.Module:
        return self.model.embed_tokens

    def embed_scale(self) -> float:
        return 1.0

    @property
    def layer_specs(self) -> list[LayerKV]:
        """Every layer full attention with the config's K/V shapes."""
        a = self.args
        return [LayerKV(FullAttention(), a.num_key_value_heads, a.head_dim, a.head_dim)] * a.num_hidden_layers

    def kv_dtype(self) -> mx.Dtype:
        """What K/V come out of the projections in: the activations' dtype."""
        layer = self.layers[0]
        return layer.self_attn.project(layer.input_layernorm(self.model.embed_tokens(mx.array([0]))))[1].dtype
