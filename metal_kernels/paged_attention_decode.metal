// Paged decode attention: one query token per sequence, K/V read through the block table.
// Body of an mx.fast.metal_kernel (MLX writes the signature).
//
// Grid: one threadgroup per (kv head, sequence, partition); NSG simdgroups of 32.
// Every query head of a GQA group is handled by the same threadgroup, so each K/V
// row is read once for all GQA heads. Simdgroups stride over the partition's tokens;
// lanes split head_dim (DPL = D / 32 values each), so a K row load is coalesced.
// Online softmax in fp32; simdgroup states are merged through threadgroup memory.
//
// Templates: T (q/kv/out dtype), D (head dim, multiple of 32), BS (block size),
// GQA (query heads per kv head), NSG (simdgroups), PART (tokens per partition,
// a multiple of BS), WINDOW (sliding-window span; 0 for full attention). MACINFER_PARTITIONED selects the split-K variant, which
// writes unnormalised partials (tmp_out, tmp_ml) for paged_attention_merge.metal.
// Inputs: q [B, H, D], k_pool / v_pool [num_blocks, KVH, BS, D] (a block's rows of one
// head are contiguous),
// block_tables [B, max_blocks] int32, context_lens [B] int32, scale [1] float32.
constexpr int DPL = D / 32;
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const int kvh = threadgroup_position_in_grid.x;
const int seq = threadgroup_position_in_grid.y;
const int part = threadgroup_position_in_grid.z;
const int num_kv_heads = k_pool_shape[1];
const int num_heads = q_shape[1];
const int max_blocks = block_tables_shape[1];
const int ctx = context_lens[seq];
const int part_start = part * PART;
const int end = min(ctx, part_start + PART);
// A sliding-window layer attends to its last WINDOW keys only (WINDOW 0: every key).
const int start = WINDOW > 0 ? max(part_start, ctx - WINDOW) : part_start;

float qv[GQA][DPL];
float m[GQA];
float l[GQA];
float acc[GQA][DPL];
for (int g = 0; g < GQA; g++) {
  const long qoff = (long(seq) * num_heads + kvh * GQA + g) * D + lane * DPL;
  for (int i = 0; i < DPL; i++) {
    qv[g][i] = float(q[qoff + i]) * scale[0];
    acc[g][i] = 0.0f;
  }
  m[g] = -INFINITY;
  l[g] = 0.0f;
}

for (int t = start + int(sg); t < end; t += NSG) {
  const long block = block_tables[long(seq) * max_blocks + t / BS];
  const long off = ((block * num_kv_heads + kvh) * BS + t % BS) * D + lane * DPL;
  float kr[DPL];
  float vr[DPL];
  for (int i = 0; i < DPL; i++) {
    kr[i] = float(k_pool[off + i]);
    vr[i] = float(v_pool[off + i]);
  }
  for (int g = 0; g < GQA; g++) {
    float s = 0.0f;
    for (int i = 0; i < DPL; i++) {
      s += qv[g][i] * kr[i];
    }
    s = simd_sum(s);  // uniform: every lane of a simdgroup runs the same t
    const float m_new = max(m[g], s);
    const float corr = exp(m[g] - m_new);
    const float p = exp(s - m_new);
    l[g] = l[g] * corr + p;
    for (int i = 0; i < DPL; i++) {
      acc[g][i] = acc[g][i] * corr + p * vr[i];
    }
    m[g] = m_new;
  }
}

threadgroup float sm_m[NSG * GQA];
threadgroup float sm_l[NSG * GQA];
threadgroup float sm_acc[NSG * GQA * D];
for (int g = 0; g < GQA; g++) {
  if (lane == 0) {
    sm_m[sg * GQA + g] = m[g];
    sm_l[sg * GQA + g] = l[g];
  }
  for (int i = 0; i < DPL; i++) {
    sm_acc[(sg * GQA + g) * D + lane * DPL + i] = acc[g][i];
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);

if (sg == 0) {
  for (int g = 0; g < GQA; g++) {
    float M = -INFINITY;
    for (int s = 0; s < NSG; s++) {
      M = max(M, sm_m[s * GQA + g]);
    }
    float L = 0.0f;
    float o[DPL];
    for (int i = 0; i < DPL; i++) {
      o[i] = 0.0f;
    }
    for (int s = 0; s < NSG; s++) {
      const float ms = sm_m[s * GQA + g];
      const float w = ms == -INFINITY ? 0.0f : exp(ms - M);
      L += sm_l[s * GQA + g] * w;
      for (int i = 0; i < DPL; i++) {
        o[i] += sm_acc[(s * GQA + g) * D + lane * DPL + i] * w;
      }
    }
    const long bh = long(seq) * num_heads + kvh * GQA + g;
#if MACINFER_PARTITIONED
    const long idx = bh * threadgroups_per_grid.z + part;
    for (int i = 0; i < DPL; i++) {
      tmp_out[idx * D + lane * DPL + i] = o[i];
    }
    if (lane == 0) {
      tmp_ml[idx * 2] = M;
      tmp_ml[idx * 2 + 1] = L;
    }
#else
    for (int i = 0; i < DPL; i++) {
      out[bh * D + lane * DPL + i] = static_cast<T>(L > 0.0f ? o[i] / L : 0.0f);
    }
#endif
  }
}
