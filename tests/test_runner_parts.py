"""The runner's parts alone (`engine/runner/`): a step's host tables from `inputs` without a
forward, and `verification`'s draft acceptance and state rewind without a model."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from macinfer.engine.block_manager import BlockManager
from macinfer.engine.runner.inputs import InputConfig, build_inputs
from macinfer.engine.runner.verification import pick
from macinfer.engine.sequence import Sequence
from macinfer.engine.speculative import DraftRow
from macinfer.kv.cache import KVCache
from macinfer.kv.spec import CacheGroup, FullAttention, LayerKV
from macinfer.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16)


def _seq(rid: str, prompt: list[int], computed: int = 0) -> Sequence:
    seq = Sequence(rid, prompt, GREEDY, seed=0)
    seq.num_computed_tokens = computed
    return seq


def test_inputs_are_host_tables_for_decodes_drafts_and_prompt_chunks():
    """A decode, a speculating sequence (its token and two drafts) and a prompt chunk: ids
    and positions in the scheduler's order, each token's slot through its block table, the
    decodes' tables and lengths, and the rows that sample (one per decode, one per draft
    row, the chunk's last only if it ends the prompt)."""
    bs = 4
    spec = LayerKV(FullAttention(), num_kv_heads=1, head_dim=8, v_head_dim=8)
    group = CacheGroup(0, FullAttention(), (0,), num_blocks=16)
    bm = BlockManager([group], bs)
    kv = KVCache([spec], [group], bs, mx.float32)
    decode, drafting, prompt = _seq("d", list(range(6)), 5), _seq("s", list(range(3)), 2), _seq("p", list(range(10)))
    drafting.spec_token_ids = [7, 8]
    for seq, n in ((decode, 6), (drafting, 5), (prompt, 8)):
        bm.allocate(seq, n)
    ids, meta, rows, samplers = build_inputs([(decode, 1), (drafting, 3), (prompt, 8)], bm.kv_groups, kv,
                                             InputConfig(bs))
    assert ids.tolist() == [5, 2, 7, 8, *range(8)]
    assert meta.positions.tolist() == [5, 2, 3, 4, *range(8)]
    tables = [s.block_tables[0] for s in (decode, drafting, prompt)]
    want = [tables[0][1] * bs + 1] + [tables[1][p // bs] * bs + p % bs for p in (2, 3, 4)] + \
        [tables[2][p // bs] * bs + p % bs for p in range(8)]
    assert meta.slots.tolist() == want
    assert meta.num_decodes == 4 and meta.decode_context_lens.tolist() == [6, 3, 4, 5]
    assert meta.decode_groups == [(1, 3)] and [(p.start, p.length, p.context_len) for p in meta.prefills] == [(4, 8, 8)]
    assert rows == [0, 1, 2, 3]  # the chunk does not end its prompt: no row
    assert samplers[0] is decode and samplers[1] is drafting and all(isinstance(r, DraftRow) for r in samplers[2:])


class _Step:
    """A state transaction that records what it restores."""
    def __init__(self):
        self.restored = []

    def restore(self, seq):
        self.restored.append(seq.request_id)


def test_verification_accepts_drafts_and_rewinds_state_on_a_rejection():
    """Greedy rows: a draft confirmed by the sampled tokens is kept plus one more; a draft
    rejected at its second token keeps the first and the correction, and the sequence's
    recurrent state is rewound (recomputed from its computed tokens); a failing row fails
    only its own request."""
    vocab = 16

    def logits_for(tokens):
        x = np.full((len(tokens), vocab), -10.0, dtype=np.float32)
        x[np.arange(len(tokens)), tokens] = 10.0
        return mx.array(x)

    kept, rejected = _seq("kept", [1, 2, 3], 3), _seq("rejected", [1, 2, 3], 3)
    kept.spec_token_ids, rejected.spec_token_ids = [4, 5], [4, 5]
    rows = [kept, *[DraftRow(GREEDY, 0, [1, 2, 3], d) for d in ([4], [4, 5])],
            rejected, *[DraftRow(GREEDY, 0, [1, 2, 3], d) for d in ([4], [4, 5])]]
    step = _Step()
    _, results, failed = pick(logits_for([4, 5, 6, 4, 9, 9]), rows, None, True, (), step=step)
    got = {r.seq.request_id: (r.token_ids, r.recompute_from) for r in results}
    assert got == {"kept": ([4, 5, 6], None), "rejected": ([4, 9], 3)} and failed == []
    assert step.restored == ["rejected"]
