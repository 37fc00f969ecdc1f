"""EAGLE-3 drafter checkpoints (the EAGLE authors' `LlamaForCausalLMEagle3` layout and
vLLM speculators' `eagle3`), run as a head that reads the target's hidden states, like an
MTP head (`engine/mtp_drafter.py` drives both).

The published formula (EAGLE-3, vLLM's `llama_eagle3.py`): the target's hidden states at
three layers' inputs (default 2, L/2, L-3) are concatenated and projected, `fc`, to the
draft's width: that is the hidden row of the target's position i. The first layer attends
over [input_layernorm(embed(token i + 1)), hidden_norm(h)] (q/k/v take twice the width),
adds its output to h (or to hidden_norm(h) with `norm_before_residual`), then its MLP; more
layers are plain Llama blocks. Logits are lm_head(norm(out)) over the draft's own
vocabulary, whose token d is the target's d + d2t[d]; the next draft reads `out` itself.
Its attention and MLP are mlx-lm's Llama classes, so the paged engine runs it as any model.
"""

from __future__ import annotations

import json
import os
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from macinfer.models.mlx_lm_adapter import MlxLmModel
from macinfer.models.mtp_checkpoint import checkpoint_tensors

FORMATS = ("LlamaForCausalLMEagle3", "Eagle3Speculator")


