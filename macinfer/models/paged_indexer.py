"""DeepSeek Sparse Attention's lightning indexer (mlx-lm's `deepseek_v32.Indexer`, which
GLM-5's `glm_moe_dsa` reuses) inside the paged forward: its index keys written to their
own cache, its scores over each query's whole context read from the paged cache, and the
query's best `index_topk` keys handed to the layer's latent attention as a mask
(`kv/sparse.py`; `paged_layers._latent_call` applies it). mlx-lm's own forward (its
caches, not ours) runs its code unchanged."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from macinfer.kv.sparse import select_keys


def patch_indexer(mod: Any) -> None:
    cls = getattr(mod, "Indexer", None)
    if cls is None or getattr(cls, "_paged_indexer", False):
        return
    original = cls.__call__

    def __call__(self, x: mx.array, qr: mx.array, mask: Any, cache: Any = None) -> Any:
        f = getattr(cache, "forward", None)  # a PagedLayerCache: our forward
        if f is None:
            return original(self, x, qr, mask, cache)
        T = x.shape[0]  # the step's rows, one token each
        q = self.wq_b(qr).reshape(T, 1, self.n_heads, self.head_dim).swapaxes(1, 2)
        k = self.k_norm(self.wk(x)).reshape(T, 1, 1, self.head_dim)
        q, k = self.rope(q, offset=cache.offset), self.rope(k, offset=cache.offset)
        cache.update_and_fetch(k, k)
        f.calls.append(cache.index)  # the index-key cache is read (by the selection below)
        if f.meta is None:  # the probe: shapes only
            return None
        w = self.weights_proj(x)[:, 0, :] * (self.n_heads**-0.5 * self.softmax_scale)
        f.key_select = select_keys(q[:, :, 0, :], w, f.meta, cache.index, self.index_topk)
        return None  # mlx-lm's layer then attends densely; our attention applies the selection

    cls.__call__ = __call__
    cls._paged_indexer = True  # (the memory plan refuses a quantized KV cache for it)
