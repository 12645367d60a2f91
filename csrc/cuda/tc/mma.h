// Warp-level tensor-core building blocks (mma.sync m16n8k16, ldmatrix, cp.async) shared by every
// tensor-core attention kernel. Tiles in shared memory are [rows][W] row-major (W = 32 or a
// multiple of 64) with an XOR swizzle of 16-byte chunks so that ldmatrix reads of 8 consecutive
// rows hit distinct banks.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace adaattn {
namespace tc {

// Element offset of (row, col) in a swizzled [rows][W] tile. W % 64 == 0: each 128-byte line
// holds 8 chunks of one row, XORed with row % 8. W = 32: a line holds two rows of 4 chunks, so
// chunks are XORed with (row / 2) % 4 and the 8 rows of an ldmatrix still cover 8 chunk slots.
template <int W>
__device__ __forceinline__ int swz(int row, int col) {
  static_assert(W % 64 == 0 || W == 32, "swizzle needs a tile width of 32 or a multiple of 64");
  if constexpr (W == 32) {
    return row * W + ((((col >> 3) ^ ((row >> 1) & 3))) << 3) + (col & 7);
  } else {
    return row * W + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
  }
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Named barrier `id` over `threads` threads (bar.sync), which __syncthreads (barrier 0) never
// uses.
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Arrives at named barrier `id` over `threads` threads (bar.arrive) without waiting: the
// producer side of a named_sync.
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// 16-byte async copy global -> shared address dst; when !valid the destination is zero-filled
// and nothing is read (src must still be a mapped address).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  cp_async16(smem_addr(dst), src, valid);
}
// 16-byte async copy to the shared address dst, without a bounds operand.
__device__ __forceinline__ void cp_async16_unmasked(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
// 4-byte async copy (one float), zero-filled when !valid, as cp_async16.
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
  const int bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }
// Waits until at most N of this thread's committed cp.async groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
// The transpose of an 8 x 8 matrix of 16-bit pairs held as mma fragments (lane 4r + c: row r,
// columns 2c and 2c + 1).
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// Explicit conversions: torch builds with __CUDA_NO_HALF_CONVERSIONS__ and friends.
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
// The two 16-bit values of a word (low half first) as floats.
template <typename T>
__device__ __forceinline__ void unpack_pair(uint32_t w, float& lo, float& hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xffff0000u);
  } else {
    __half2_raw h;
    h.x = static_cast<unsigned short>(w & 0xffff);
    h.y = static_cast<unsigned short>(w >> 16);
    const float2 f = __half22float2(__half2(h));
    lo = f.x;
    hi = f.y;
  }
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}

template <typename T>
struct MmaOp;

template <>
struct MmaOp<__nv_bfloat16> {
  __device__ __forceinline__ static void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};

template <>
struct MmaOp<__half> {
  __device__ __forceinline__ static void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};

// Copies a [ROWS][D] tile whose row r lives at src + r * row_stride into shared memory, element
// (r, col) at dst + offset(r, col). Rows >= valid_rows and columns >= valid_cols (a multiple of
// 8: a caller's head dim below the kernel's D) are zero-filled (their source address falls back
// to row 0, column 0, in bounds).
template <int ROWS, int D, int THREADS, typename T, typename Offset>
__device__ __forceinline__ void load_tile_to(T* dst, const T* src, int64_t row_stride,
                                             int valid_rows, int tid, Offset offset,
                                             int valid_cols = D) {
  constexpr int kChunksPerRow = D / 8;
  constexpr int kChunks = ROWS * kChunksPerRow;
  static_assert(kChunks % THREADS == 0, "tile chunks must divide evenly among threads");
  if constexpr (THREADS % kChunksPerRow == 0) {
    // One column chunk per thread: past valid_cols, it is zero-filled in every row, as rows past
    // valid_rows (the per-copy work of a full-width tile stays that of the row test alone).
    const int col = (tid % kChunksPerRow) * 8;
    const bool col_ok = col < valid_cols;
    const int rows = col_ok ? valid_rows : 0;
    const T* base = col_ok ? src + col : src;
#pragma unroll
    for (int i = 0; i < kChunks / THREADS; ++i) {
      const int r = (tid + i * THREADS) / kChunksPerRow;
      const bool valid = r < rows;
      cp_async16(dst + offset(r, col), base + (valid ? r * row_stride : 0), valid);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kChunks / THREADS; ++i) {
      const int c = tid + i * THREADS;
      const int r = c / kChunksPerRow;
      const int col = (c % kChunksPerRow) * 8;
      const bool row_ok = r < valid_rows, col_ok = col < valid_cols;
      cp_async16(dst + offset(r, col), src + (row_ok ? r * row_stride : 0) + (col_ok ? col : 0),
                 row_ok && col_ok);
    }
  }
}

