// Batched affine-quantized matrix-vector product for decode batches of 2..32 rows,
// optionally fused with the SwiGLU of a Llama MLP. Body of an mx.fast.metal_kernel.
//
// Why: MLX's qmv kernels give each row of x its own threadgroups (grid = M x N/8),
// so a batch of M decode rows streams every weight block M times and relies on the
// cache to absorb it; past a per-chip row limit MLX switches to 32-row qmm tiles.
// Here one threadgroup applies each weight block it loads to R rows of x at once,
// so weights are read ceil(M / R) times. The fused variant computes
// silu(x Wg^T) * (x Wu^T) in the same pass (one launch, no gate/up round trip).
//
// Layout (MLX affine): w [N, K * BITS / 32] uint32, element k of row n at bit
// (k * BITS) % 32 of word k * BITS / 32; scales, biases [N, K / GS]; value = s * q + b.
// Threadgroup (32, 2): each simdgroup owns 4 output rows; a lane handles 8
// consecutive k (one group, since GS is a multiple of 8) per step of 256.
// Templates: T (x/out dtype), BITS (4 or 8), GS (group size), R (x rows per threadgroup).
// Inputs: x [M, K], w, scales, biases (and w_up, scales_up, biases_up when fused).
// Output: y [M, N]. Grid: (32, 2 * N / 8, ceil(M / R)); N % 8 == 0, K % GS == 0.
constexpr int VPT = 8;
constexpr int ROWS = 4;
constexpr uint MASK = (1u << BITS) - 1u;
const int M = x_shape[0];
const int K = x_shape[1];
const int N = w_shape[0];
const int words_per_row = K * BITS / 32;
const int groups_per_row = K / GS;
const uint lane = thread_index_in_simdgroup;
const int n0 = threadgroup_position_in_grid.y * 8 + simdgroup_index_in_threadgroup * ROWS;
const int m0 = threadgroup_position_in_grid.z * R;

float acc[ROWS][R];
#if MACINFER_FUSED_SWIGLU
float acc_up[ROWS][R];
#endif
for (int r = 0; r < ROWS; r++) {
  for (int i = 0; i < R; i++) {
    acc[r][i] = 0.0f;
#if MACINFER_FUSED_SWIGLU
    acc_up[r][i] = 0.0f;
#endif
  }
}

for (int k0 = 0; k0 < K; k0 += 32 * VPT) {
  const int k = k0 + int(lane) * VPT;
  if (k >= K) {
    continue;  // the ragged tail of K: no simd op inside this loop
  }
  float xv[R][VPT];
  float xsum[R];
  for (int i = 0; i < R; i++) {
    xsum[i] = 0.0f;
    const int m = min(m0 + i, M - 1);  // rows past M compute garbage that is never stored
    for (int j = 0; j < VPT; j++) {
      xv[i][j] = float(x[long(m) * K + k + j]);
      xsum[i] += xv[i][j];
    }
  }
  for (int r = 0; r < ROWS; r++) {
    const long n = n0 + r;
    const int g = k / GS;
    const float s = float(scales[n * groups_per_row + g]);
    const float b = float(biases[n * groups_per_row + g]);
    float q[VPT];
    const device uint32_t* wp = w + n * words_per_row;
    for (int j = 0; j < VPT; j++) {
      const int bit = (k + j) * BITS;
      q[j] = float((wp[bit / 32] >> (bit % 32)) & MASK);
    }
#if MACINFER_FUSED_SWIGLU
    const float su = float(scales_up[n * groups_per_row + g]);
    const float bu = float(biases_up[n * groups_per_row + g]);
    float qu[VPT];
    const device uint32_t* wu = w_up + n * words_per_row;
    for (int j = 0; j < VPT; j++) {
      const int bit = (k + j) * BITS;
      qu[j] = float((wu[bit / 32] >> (bit % 32)) & MASK);
    }
#endif
    for (int i = 0; i < R; i++) {
      float dot = 0.0f;
      for (int j = 0; j < VPT; j++) {
        dot += xv[i][j] * q[j];
      }
      acc[r][i] += s * dot + b * xsum[i];
#if MACINFER_FUSED_SWIGLU
      float dot_up = 0.0f;
      for (int j = 0; j < VPT; j++) {
        dot_up += xv[i][j] * qu[j];
      }
      acc_up[r][i] += su * dot_up + bu * xsum[i];
#endif
    }
  }
}

for (int r = 0; r < ROWS; r++) {
  for (int i = 0; i < R; i++) {
    float v = simd_sum(acc[r][i]);
#if MACINFER_FUSED_SWIGLU
    const float up = simd_sum(acc_up[r][i]);
    v = v / (1.0f + exp(-v)) * up;
#endif
    if (lane == 0 && m0 + i < M) {
      y[long(m0 + i) * N + n0 + r] = static_cast<T>(v);
    }
  }
}
