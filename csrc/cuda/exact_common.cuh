// Scalar building blocks of the exact (fp32/fp64) CUDA kernels: one warp owns one row of
// length D, lane l holding elements l, l + 32, ... in registers; dot products are reduced with
// xor shuffles so every lane ends with the same bits.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <limits>
#include <type_traits>

namespace adaattn {
namespace exact {

constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = 4;
constexpr int kThreads = kWarpsPerBlock * kWarp;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int64_t kMaxBlocks = int64_t{1} << 30;  // grid-stride loops cover the rest

template <typename T>
constexpr T kNegInf = -std::numeric_limits<T>::infinity();

// --use_fast_math turns expf/logf into approximate intrinsics (errors of several ulp that grow
// with |x|); going through double keeps the fp32 path within 1e-5 of fp64.
__device__ __forceinline__ float exact_exp(float x) {
  return static_cast<float>(exp(static_cast<double>(x)));
}
__device__ __forceinline__ double exact_exp(double x) { return exp(x); }

// Log-sum-exp of a row from its running max and sum, in double.
template <typename T>
__device__ __forceinline__ double row_lse(T row_max, T row_sum) {
  return static_cast<double>(row_max) + log(static_cast<double>(row_sum));
}

// What an online softmax subtracts from the scores: the running max, or 0 while every score is
// -inf (an Inf in q or k), whose weights are then exp(-inf) = 0 as masked keys' are, not
// exp(-inf + inf) = NaN. A NaN score is skipped by the max and makes the sum NaN through its
// own weight; a +inf one gives exp(inf - inf) = NaN.
template <typename T>
__device__ __forceinline__ T softmax_base(T row_max) {
  return row_max == kNegInf<T> ? T(0) : row_max;
}

// Whether a row's softmax sum counts attended keys: at least 1 once a finite score is
// attended, exactly 0 when none is; a NaN sum counts, so the NaN reaches out and lse.
template <typename T>
__device__ __forceinline__ bool row_saw_keys(T row_sum) {
  return row_sum != T(0);
}

// exp(s - lse), a probability from its row's finished lse; 0 for a row whose every score is
// -inf (lse -inf), as for masked keys, not exp(-inf + inf) = NaN.
template <typename T>
__device__ __forceinline__ T prob_from_lse(T s, T lse) {
  return exact_exp(s - (lse == kNegInf<T> ? -lse : lse));
}

template <typename T>
__device__ __forceinline__ T warp_sum(T x) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) x += __shfl_xor_sync(kFullMask, x, offset);
  return x;
}

template <typename T>
__device__ __forceinline__ T warp_max(T x) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) {
    const T other = __shfl_xor_sync(kFullMask, x, offset);
    x = other > x ? other : x;
  }
  return x;
}

// Calls fn(item) for the items [0, total) of this warp: one warp per item, grid-stride.
template <typename Fn>
__device__ __forceinline__ void for_each_warp_item(int64_t total, Fn&& fn) {
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
       item < total; item += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    fn(item);
  }
}

template <typename T, int kSlots>
__device__ __forceinline__ void load_slice(const T* row, int dim, int lane, T (&x)[kSlots]) {
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    const int d = lane + s * kWarp;
    x[s] = d < dim ? row[d] : T(0);
  }
}

// This lane's share of x . row.
template <typename T, int kSlots>
__device__ __forceinline__ T slice_dot(const T (&x)[kSlots], const T* row, int dim, int lane) {
  T acc = 0;
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    const int d = lane + s * kWarp;
    if (d < dim) acc += x[s] * row[d];
  }
  return acc;
}

// acc += a * row (this lane's elements).
template <typename T, int kSlots>
__device__ __forceinline__ void slice_axpy(T a, const T* row, int dim, int lane, T (&acc)[kSlots]) {
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    const int d = lane + s * kWarp;
    if (d < dim) acc[s] += a * row[d];
  }
}

template <typename T, int kSlots>
__device__ __forceinline__ void slice_scale(T a, T (&acc)[kSlots]) {
#pragma unroll
  for (int s = 0; s < kSlots; ++s) acc[s] *= a;
}

template <typename T, int kSlots>
__device__ __forceinline__ void store_slice(const T (&x)[kSlots], T* row, int dim, int lane) {
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    const int d = lane + s * kWarp;
    if (d < dim) row[d] = x[s];
  }
}

// The rows of one (batch entry, head) of a tensor: row i at base + i * stride, `dim` elements.
template <typename T>
struct Rows {
  const T* base;
  int64_t stride;
  int dim;
  __device__ __forceinline__ const T* operator[](int i) const { return base + i * stride; }
};

// Dot products of a chunk of rows with a warp's register row: lane t < count gets
// scale * x . rows[first + t] in `mine`; the other lanes keep theirs. All lanes take part.
template <typename T, int kSlots>
__device__ __forceinline__ void chunk_dot(const T (&x)[kSlots], Rows<T> rows, T scale, int first,
                                          int count, int lane, T& mine) {
  for (int t = 0; t < count; ++t) {
    const T s = warp_sum(slice_dot(x, rows[first + t], rows.dim, lane));
    if (lane == t) mine = s * scale;
  }
}

// The same for two register rows at once (scores and dA of a chunk): lane t < count gets
// scale * x . xs[first + t] in `mine_x` and y . ys[first + t] in `mine_y`.
template <typename T, int kSlots>
__device__ __forceinline__ void chunk_dot2(const T (&x)[kSlots], Rows<T> xs, T scale,
                                           const T (&y)[kSlots], Rows<T> ys, int first, int count,
                                           int lane, T& mine_x, T& mine_y) {
  for (int t = 0; t < count; ++t) {
    const T sx = warp_sum(slice_dot(x, xs[first + t], xs.dim, lane));
    const T sy = warp_sum(slice_dot(y, ys[first + t], ys.dim, lane));
    if (lane == t) {
      mine_x = sx * scale;
      mine_y = sy;
    }
  }
}

__device__ __forceinline__ void add_count(int64_t* counter, int64_t n) {
  atomicAdd(reinterpret_cast<unsigned long long*>(counter), static_cast<unsigned long long>(n));
}

inline unsigned grid_for(int64_t warps) {
  const int64_t blocks = (warps + kWarpsPerBlock - 1) / kWarpsPerBlock;
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

// Calls fn(std::integral_constant<int, kSlots>) with the smallest register slice that holds a
// row of head_dim elements across a warp.
template <typename Fn>
inline void dispatch_slots(int head_dim, Fn&& fn) {
  TORCH_CHECK(head_dim > 0 && head_dim <= 8 * kWarp,
              "adaattn: the exact CUDA kernels take head dims D, Dv in [1, 256], got ", head_dim);
  if (head_dim <= kWarp) {
    fn(std::integral_constant<int, 1>{});
  } else if (head_dim <= 2 * kWarp) {
    fn(std::integral_constant<int, 2>{});
  } else if (head_dim <= 4 * kWarp) {
    fn(std::integral_constant<int, 4>{});
  } else {
    fn(std::integral_constant<int, 8>{});
  }
}

// Calls fn(T{}) with the element type of `dtype`: float or double.
template <typename Fn>
inline void dispatch_exact_dtype(c10::ScalarType dtype, Fn&& fn) {
  switch (dtype) {
    case c10::kFloat:
      fn(float{});
      break;
    case c10::kDouble:
      fn(double{});
      break;
    default:
      TORCH_CHECK(false, "adaattn: the exact CUDA attention kernels take float32 or float64, got ",
                  dtype);
  }
}

}  // namespace exact
}  // namespace adaattn
