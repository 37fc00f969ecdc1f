"""Keys quantized per channel across a block's tokens (`--kv-cache-dtype int4c/int3c`,
`kv/channel_keys.py`): each write rewrites the blocks it touches, and the engine computes
a float reference that keeps its keys the same way, through prompt chunks, decodes and
block boundaries."""

import mlx.core as mx
import numpy as np
import pytest

from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.kv.cache import KV_QUANT_BITS
from macinfer.sampling_params import SamplingParams
from tests.helpers import chunked_logits, generate, make_mlx_lm_model, save_model_dir, tiny_model_dir
from tests.zoo import tiny_config as zoo_config


@pytest.fixture(scope="module")
def head64(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("head64"), "llama", hidden_size=128, num_attention_heads=2,
                          num_key_value_heads=1, intermediate_size=256)


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory):
    """One layer: its keys come from the embeddings, bit for bit the same in both forwards.
    Deeper, the two forwards' keys differ in their last bits, and a kept key requantized
    on a moved grid can then round the other way (one step of its channel's scale: a
    tie the reference cannot share)."""
    return tiny_model_dir(tmp_path_factory.mktemp("one"), "llama", hidden_size=128, num_attention_heads=2,
                          num_key_value_heads=1, intermediate_size=256, num_hidden_layers=1)


