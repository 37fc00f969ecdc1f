// Merge pass of split-K paged decode attention: combines the per-partition
// (max, sum, unnormalised output) triples into the softmax-normalised output.
// Grid: one simdgroup per (sequence, head); lanes split head_dim.
// Inputs: tmp_out [B, H, P, D] float32, tmp_ml [B, H, P, 2] float32. Output: out [B, H, D] T.
constexpr int DPL = D / 32;
const uint lane = thread_index_in_simdgroup;
const long bh = threadgroup_position_in_grid.y;
const int P = tmp_ml_shape[2];
float M = -INFINITY;
for (int p = 0; p < P; p++) {
  M = max(M, tmp_ml[(bh * P + p) * 2]);
}
float L = 0.0f;
float o[DPL];
for (int i = 0; i < DPL; i++) {
  o[i] = 0.0f;
}
for (int p = 0; p < P; p++) {
  const float mp = tmp_ml[(bh * P + p) * 2];
  if (mp == -INFINITY) {
    continue;  // a partition past this sequence's end
  }
  const float w = exp(mp - M);
  L += tmp_ml[(bh * P + p) * 2 + 1] * w;
  for (int i = 0; i < DPL; i++) {
    o[i] += tmp_out[(bh * P + p) * D + lane * DPL + i] * w;
  }
}
for (int i = 0; i < DPL; i++) {
  out[bh * D + lane * DPL + i] = static_cast<T>(L > 0.0f ? o[i] / L : 0.0f);
}