// A [ROWS][D] tile whose rows lie anywhere (a paged cache, rows gathered from several heads)
// into the layout offset(r, col) (element offsets): row r is read from row_ptr(r) when
// r < valid_rows, else zero-filled.
template <int ROWS, int D, int THREADS, typename T, typename RowPtr, typename Offset>
__device__ __forceinline__ void load_rows_async(T* dst, RowPtr row_ptr, int valid_rows, int tid,
                                                Offset offset) {
  constexpr int kChunksPerRow = D / 8;
  constexpr int kChunks = ROWS * kChunksPerRow;
#pragma unroll
  for (int i = 0; i < (kChunks + THREADS - 1) / THREADS; ++i) {
    const int c = tid + i * THREADS;
    if (kChunks % THREADS != 0 && c >= kChunks) break;
    const int r = c / kChunksPerRow;
    const int col = (c % kChunksPerRow) * 8;
    const bool valid = r < valid_rows;
    const T* src = row_ptr(valid ? r : 0);
    cp_async16(dst + offset(r, col), src + col, valid);
  }
}

// load_tile_to into the swz<D> layout of the mma.sync kernels.
template <int ROWS, int D, int THREADS, typename T>
__device__ __forceinline__ void load_tile_async(T* dst, const T* src, int64_t row_stride,
                                                int valid_rows, int tid, int valid_cols = D) {
  load_tile_to<ROWS, D, THREADS>(
      dst, src, row_stride, valid_rows, tid, [](int r, int col) { return swz<D>(r, col); },
      valid_cols);
}

// acc[MI][NT] (16 x 8 fragments) += A * B^T where A = rows [a_row0, a_row0 + 16*MI) and
// B = rows [b_row0, b_row0 + 8*NT) of two swizzled [rows][D] tiles, reduced over all D columns.
// (S = Q K^T, dP = dO V^T and their transposes.)
template <int MI, int NT, int D, typename T>
__device__ __forceinline__ void warp_gemm_nt(float (&acc)[MI][NT][4], const T* sA, int a_row0,
                                             const T* sB, int b_row0, int lane) {
  static_assert(NT % 2 == 0, "NT must be even (x4 ldmatrix loads two n-tiles)");
  // Full unrolling at D = 128 lets ptxas hoist every ldmatrix and spill; two steps do not.
#pragma unroll(D <= 64 ? D / 16 : 2)
  for (int k0 = 0; k0 < D; k0 += 16) {
    uint32_t a[MI][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
      const int row = a_row0 + mi * 16 + (lane & 15);
      ldmatrix_x4(a[mi], sA + swz<D>(row, k0 + (lane >> 4) * 8));
    }
#pragma unroll
    for (int ni = 0; ni < NT; ni += 2) {
      uint32_t b[4];
      const int row = b_row0 + ni * 8 + (lane & 7) + ((lane >> 4) << 3);
      ldmatrix_x4(b, sB + swz<D>(row, k0 + ((lane >> 3) & 1) * 8));
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        MmaOp<T>::run(acc[mi][ni], a[mi], b[0], b[1]);
        MmaOp<T>::run(acc[mi][ni + 1], a[mi], b[2], b[3]);
      }
    }
  }
}

// A-fragments a[MI][KT] of rows [row0, row0 + 16*MI) x cols [0, 16*KT) of a swizzled [rows][W]
// tile (the A loads of warp_gemm_nt).
template <int MI, int KT, int W, typename T>
__device__ __forceinline__ void load_a_frags(uint32_t (&a)[MI][KT][4], const T* sA, int row0,
                                             int lane) {
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int kt = 0; kt < KT; ++kt) {
      const int row = row0 + mi * 16 + (lane & 15);
      ldmatrix_x4(a[mi][kt], sA + swz<W>(row, kt * 16 + (lane >> 4) * 8));
    }
}

// acc[MI][NT] += A B with A in registers as A-fragments a[MI][KT] and B's fragments of k-step
// kt and n-tiles (ni, ni + 1) as load_b(kt, ni, b[4]) reads them (b[0..1] for ni, b[2..3] for
// ni + 1): the loop of warp_gemm_rs_nt and warp_gemm_rs.
template <int MI, int NT, int KT, typename T, typename LoadB>
__device__ __forceinline__ void warp_gemm_rs_loads(float (&acc)[MI][NT][4],
                                                   const uint32_t (&a)[MI][KT][4],
                                                   const LoadB& load_b) {
  static_assert(NT % 2 == 0, "NT must be even (x4 ldmatrix loads two n-tiles)");
#pragma unroll
  for (int kt = 0; kt < KT; ++kt) {
#pragma unroll
    for (int ni = 0; ni < NT; ni += 2) {
      uint32_t b[4];
      load_b(kt, ni, b);
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        MmaOp<T>::run(acc[mi][ni], a[mi][kt], b[0], b[1]);
        MmaOp<T>::run(acc[mi][ni + 1], a[mi][kt], b[2], b[3]);
      }
    }
  }
}