def _channel_reference_logits(model, tokens: list[int], chunks: list[int], bits: int, bs: int = 32,
                               window: int | None = None, latent: bool = False) -> np.ndarray:
    """mlx-lm's forward whose caches keep keys as the engine stores them: each write
    quantizes the blocks it touches per channel over the block's bs rows (the rows kept
    from before, this write's rows, then copies of its last row; each channel's grid its
    own minimum to maximum, in NumPy), values per row as MLX does in groups of 64, both
    dequantized and attended in full precision. `window`: each query reads its last
    `window` keys (a sliding-window layer's mask over the same stored keys). `latent`: an
    MLA cache, mlx-lm's keys the latent and its values the rope key, both one stored row
    (the engine's K) quantized per channel alike."""
    from mlx_lm.models.cache import KVCache, create_attention_mask

    def per_channel(rows: mx.array) -> mx.array:  # [1, kvh, bs, d]: each channel on its [min, max]
        x = np.array(rows.astype(mx.float32))
        lo, hi = x.min(axis=2, keepdims=True), x.max(axis=2, keepdims=True)
        step = np.maximum((hi - lo) / (2**bits - 1), np.float32(1e-7))
        return mx.array(np.clip(np.rint((x - lo) / step), 0, 2**bits - 1) * step + lo).astype(rows.dtype)

    class ChannelCache(KVCache):
        def update_and_fetch(self, keys, values):
            at, n = self.offset, keys.shape[2]
            if not latent:
                q = mx.quantize(values.reshape(-1, values.shape[-1]), group_size=64, bits=bits)
                values = mx.dequantize(*q, group_size=64, bits=bits).reshape(values.shape)
            stored_k, stored_v = super().update_and_fetch(keys, values)
            for name, stored in (("keys", stored_k), ("values", stored_v))[: 2 if latent else 1]:
                out = [stored[:, :, : at // bs * bs]]
                for b in range(at // bs, (at + n - 1) // bs + 1):
                    rows = stored[:, :, b * bs : min(at + n, (b + 1) * bs)]
                    padded = mx.concatenate([rows] + [rows[:, :, -1:]] * (bs - rows.shape[2]), axis=2)
                    out.append(per_channel(padded)[:, :, : rows.shape[2]])
                getattr(self, name)[..., : at + n, :] = mx.concatenate(out, axis=2)
            return self.keys[..., : at + n, :], self.values[..., : at + n, :]

        def make_mask(self, n, return_array=False, window_size=None):
            return create_attention_mask(n, self.offset, return_array, window or window_size)

    cache = [ChannelCache() for _ in model.layers]
    return chunked_logits(model, tokens, chunks, cache)


@pytest.mark.parametrize("dtype", ["int4c", "int3c"])
def test_keys_per_channel_compute_their_float_reference(one_layer, dtype):
    """Prompt chunks that start and end inside blocks, then decodes across a block boundary:
    the logits of the reference that stores keys alike, not those of per-row keys; blocks of
    32 tokens by default, each block's keys d rows of 32 values with a scale and a bias."""
    path, model = one_layer
    bits = KV_QUANT_BITS[dtype][0]
    engine = LLMEngine(path, EngineConfig(kv_cache_gb=0.01, kv_cache_dtype=dtype))
    assert engine.config.block_size == 32
    # fp32: K 64 * bits / 8 + 64 channels' scale and bias over 32 tokens; V a row of 64
    assert engine.cache_groups()[0]["bytes_per_token"] == 64 * bits // 8 + 16 + 64 * bits // 8 + 8
    rows = LLMEngine(engine.loaded, EngineConfig(kv_cache_gb=0.01, kv_cache_dtype=f"int{bits}", block_size=32))
    rng = np.random.default_rng(4)
    seqs = [rng.integers(3, 250, size=n).tolist() for n in (44, 42)]
    chunks = [13, 14, 9, 1, 1, 1, 1, 1, 1]  # blocks cut at 13 and 27; decodes over token 32
    for s, got, per_row in zip(seqs, engine.score(seqs, chunks), rows.score(seqs, chunks)):
        want = _channel_reference_logits(model, s, chunks, bits)
        scale = np.abs(want).max()
        assert np.abs(got - want).max() < 1e-4 * scale
        assert np.abs(got - per_row).max() > 1e-3 * scale
    outs = generate(engine, seqs, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert all(len(o.token_ids) == 40 for o in outs)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_keys_per_channel_in_a_sliding_window_compute_their_float_reference(tmp_path_factory):
    """A sliding-window layer (Mistral's window, which the engine applies and mlx-lm's class
    does not: the reference masks alike) on int4c: its blocks below the window are released
    as it decodes, and the logits are the reference's that stores keys alike."""
    path, model = tiny_model_dir(tmp_path_factory.mktemp("slide"), "mistral", hidden_size=128, num_attention_heads=2,
                                 num_key_value_heads=1, intermediate_size=256, num_hidden_layers=1, sliding_window=20,
                                 max_position_embeddings=4096)
    engine = LLMEngine(path, EngineConfig(kv_cache_gb=0.01, kv_cache_dtype="int4c"))
    assert [s.kind.window for s in engine.layer_specs] == [20]
    rng = np.random.default_rng(5)
    seqs = [rng.integers(3, 250, size=n).tolist() for n in (80, 78)]
    chunks = [13, 14, 9, 30, 1, 1, 1, 1, 1, 1, 1, 1]  # decodes past block 0's release (its last key, 31, leaves at 51)
    for s, got in zip(seqs, engine.score(seqs, chunks)):
        want = _channel_reference_logits(model, s, chunks, 4, window=20)
        scale = np.abs(want).max()
        assert np.abs(got - want).max() < 1e-4 * scale
        whole = _channel_reference_logits(model, s, chunks, 4)  # (the window matters on this model)
        assert np.abs(whole - want)[36:].max() > 1e-3 * scale


def test_latents_per_channel_compute_their_float_reference(tmp_path_factory):
    """MLA on int4c: each token's latent and rope key, one stored row, quantized per channel
    over a block's tokens (V, the latent's leading values, read from those transposed
    matrices): the logits of mlx-lm's DeepSeek-V3 whose cache stores both parts alike."""
    config = zoo_config("deepseek_v3", num_hidden_layers=1, kv_lora_rank=48, qk_rope_head_dim=16)
    model = make_mlx_lm_model(config, seed=5)
    path = save_model_dir(str(tmp_path_factory.mktemp("mla")), config, model)
    engine = LLMEngine(path, EngineConfig(kv_cache_gb=0.01, kv_cache_dtype="int4c"))
    assert all(s.v_in_k for s in engine.layer_specs)
    rows = LLMEngine(engine.loaded, EngineConfig(kv_cache_gb=0.01, kv_cache_dtype="int4", block_size=32))
    rng = np.random.default_rng(6)
    seqs = [rng.integers(3, 250, size=n).tolist() for n in (44, 42)]
    chunks = [13, 14, 9, 1, 1, 1, 1, 1, 1]
    for s, got, per_row in zip(seqs, engine.score(seqs, chunks), rows.score(seqs, chunks)):
        want = _channel_reference_logits(model, s, chunks, 4, latent=True)
        scale = np.abs(want).max()
        assert np.abs(got - want).max() < 1e-4 * scale
        assert np.abs(got - per_row).max() > 1e-3 * scale


@pytest.mark.parametrize("bits", [4, 3])
def test_channel_groups_take_out_what_rows_cannot(bits):
    """Keys whose channels sit at offsets of their own (as real keys do after RoPE: slowly
    turning pairs, outlier channels): a row's one scale must span every offset, a
    channel's group takes its offset out as its bias: 5x closer at 4 bits and at 3."""
    from macinfer.kv.cache import LayerPool, kv_rows
    from macinfer.kv.spec import FullAttention, LayerKV

    spec = LayerKV(FullAttention(), num_kv_heads=2, head_dim=64, v_head_dim=64)
    rng = np.random.default_rng(0)
    k = (rng.normal(size=(64, 2, 64)) + rng.normal(scale=8.0, size=(1, 2, 64))).astype(np.float32)
    err = {}
    for channels in (False, True):
        pool = LayerPool(0, spec, 4, 32, mx.float32, (bits, bits), None, False, channels)
        rows = mx.array(kv_rows(np.arange(64), 2, 32), dtype=mx.int32)  # blocks 0 and 1
        for at in range(0, 64, 16):  # written in pieces: each rewrites its block
            pool.write(rows[2 * at : 2 * at + 32], mx.array(k[at : at + 16]), mx.array(k[at : at + 16]))
        back, _ = pool.gather(mx.array([0, 1]))  # [kvh, 64, d]
        err[channels] = np.abs(np.array(back).transpose(1, 0, 2) - k).mean()
    assert err[True] < 0.2 * err[False], err


def test_keys_per_channel_through_prefix_hits_preemption_and_speculation(head64):
    """A prefix hit reads the blocks a finished request left; preemption recomputes a
    sequence from its tokens; drafts are written and some rejected: each path runs to the
    end with every block returned. Their keys are quantized in the blocks those paths
    leave (a block's grid follows the rows it has held), so tokens are compared with the
    same path run again, and a hit with the request that left it."""
    path, _ = head64
    cfg = dict(kv_cache_dtype="int4c")
    rng = np.random.default_rng(9)
    stem = rng.integers(3, 250, size=40).tolist()
    prompts = [stem * 2 + rng.integers(3, 250, size=n).tolist() for n in (5, 13, 30)] + [stem[:9]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine = LLMEngine(path, EngineConfig(kv_cache_gb=0.01, **cfg))
    first = generate(engine, prompts, params)
    again = generate(engine, prompts[:2], params)
    assert [o.token_ids for o in again] == [o.token_ids for o in first[:2]]
    assert min(o.num_cached_tokens for o in again) >= 64
    tight = LLMEngine(engine.loaded, EngineConfig(num_kv_blocks=7, max_num_batched_tokens=32, **cfg))
    outs = generate(tight, prompts, params)
    assert tight.scheduler.num_preemptions > 0 and all(len(o.token_ids) == 24 for o in outs)
    assert tight.block_manager.num_free_blocks == tight.block_manager.num_blocks
    spec = LLMEngine(engine.loaded, EngineConfig(kv_cache_gb=0.01, num_speculative_tokens=3,
                                                 speculative_max_batch=8, **cfg))
    outs = generate(spec, prompts, params)
    assert spec.stats["spec_accepted_tokens"] > 0 and all(len(o.token_ids) == 24 for o in outs)
    assert spec.block_manager.num_free_blocks == spec.block_manager.num_blocks


def test_a_block_size_that_cannot_be_a_group_is_refused(head64):
    from click.testing import CliRunner

    from macinfer.cli.main import main

    says = "int4c quantizes each key channel over a block's tokens: the block size must be one of 32, 64, 128, got 16"
    with pytest.raises(ValueError, match=says):
        LLMEngine(head64[0], EngineConfig(kv_cache_gb=0.01, kv_cache_dtype="int4c", block_size=16))
    cli = ["generate", head64[0], "-p", "hi", "-n", "2", "--kv-cache-gb", "0.01", "--kv-cache-dtype", "int4c"]
    r = CliRunner().invoke(main, [*cli, "--block-size", "16"])
    assert r.exit_code != 0 and says in r.output, r.output
    r = CliRunner().invoke(main, [*cli, "--block-size", "64"])  # (a block that is a group runs)
    assert r.exit_code == 0, r.output


def test_the_cli_offers_every_kv_dtype():
    """The CLI's choices are the cache's dtypes (the list is written out there so the CLI
    starts without importing MLX)."""
    from macinfer.cli.main import main
    from macinfer.kv.cache import KV_CACHE_DTYPES

    for command in ("serve", "generate", "chat"):
        option = next(p for p in main.commands[command].params if p.name == "kv_cache_dtype")
        assert tuple(option.type.choices) == KV_CACHE_DTYPES, command


@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("n", [32, 64, 128])
def test_rows_are_packed_as_mlx_reads_them(bits, n):
    """Each row on its own [min, max] grid, packed in MLX's layout (3 bits straddle words):
    `mx.dequantize` gives NumPy's min-max rounding back, and a second pass changes nothing."""
    from macinfer.kv.channel_keys import quantize_rows

    x = np.random.default_rng(bits * n).normal(size=(7, n)).astype(np.float32) * 3 + 1
    lo, hi = x.min(1, keepdims=True), x.max(1, keepdims=True)
    step = (hi - lo) / (2**bits - 1)
    want = np.clip(np.rint((x - lo) / step), 0, 2**bits - 1) * step + lo
    back = mx.dequantize(*quantize_rows(mx.array(x), bits, mx.float32), group_size=n, bits=bits)
    assert np.abs(np.array(back) - want).max() < 1e-5
    again = mx.dequantize(*quantize_rows(back, bits, mx.float32), group_size=n, bits=bits)
    assert np.abs(np.array(again) - np.array(back)).max() < 1e-5


def test_first_tokens_at_full_precision_beside_keys_per_channel(head64):
    """`--kv-quant-start 40` with int4c: the first 40 positions read their own full-precision
    store, so their logits are the full-precision cache's exactly; the later ones are not."""
    path, _ = head64
    engine = LLMEngine(path, EngineConfig(kv_cache_gb=0.01, kv_cache_dtype="int4c", kv_quant_start=40))
    assert [g["kind"] for g in engine.cache_groups()] == ["full attention", "first 40 tokens at full precision"]
    seq = np.random.default_rng(1).integers(3, 250, size=70).tolist()
    full = LLMEngine(engine.loaded, EngineConfig(kv_cache_gb=0.01))
    a, b = (e.score([seq], [30, 20, 1, 1])[0] for e in (full, engine))
    assert np.abs(a[:40] - b[:40]).max() < 1e-5 * np.abs(a).max() < np.abs(a[40:] - b[40:]).max()
