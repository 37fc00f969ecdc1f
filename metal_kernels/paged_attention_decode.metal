// Paged decode attention: one query token per sequence, K/V read through the block table.
// Body of an mx.fast.metal_kernel (MLX writes the signature).
//
// Grid: one threadgroup per (kv head, head block, sequence, partition); NSG simdgroups of 32.
// A threadgroup handles HB query heads of one GQA group (all of them when they fit), so each
// K/V row is read once for those heads. Simdgroups stride over the partition's tokens;
// lanes split head_dim (DPL = D / 32 values each), so a K row load is coalesced.
// Online softmax in fp32; simdgroup states are merged through threadgroup memory.
//
// Multi-head latent attention is the same computation with one KV head, D = latent + rope
// key, and V = the latent: v_pool is the K pool itself, and DV (< D) its leading columns.
//
// Templates: T (q/kv/out dtype), D (K head dim, multiple of 32), DV (V values read and
// written, multiple of 32, <= the V row width), BS (block size), GQA (query heads per kv
// head), HB (query heads per threadgroup, divides GQA), NSG (simdgroups), PART (tokens per
// partition, a multiple of BS), WINDOW (sliding-window span; 0 for full attention).
// MACINFER_PARTITIONED selects the split-K variant, which writes unnormalised partials
// (tmp_out, tmp_ml) for paged_attention_merge.metal.
// Inputs: q [B, H, D], k_pool [num_blocks, KVH, BS, D], v_pool [num_blocks, KVH, BS, VW]
// (a block's rows of one head are contiguous; VW >= DV), block_tables [B, max_blocks]
// int32, context_lens [B] int32, scale [1] float32.
// MACINFER_QUANTIZED: the pools hold MLX-affine-quantized rows instead (KBITS / VBITS bits a
// value, little-endian bit-packed into uint32 words, a scale and a bias per KGROUP / VGROUP
// values): k_w [num_blocks, KVH, BS, D * KBITS / 32], k_s / k_b [num_blocks, KVH, BS,
// D / KGROUP], and v_w, v_s, v_b alike over the V row's VW values; each lane dequantizes
// the values it reads (a 3-bit value may straddle two words). KCHAN 1: keys stored per channel
// (`kv/channel_keys.py`): each (block, head) matrix of K is [D, BS], a packed row per channel
// over the block's tokens, one group (KGROUP = BS): k_w [num_blocks, KVH, D, BS * KBITS / 32],
// k_s / k_b [num_blocks, KVH, D, 1]; a lane reads its channels' words at the token's column.
#if MACINFER_QUANTIZED
#define MI_DEQ(dst, W, S, Z, WPR, NG, GROUP, BITS, r, c) {                          \
    const long bit_ = long(c) * BITS;                                                   \
    const long w0_ = long(r) * (WPR) + bit_ / 32;                                      \
    const uint sh_ = uint(bit_ % 32);                                                   \
    uint q_ = W[w0_] >> sh_;                                                            \
    if (sh_ + BITS > 32) { q_ |= W[w0_ + 1] << (32 - sh_); }                            \
    q_ &= (1u << BITS) - 1u;                                                            \
    const long g_ = long(r) * (NG) + (c) / GROUP;                                       \
    dst = float(S[g_]) * float(q_) + float(Z[g_]); }
#endif
constexpr int DPL = D / 32;
constexpr int DVPL = DV / 32;
constexpr int BLOCKS_PER_GROUP = GQA / HB;
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const int kvh = threadgroup_position_in_grid.x / BLOCKS_PER_GROUP;
const int head0 = kvh * GQA + (threadgroup_position_in_grid.x % BLOCKS_PER_GROUP) * HB;  // first query head
const int seq = threadgroup_position_in_grid.y;
const int part = threadgroup_position_in_grid.z;
#if MACINFER_QUANTIZED
const int num_kv_heads = k_w_shape[1];
const int k_words = k_w_shape[3];
const int v_words = v_w_shape[3];
const int k_groups = k_s_shape[3];
const int v_groups = v_s_shape[3];
#else
const int num_kv_heads = k_pool_shape[1];
const int v_width = v_pool_shape[3];
#endif
const int num_heads = q_shape[1];
const int max_blocks = block_tables_shape[1];
const int ctx = context_lens[seq];
const int part_start = part * PART;
const int end = min(ctx, part_start + PART);
// A sliding-window layer attends to its last WINDOW keys only (WINDOW 0: every key).
const int start = WINDOW > 0 ? max(part_start, ctx - WINDOW) : part_start;

