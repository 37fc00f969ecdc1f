"""LongCat-Flash's n-gram embeddings (`longcat_flash_ngram`): each position's embedding adds
those of its last 2..n-gram ids, which mlx-lm keeps as a growing window of token ids; the
paged engine keeps it as a fixed state (zero-filled at the start, as mlx-lm's shift fills).
The reference is mlx-lm's own whole-sequence forward, which takes no cache (so none of the
route): logits through one prefill, chunks and decodes, and batched greedy tokens, equal."""

import mlx.core as mx
import numpy as np

from macinfer.engine.llm_engine import EngineConfig, LLMEngine
from macinfer.sampling_params import SamplingParams
from tests.helpers import generate_joining, greedy_by_recompute, make_mlx_lm_model, save_model_dir
from tests.zoo import tiny_config


def test_ngram_embeddings_follow_mlx_lms_whole_sequence_forward(tmp_path):
    config = tiny_config("longcat_flash_ngram")
    model = make_mlx_lm_model(config, seed=5)
    engine = LLMEngine(save_model_dir(str(tmp_path / "ngram"), config, model), EngineConfig(kv_cache_gb=0.01))
    assert engine.kv_cache.states is not None  # the window is a state slot of one shape

    def logits(tokens):
        return model(mx.array([tokens]))[0].astype(mx.float32)  # no cache: mlx-lm's own code

    toks = [int(t) for t in np.random.default_rng(4).integers(3, 300, 20)]
    for chunks in ([20], [1, 2, 5, 1, 1, 10], [1] * 20):  # windows filling up across chunk edges
        np.testing.assert_allclose(engine.score([toks], chunks)[0], np.array(logits(toks)), atol=2e-4, rtol=2e-4)
    prompts = [toks[:2], toks[4:17], toks[::2]]
    want = [greedy_by_recompute(logits, p, 5) for p in prompts]
    assert generate_joining(engine, prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)) == want