// acc[MI][NT] += A B^T with A in registers (16*MI x 16*KT) and B = rows [b_row0, b_row0 + 8*NT)
// of a swizzled [rows][W] tile, reduced over its first 16*KT columns (the B loads of
// warp_gemm_nt). (S = Q K^T with q held over many tiles, dU S^T, dU V^T, V dR^T.)
template <int MI, int NT, int KT, int W, typename T>
__device__ __forceinline__ void warp_gemm_rs_nt(float (&acc)[MI][NT][4],
                                                const uint32_t (&a)[MI][KT][4], const T* sB,
                                                int b_row0, int lane) {
  warp_gemm_rs_loads<MI, NT, KT, T>(acc, a, [&](int kt, int ni, uint32_t(&b)[4]) {
    const int row = b_row0 + ni * 8 + (lane & 7) + ((lane >> 4) << 3);
    ldmatrix_x4(b, sB + swz<W>(row, kt * 16 + ((lane >> 3) & 1) * 8));
  });
}

// acc[MI][NT] += A * B where A is in registers as A-fragments a[MI][KT] (16 x 16 each, e.g. the
// probabilities P from to_a_frags) and B = rows [b_row0, b_row0 + 16*KT) of a swizzled [rows][D]
// tile, columns [b_col0, b_col0 + 8*NT). (O += P V, dQ += dS K, dV += P^T dO, dK += dS^T Q.)
template <int MI, int NT, int KT, int D, typename T>
__device__ __forceinline__ void warp_gemm_rs(float (&acc)[MI][NT][4],
                                             const uint32_t (&a)[MI][KT][4], const T* sB,
                                             int b_row0, int lane, int b_col0 = 0) {
  warp_gemm_rs_loads<MI, NT, KT, T>(acc, a, [&](int kt, int ni, uint32_t(&b)[4]) {
    const int row = b_row0 + kt * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
    ldmatrix_x4_trans(b, sB + swz<D>(row, b_col0 + ni * 8 + (lane >> 4) * 8));
  });
}

// acc[NT] (one 16 x 8 fragment row) += A^T * B where A = rows [0, 16*KT) x columns
// [a_col0, a_col0 + 16) of a swizzled [rows][WA] tile and B = the same rows x columns
// [b_col0, b_col0 + 8*NT) of a swizzled [rows][WB] tile: both are stored reduction-major, so
// both are read with transposing ldmatrix. (dQ += dS K from a staged dS^T.)
template <int NT, int KT, int WA, int WB, typename T>
__device__ __forceinline__ void warp_gemm_tn(float (&acc)[NT][4], const T* sA, int a_col0,
                                             const T* sB, int b_col0, int lane) {
  static_assert(NT % 2 == 0, "NT must be even (x4 ldmatrix loads two n-tiles)");
#pragma unroll
  for (int kt = 0; kt < KT; ++kt) {
    uint32_t a[4];
    ldmatrix_x4_trans(a, sA + swz<WA>(kt * 16 + (lane & 7) + ((lane >> 4) << 3),
                                      a_col0 + ((lane >> 3) & 1) * 8));
#pragma unroll
    for (int ni = 0; ni < NT; ni += 2) {
      uint32_t b[4];
      const int row = kt * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
      ldmatrix_x4_trans(b, sB + swz<WB>(row, b_col0 + ni * 8 + (lane >> 4) * 8));
      MmaOp<T>::run(acc[ni], a, b[0], b[1]);
      MmaOp<T>::run(acc[ni + 1], a, b[2], b[3]);
    }
  }
}