def is_eagle3(path: str) -> bool:
    """Whether `path` holds an EAGLE-3 drafter checkpoint."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    names = " ".join(config.get("architectures") or [])
    return any(f in names for f in FORMATS) or config.get("speculators_model_type") == "eagle3" \
        or config.get("model_type") == "eagle3"


def _settings(config: dict[str, Any]) -> dict[str, Any]:
    """The draft layer's Llama settings (speculators nest them)."""
    text = dict(config.get("transformer_layer_config") or config)
    text["model_type"] = "llama"
    text.setdefault("head_dim", text["hidden_size"] // text["num_attention_heads"])
    text.setdefault("num_key_value_heads", text["num_attention_heads"])
    text.setdefault("rms_norm_eps", 1e-6)
    return text


class Eagle3First(nn.Module):
    """The first layer: attention over the token's embedding beside the hidden row."""

    def __init__(self, args: Any, dims: int, norm_before_residual: bool):
        super().__init__()
        from mlx_lm.models import llama

        wide = llama.ModelArgs.from_dict({**args.__dict__, "hidden_size": 2 * dims, "head_dim": args.head_dim})
        self.self_attn = llama.Attention(wide)
        bias = bool(getattr(args, "attention_bias", False))
        self.self_attn.o_proj = nn.Linear(args.num_attention_heads * args.head_dim, dims, bias=bias)
        self.mlp = llama.MLP(args)
        self.input_layernorm = nn.RMSNorm(dims, eps=args.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(dims, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(dims, eps=args.rms_norm_eps)
        object.__setattr__(self, "norm_before_residual", norm_before_residual)

    def __call__(self, e: mx.array, h: mx.array, cache: Any) -> mx.array:
        hn = self.hidden_norm(h)
        x = (hn if self.norm_before_residual else h) + self.self_attn(
            mx.concatenate([self.input_layernorm(e), hn], axis=-1), None, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Stack(nn.Module):
    """The head's inner model: `(ids [T, 1], cache) -> out [T, 1, D]` (before the final
    norm), reading each row's hidden row from `given` (`mtp.hidden_rows`)."""

    def __init__(self, args: Any, dims: int, target_dims: int, norm_before_residual: bool, norm_before_fc: bool,
                 embed: nn.Module | None, vocab: int):
        super().__init__()
        from mlx_lm.models import llama

        self.fc = nn.Linear(3 * target_dims, dims, bias=False)
        if norm_before_fc:
            self.input_norm = nn.RMSNorm(3 * target_dims, eps=args.rms_norm_eps)
        self.layers = [Eagle3First(args, dims, norm_before_residual),
                       *[llama.TransformerBlock(args) for _ in range(1, args.num_hidden_layers)]]
        if embed is None:
            self.embed_tokens = nn.Embedding(vocab, dims)
        else:
            object.__setattr__(self, "_embed", embed)  # the target's: shared, not this module's weights
        object.__setattr__(self, "given", None)

    def embed(self, ids: mx.array) -> mx.array:
        return self.embed_tokens(ids) if "embed_tokens" in self else self._embed(ids)

    def features(self, aux: list[mx.array]) -> mx.array:
        """The target's recorded layer inputs [T, D] x 3 -> hidden rows [T, D]."""
        x = mx.concatenate(aux, axis=-1)
        return self.fc(self.input_norm(x) if "input_norm" in self else x)

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        e = self.embed(inputs)
        h = self.given if self.given is not None else mx.zeros_like(e)
        cache = cache if cache is not None else [None] * len(self.layers)
        x = self.layers[0](e, h.astype(e.dtype), cache[0])
        for layer, c in zip(self.layers[1:], cache[1:]):
            x = layer(x, None, c)
        return x


class Eagle3Head(nn.Module):
    """mlx-lm's outer shape: `model` (the stack), `layers`, logits over the target's
    vocabulary (the draft's tokens mapped through d2t; the rest never drawn)."""

    def __init__(self, stack: Eagle3Stack, args: Any, dims: int, draft_vocab: int, vocab: int):
        super().__init__()
        self.model = stack
        self.args = args
        self.norm = nn.RMSNorm(dims, eps=args.rms_norm_eps)
        self.lm_head = nn.Linear(dims, draft_vocab, bias=False)
        object.__setattr__(self, "vocab", vocab)
        self.d2t = mx.zeros((draft_vocab,), dtype=mx.int32)  # draft token d is the target's d + d2t[d]

    @property
    def layers(self) -> list[nn.Module]:
        return self.model.layers

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        logits = self.lm_head(self.norm(self.model(inputs, cache)))
        if logits.shape[-1] == self.vocab:
            return logits
        full = mx.full((*logits.shape[:-1], self.vocab), -mx.inf, dtype=logits.dtype)
        full[..., mx.arange(logits.shape[-1]) + self.d2t] = logits
        return full


class LayerInputs:
    """Records the inputs of some of a model's decoder layers on every forward (each
    layer's class swapped for a subclass that notes its input first)."""

    _classes: dict[type, type] = {}

    def __init__(self, layers: list[nn.Module], ids: list[int]):
        self.ids = list(ids)
        self.seen: dict[int, mx.array] = {}
        for i in self.ids:
            layer = layers[i]
            base = getattr(type(layer), "_mi_base", type(layer))  # (already recording for another drafter)
            rec = self._classes.get(base)
            if rec is None:
                rec = self._classes[base] = type(f"Recording{base.__name__}", (base,), {"__call__": _noting_call,
                                                                                      "_mi_base": base})
            object.__setattr__(layer, "__class__", rec)
            notes = getattr(layer, "_mi_notes", None)
            if notes is None:  # every recorder of this layer (engines sharing one loaded model) notes it
                notes = []
                object.__setattr__(layer, "_mi_notes", notes)
            notes.append((self.seen, i))

    def take(self) -> list[mx.array]:
        """The last forward's inputs [T, D] of each recorded layer, in the configured order."""
        return [self.seen[i][:, 0, :] if self.seen[i].ndim == 3 else self.seen[i] for i in self.ids]


def _noting_call(self: Any, x: mx.array, *args: Any, **kwargs: Any) -> Any:
    for seen, i in self._mi_notes:
        seen[i] = x
    return self._mi_base.__call__(self, x, *args, **kwargs)


def _weights(path: str) -> dict[str, mx.array]:
    """The head's tensors under the stack's names (`midlayer.*` is the first layer's)."""
    out, _ = checkpoint_tensors(path, lambda k: k != "t2d" and "rotary_emb" not in k and not k.startswith("verifier_"))
    if not out:
        raise ValueError(f"{path}: no *.safetensors weights")
    renamed = {}
    for k, v in out.items():
        k = "layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k
        renamed[k[len("model."):] if k.startswith("model.") else k] = v
    return renamed


def load_eagle3(path: str, target: Any) -> tuple[MlxLmModel, LayerInputs]:
    """The EAGLE-3 head at `path` for `target` (LoadedModel), and the recorder of the
    target's layer inputs it reads; a ValueError with the reason when they do not pair."""
    from mlx_lm.models import llama

    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    text = _settings(config)
    args = llama.ModelArgs.from_dict(text)
    dims = int(text["hidden_size"])
    model = target.model
    # The target's decoder layers and token embedding (mlx-lm's classes, or macinfer's Llama file).
    t_layers = model.decoder_layers if isinstance(model, MlxLmModel) else model.layers
    t_embed = model.embed_module() if isinstance(model, MlxLmModel) else model.model.embed_tokens
    if t_embed is None:
        raise ValueError(f"{path}: the EAGLE-3 head needs the target's token embedding, which this model hides")
    vocab = int(model.args.vocab_size)
    weights = _weights(path)
    fc = weights.get("fc.weight")
    if fc is None or fc.shape[1] % 3:
        raise ValueError(f"{path}: an EAGLE-3 checkpoint without its fc projection over three hidden states")
    t_dims = fc.shape[1] // 3
    target_dims = int(t_embed.weight.shape[-1]) if "weight" in t_embed else t_dims
    if t_dims != target_dims:
        raise ValueError(f"{path}: this EAGLE-3 head reads hidden states {t_dims} wide; the target's are "
                         f"{target_dims}: it was trained for another model")
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") \
        or config.get("eagle_aux_hidden_state_layer_ids") or config.get("target_layer_ids")
    n = len(t_layers)
    ids = [int(i) for i in ids] if ids else [2, n // 2, max(n - 3, 0)]
    if len(ids) != 3 or any(not 0 <= i < n for i in ids):
        raise ValueError(f"{path}: reads the inputs of layers {ids}; the target has {n}")
    draft_vocab = int(weights["lm_head.weight"].shape[0]) if "lm_head.weight" in weights else vocab
    if "d2t" in weights:
        d2t = weights["d2t"].astype(mx.int32)
        top = int((mx.arange(d2t.shape[0]) + d2t).max().item())
        if top >= vocab:
            raise ValueError(f"{path}: its draft vocabulary maps to token {top}, past the target's {vocab}")
        weights["d2t"] = d2t
    elif draft_vocab != vocab:
        raise ValueError(f"{path}: a draft vocabulary of {draft_vocab} tokens without the d2t map to the target's")
    own_embed = "embed_tokens.weight" in weights
    if own_embed and weights["embed_tokens.weight"].shape[0] != vocab:
        raise ValueError(f"{path}: its embedding has {weights['embed_tokens.weight'].shape[0]} rows; the target's "
                         f"vocabulary {vocab}")
    stack = Eagle3Stack(args, dims, t_dims, bool(config.get("norm_before_residual")),
                        bool(config.get("norm_before_fc")) or "input_norm.weight" in weights,
                        None if own_embed else t_embed, vocab)
    head = Eagle3Head(stack, args, dims, draft_vocab, vocab)
    if "lm_head.weight" not in weights:  # tied to the embedding (full vocabulary)
        weights["lm_head.weight"] = weights.get("embed_tokens.weight", t_embed.weight)
    names = {(k if k.split(".")[0] in ("norm", "lm_head", "d2t") else f"model.{k}"): v for k, v in weights.items()}
    try:
        head.load_weights(list(names.items()), strict=True)
    except ValueError as e:
        raise ValueError(f"{path}: its weights do not fit an EAGLE-3 head ({e})") from None
    mx.eval(head.parameters())
    head.eval()
    cfg = {**text, "model_type": "eagle3", "max_position_embeddings": max(
        int(text.get("max_position_embeddings") or 0), model.args.max_position_embeddings)}
    return MlxLmModel(head, cfg), LayerInputs(t_layers, ids)
