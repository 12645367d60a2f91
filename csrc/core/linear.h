// Parameters and scalar helpers of the linear-attention family, shared by the CPU and
// CUDA kernels. Plain data only: LinearParams is passed by value to CUDA kernels.
#pragma once

#include <cmath>
#include <cstdint>

#include "host_device.h"

namespace adaattn {

enum class FeatureMap : int { kElu = 0, kRelu = 1, kIdentity = 2 };

// Strides in elements of a [B, H, T, *] (dense) or [T, H, *] (packed) tensor; the last dim is
// contiguous. Packed tensors have batch == 0 (sequences are located through cu_seqlens).
struct LinearStrides {
  int64_t batch, head, row;
};

// One problem is (sequence n, head h). Dense: sequence n is batch entry n, rows [0, len).
// Packed: sequence n is rows [cu_seqlens[n], cu_seqlens[n + 1]) of the packed tensors.
//
// The state is kept augmented: S = sum_s phi(k_s)^T [v_s | 1] of width E = Dv + normalize, so
// its last column is the normaliser z when normalize is set (a row of ones appended to v).
// States are contiguous [N, H, D, E] in the compute dtype (float32, float64 for float64 inputs).
struct LinearParams {
  const void* q;  // [B, H, T, D] | [T, H, D]
  const void* k;  // [B, H, T, D] | [T, H, D]
  const void* v;  // [B, H, T, Dv] | [T, H, Dv]
  LinearStrides q_s, k_s, v_s;
  const int* cu_seqlens;  // [N + 1] or null (dense)
  int num_seqs;           // N (= B when dense)
  int heads;
  int len;  // T: the dense length, or the packed total
  int dim;
  int dim_v;
  int state_cols;  // E = dim_v + normalize
  FeatureMap feature_map;
  bool causal;
  bool normalize;

  const void* state_in;  // [N, H, D, E] or null (zeros)

  // ---- forward outputs ----
  void* out;  // q's layout with Dv columns
  LinearStrides o_s;
  void* state_out;  // [N, H, D, E]

  // ---- backward ----
  const void* dout;  // out's shape
  LinearStrides do_s;
  const void* dstate;  // gradient of state_out [N, H, D, E], or null (zero)
  void* dq;
  void* dk;
  void* dv;
  LinearStrides dq_s, dk_s, dv_s;
  void* dstate_in;  // gradient of the initial state [N, H, D, E] (written even without state_in)
};

template <typename T>
ADAATTN_HD T feature(FeatureMap f, T x) {
  if (f == FeatureMap::kElu) return x > T(0) ? x + T(1) : exp(x);
  if (f == FeatureMap::kRelu) return x > T(0) ? x : T(0);
  return x;
}

// d phi / dx.
template <typename T>
ADAATTN_HD T feature_grad(FeatureMap f, T x) {
  if (f == FeatureMap::kElu) return x > T(0) ? T(1) : exp(x);
  if (f == FeatureMap::kRelu) return x > T(0) ? T(1) : T(0);
  return T(1);
}

// 1 / den, and 0 for den == 0: with relu, phi(q).z == 0 implies phi(q) S == 0, so such a row
// gives out = 0 and zero gradients instead of NaN.
template <typename T>
ADAATTN_HD T safe_reciprocal(T den) {
  return den != T(0) ? T(1) / den : T(0);
}

// First row and length of sequence n (packed rows are clamped to [0, len], so a malformed
// cu_seqlens on the device can never index out of bounds).
ADAATTN_HD void seq_range(const LinearParams& p, int n, int64_t& start, int64_t& length) {
  if (p.cu_seqlens == nullptr) {
    start = 0;
    length = p.len;
    return;
  }
  int64_t a = p.cu_seqlens[n], b = p.cu_seqlens[n + 1];
  a = a < 0 ? 0 : (a > p.len ? p.len : a);
  b = b < a ? a : (b > p.len ? p.len : b);
  start = a;
  length = b - a;
}

// Element offset of row t of sequence n, head h (t counted from the sequence's first row).
ADAATTN_HD int64_t row_offset(const LinearStrides& s, const LinearParams& p, int n, int h,
                              int64_t start, int64_t t) {
  const int64_t batch = p.cu_seqlens == nullptr ? static_cast<int64_t>(n) * s.batch : 0;
  return batch + static_cast<int64_t>(h) * s.head + (start + t) * s.row;
}

}  // namespace adaattn