// acc[MI][NT] (16 x 8 fragments) += A^T * B: warp_gemm_tn (above) over MI fragment rows,
// columns [a_col0, a_col0 + 16*MI) of A, each B fragment loaded once for all of them. (Gram
// matrices X^T X.)
template <int MI, int NT, int KT, int WA, int WB, typename T>
__device__ __forceinline__ void warp_gemm_tn_rows(float (&acc)[MI][NT][4], const T* sA,
                                                  int a_col0, const T* sB, int b_col0, int lane) {
  static_assert(NT % 2 == 0, "NT must be even (x4 ldmatrix loads two n-tiles)");
#pragma unroll
  for (int kt = 0; kt < KT; ++kt) {
    uint32_t a[MI][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
      ldmatrix_x4_trans(a[mi], sA + swz<WA>(kt * 16 + (lane & 7) + ((lane >> 4) << 3),
                                            a_col0 + mi * 16 + ((lane >> 3) & 1) * 8));
    }
#pragma unroll
    for (int ni = 0; ni < NT; ni += 2) {
      uint32_t b[4];
      const int row = kt * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
      ldmatrix_x4_trans(b, sB + swz<WB>(row, b_col0 + ni * 8 + (lane >> 4) * 8));
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        MmaOp<T>::run(acc[mi][ni], a[mi], b[0], b[1]);
        MmaOp<T>::run(acc[mi][ni + 1], a[mi], b[2], b[3]);
      }
    }
  }
}

// *addr += a, addr[1] += b without a return value (a reduction in L2); addr 8-byte aligned.
__device__ __forceinline__ void atomic_add2(float* addr, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(addr), make_float2(a, b));
#else
  atomicAdd(addr, a);
  atomicAdd(addr + 1, b);
#endif
}

// Re-packs accumulator fragments (16 x 8, fp32) as A-fragments (16 x 16, T): the accumulator
// layout of two neighbouring n-tiles is exactly the A layout, so no data moves between lanes.
template <int MI, int NT, typename T>
__device__ __forceinline__ void to_a_frags(const float (&acc)[MI][NT][4],
                                           uint32_t (&a)[MI][NT / 2][4]) {
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
    for (int kt = 0; kt < NT / 2; ++kt) {
      a[mi][kt][0] = MmaOp<T>::pack(acc[mi][2 * kt][0], acc[mi][2 * kt][1]);
      a[mi][kt][1] = MmaOp<T>::pack(acc[mi][2 * kt][2], acc[mi][2 * kt][3]);
      a[mi][kt][2] = MmaOp<T>::pack(acc[mi][2 * kt + 1][0], acc[mi][2 * kt + 1][1]);
      a[mi][kt][3] = MmaOp<T>::pack(acc[mi][2 * kt + 1][2], acc[mi][2 * kt + 1][3]);
    }
  }
}

// acc *= x, elementwise.
template <int MI, int NT>
__device__ __forceinline__ void scale_frag(float (&acc)[MI][NT][4], float x) {
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NT; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][ni][e] *= x;
}

template <int MI, int NT>
__device__ __forceinline__ void zero(float (&acc)[MI][NT][4]) {
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NT; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.f;
}

// Writes a warp's accumulator rows (16*MI rows x 8*NT cols, scaled) to global memory through
// the warp's own rows of a swizzled [rows][D] smem tile, so global stores are 16-byte and
// coalesced: columns [col0, col0 + 8*NT) of rows of D columns (a column slice, or whole rows).
// Rows >= valid_rows and columns >= valid_cols (the caller's head dim) are not written.
template <int MI, int NT, int D, typename T>
__device__ __forceinline__ void store_rows(const float (&acc)[MI][NT][4], const float (&row_scale)[MI][2],
                                           T* s_tile, int row0, T* dst, int64_t row_stride,
                                           int valid_rows, int lane, int col0 = 0,
                                           int valid_cols = D) {
  static_assert(8 * NT <= D, "store_rows writes columns of the staging tile");
  const int g = lane >> 2;
  const int t = lane & 3;
  __syncwarp();  // other lanes of the warp may still be reading these rows (their fragments)
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
    for (int ni = 0; ni < NT; ++ni) {
      const int col = col0 + ni * 8 + 2 * t;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = row0 + mi * 16 + g + 8 * h;
        const uint32_t v = MmaOp<T>::pack(acc[mi][ni][2 * h] * row_scale[mi][h],
                                          acc[mi][ni][2 * h + 1] * row_scale[mi][h]);
        *reinterpret_cast<uint32_t*>(s_tile + swz<D>(row, col)) = v;
      }
    }
  }
  __syncwarp();
  constexpr int kChunksPerRow = NT;
#pragma unroll
  for (int i = 0; i < 16 * MI * kChunksPerRow / 32; ++i) {
    const int c = lane + 32 * i;
    const int r = c / kChunksPerRow;
    const int col = col0 + (c % kChunksPerRow) * 8;
    if (r < valid_rows - row0 && col < valid_cols) {
      *reinterpret_cast<uint4*>(dst + (row0 + r) * row_stride + col) =
          *reinterpret_cast<const uint4*>(s_tile + swz<D>(row0 + r, col));
    }
  }
}

}  // namespace tc
}  // namespace adaattn