float qv[HB][DPL];
float m[HB];
float l[HB];
float acc[HB][DVPL];
for (int g = 0; g < HB; g++) {
  const long qoff = (long(seq) * num_heads + head0 + g) * D + lane * DPL;
  for (int i = 0; i < DPL; i++) {
    qv[g][i] = float(q[qoff + i]) * scale[0];
  }
  for (int i = 0; i < DVPL; i++) {
    acc[g][i] = 0.0f;
  }
  m[g] = -INFINITY;
  l[g] = 0.0f;
}

for (int t = start + int(sg); t < end; t += NSG) {
  const long block = block_tables[long(seq) * max_blocks + t / BS];
  const long row = (block * num_kv_heads + kvh) * BS + t % BS;
  float kr[DPL];
  float vr[DVPL];
#if MACINFER_QUANTIZED
  for (int i = 0; i < DPL; i++) {
    if (KCHAN) {
      const long chan = (block * num_kv_heads + kvh) * D + int(lane) * DPL + i;
      MI_DEQ(kr[i], k_w, k_s, k_b, k_words, k_groups, KGROUP, KBITS, chan, t % BS);
    } else {
      MI_DEQ(kr[i], k_w, k_s, k_b, k_words, k_groups, KGROUP, KBITS, row, int(lane) * DPL + i);
    }
  }
  for (int i = 0; i < DVPL; i++) {
    MI_DEQ(vr[i], v_w, v_s, v_b, v_words, v_groups, VGROUP, VBITS, row, int(lane) * DVPL + i);
  }
#else
  const long koff = row * D + lane * DPL;
  const long voff = row * v_width + lane * DVPL;
  for (int i = 0; i < DPL; i++) {
    kr[i] = float(k_pool[koff + i]);
  }
  for (int i = 0; i < DVPL; i++) {
    vr[i] = float(v_pool[voff + i]);
  }
#endif
  for (int g = 0; g < HB; g++) {
    float s = 0.0f;
    for (int i = 0; i < DPL; i++) {
      s += qv[g][i] * kr[i];
    }
    s = simd_sum(s);  // uniform: every lane of a simdgroup runs the same t
    const float m_new = max(m[g], s);
    const float corr = exp(m[g] - m_new);
    const float p = exp(s - m_new);
    l[g] = l[g] * corr + p;
    for (int i = 0; i < DVPL; i++) {
      acc[g][i] = acc[g][i] * corr + p * vr[i];
    }
    m[g] = m_new;
  }
}

threadgroup float sm_m[NSG * HB];
threadgroup float sm_l[NSG * HB];
threadgroup float sm_acc[NSG * HB * DV];
for (int g = 0; g < HB; g++) {
  if (lane == 0) {
    sm_m[sg * HB + g] = m[g];
    sm_l[sg * HB + g] = l[g];
  }
  for (int i = 0; i < DVPL; i++) {
    sm_acc[(sg * HB + g) * DV + lane * DVPL + i] = acc[g][i];
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);

if (sg == 0) {
  for (int g = 0; g < HB; g++) {
    float M = -INFINITY;
    for (int s = 0; s < NSG; s++) {
      M = max(M, sm_m[s * HB + g]);
    }
    float L = 0.0f;
    float o[DVPL];
    for (int i = 0; i < DVPL; i++) {
      o[i] = 0.0f;
    }
    for (int s = 0; s < NSG; s++) {
      const float ms = sm_m[s * HB + g];
      const float w = ms == -INFINITY ? 0.0f : exp(ms - M);
      L += sm_l[s * HB + g] * w;
      for (int i = 0; i < DVPL; i++) {
        o[i] += sm_acc[(s * HB + g) * DV + lane * DVPL + i] * w;
      }
    }
    const long bh = long(seq) * num_heads + head0 + g;
#if MACINFER_PARTITIONED
    const long idx = bh * threadgroups_per_grid.z + part;
    for (int i = 0; i < DVPL; i++) {
      tmp_out[idx * DV + lane * DVPL + i] = o[i];
    }
    if (lane == 0) {
      tmp_ml[idx * 2] = M;
      tmp_ml[idx * 2 + 1] = L;
    }
#else
    for (int i = 0; i < DVPL; i++) {
      out[bh * DV + lane * DVPL + i] = static_cast<T>(L > 0.0f ? o[i] / L : 0.0f);
    }
#endif
  }
}
#if MACINFER_QUANTIZED
#undef MI_DEQ
#endif
