// The CUDA kernel of sym_gram (sym_gram.cpp states the op): G = q^T q + k^T k per batch entry
// on tensor cores. A CTA accumulates a kD x kD float32 block over a contiguous range of 64-row
// chunks of [q rows; k rows] (split-K, so that a batch of 64 heads still fills the GPU),
// staging chunks through a cp.async ring and multiplying them with transposing ldmatrix
// (warp_gemm_tn_rows: both operands are the chunk, stored reduction-major), or on Hopper with
// wgmma reading the chunk as both transposed operands (WgmmaTiles, D = 128). Each CTA writes
// its block to a scratch slice; a second kernel sums the slices in a fixed order and mirrors the
// lower triangle, so G is deterministic and exactly symmetric.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "../ops/linalg/sym_gram_checks.h"
#include "tc/mma.h"
#include "tc/runtime.h"
#include "tc/wgmma.h"

namespace adaattn {
namespace {

using tc::MmaOp;

constexpr int kThreads = 256;  // 8 warps (two warpgroups)
constexpr int kChunkRows = 64;
constexpr int kCtasPerSm = 2;
// Chunks in the cp.async ring (two CTAs an SM keep 2 (kStages - 1) chunks of 16 KB in flight).
constexpr int kStagesD128 = 3;
constexpr int kStagesD64 = 3;
constexpr int kStagesWgmma = 4;

struct GramRows {
  const void* data;
  int64_t batch_stride, row_stride;
  int64_t rows;
};

// The CTA's 8 warps split a kD x kD block of G, multiplying a staged [kChunkRows][kD] chunk X
// (swz<kD> layout): X^T X's lower triangle into acc, then written to out (kD x kD, row-major).
//
// RectangleTiles: warp w owns rows [kD/2 (w / 4), +kD/2) x columns [kD/4 (w % 4), +kD/4); the
// two warps above the diagonal multiply nothing.
template <typename T, int kD>
struct RectangleTiles {
  static constexpr bool kGmma = false;
  static constexpr int kRows = kD / 2, kCols = kD / 4;
  static constexpr int kMI = kRows / 16, kNT = kCols / 8;
  float acc[kMI][kNT][4];
  int row0, col0;
  bool active;

  __device__ explicit RectangleTiles(int warp)
      : row0((warp >> 2) * kRows), col0((warp & 3) * kCols), active(col0 < row0 + kRows) {
    tc::zero(acc);
  }

  __device__ void multiply(const T* x, int lane) {
    if (active) tc::warp_gemm_tn_rows<kMI, kNT, kChunkRows / 16, kD, kD>(acc, x, row0, x, col0, lane);
  }

  __device__ void store(float* out, int lane) const {
    if (!active) return;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mi = 0; mi < kMI; ++mi) {
#pragma unroll
      for (int ni = 0; ni < kNT; ++ni) {
        const int row = row0 + mi * 16 + g, col = col0 + ni * 8 + 2 * t;
        *reinterpret_cast<float2*>(out + row * kD + col) =
            make_float2(acc[mi][ni][0], acc[mi][ni][1]);
        *reinterpret_cast<float2*>(out + (row + 8) * kD + col) =
            make_float2(acc[mi][ni][2], acc[mi][ni][3]);
      }
    }
  }
};

// SymmetricTiles (kD = 128): the lower triangle in 16 x 16 blocks, each warp loading the
// fragments of four 16-column slices of X once a k-step and using them as both operands: the
// transposing ldmatrix of a slice is its A fragment {f0, f1, f2, f3} and, for the same columns,
// the B fragments of its two 8-column n-tiles (f0, f2) and (f1, f3). Warps 0-5 own the six
// 32 x 32 blocks below the diagonal (slices 2I, 2I + 1 against 2J, 2J + 1, I > J: 4 blocks);
// warps 6 and 7 two diagonal 32 x 32 blocks each (3 lower blocks apiece). 72 products and 32
// ldmatrix a k-step, against 96 and 36 for RectangleTiles.
template <typename T, int kD>
struct SymmetricTiles {
  static constexpr bool kGmma = false;
  static_assert(kD == 128, "SymmetricTiles splits 4 slice pairs over 8 warps");
  static constexpr int kOffDiagonalWarps = 6;
  float acc[6][2][4];
  // First column of the warp's slices: 0 and 1 at rows0 + 16 u, 2 and 3 at cols0 + 16 (u - 2).
  int rows0, cols0;
  bool diagonal;

  __device__ explicit SymmetricTiles(int warp) : diagonal(warp >= kOffDiagonalWarps) {
    if (diagonal) {
      rows0 = 64 * (warp - kOffDiagonalWarps);
      cols0 = rows0 + 32;
    } else {
      int i = 1, j = warp;  // the warp-th pair (i, j), i > j, in row order
      while (j >= i) j -= i++;
      rows0 = 32 * i;
      cols0 = 32 * j;
    }
#pragma unroll
    for (int b = 0; b < 6; ++b)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[b][h][e] = 0.f;
  }

  __device__ __forceinline__ int slice_col(int u) const {
    return u < 2 ? rows0 + 16 * u : cols0 + 16 * (u - 2);
  }

  // Block (row slice u, column slice v) of the warp's k-step products: acc[b] += f_u^T f_v.
  static __device__ __forceinline__ void product(float (&acc)[2][4], const uint32_t (&fu)[4],
                                                 const uint32_t (&fv)[4]) {
    MmaOp<T>::run(acc[0], fu, fv[0], fv[2]);
    MmaOp<T>::run(acc[1], fu, fv[1], fv[3]);
  }

  __device__ void multiply(const T* x, int lane) {
#pragma unroll
    for (int kt = 0; kt < kChunkRows / 16; ++kt) {
      uint32_t f[4][4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        tc::ldmatrix_x4_trans(f[u], x + tc::swz<kD>(kt * 16 + (lane & 7) + ((lane >> 4) << 3),
                                                   slice_col(u) + ((lane >> 3) & 1) * 8));
      }
      if (diagonal) {
        product(acc[0], f[0], f[0]);
        product(acc[1], f[1], f[0]);
        product(acc[2], f[1], f[1]);
        product(acc[3], f[2], f[2]);
        product(acc[4], f[3], f[2]);
        product(acc[5], f[3], f[3]);
      } else {
        product(acc[0], f[0], f[2]);
        product(acc[1], f[0], f[3]);
        product(acc[2], f[1], f[2]);
        product(acc[3], f[1], f[3]);
      }
    }
  }

  __device__ void store(float* out, int lane) const {
    if (diagonal) {
      store_block<0, 0>(out, 0, lane);
      store_block<1, 0>(out, 1, lane);
      store_block<1, 1>(out, 2, lane);
      store_block<2, 2>(out, 3, lane);
      store_block<3, 2>(out, 4, lane);
      store_block<3, 3>(out, 5, lane);
    } else {
      store_block<0, 2>(out, 0, lane);
      store_block<0, 3>(out, 1, lane);
      store_block<1, 2>(out, 2, lane);
      store_block<1, 3>(out, 3, lane);
    }
  }

  // acc[b], the block of row slice U and column slice V (as multiply pairs them).
  template <int U, int V>
  __device__ __forceinline__ void store_block(float* out, int b, int lane) const {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = slice_col(U) + g, col = slice_col(V) + h * 8 + 2 * t;
      *reinterpret_cast<float2*>(out + row * kD + col) = make_float2(acc[b][h][0], acc[b][h][1]);
      *reinterpret_cast<float2*>(out + (row + 8) * kD + col) =
          make_float2(acc[b][h][2], acc[b][h][3]);
    }
  }
};

// WgmmaTiles (kD = 128, sm_90a): warpgroup w computes rows [64 w, 64 w + 64) of X^T X, all
// 128 columns, as four m64n128k16 wgmma a chunk whose operands are both the chunk read
// transposed (X^T's column block w and X; the stage in the GmmaLayout<128> tile layout); only
// its 8-column n-tiles that reach the lower triangle are stored. Issue-light: the mma.sync
// tiles spend a warp's ldmatrix and mma instructions per chunk where wgmma spends four.
template <typename T, int kD>
struct WgmmaTiles {
  static_assert(kD == 128, "two warpgroups of 64 rows");
  static constexpr bool kGmma = true;
  float acc[kD / 8][4];
  int row0;  // the warp's first row of G

  __device__ explicit WgmmaTiles(int warp) : row0(warp * 16) {
#pragma unroll
    for (int nt = 0; nt < kD / 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
  }

  __device__ void multiply(const T* x, int) {
    const int wg = row0 / 64;
    tc::sm90::wgmma_fence();
    const uint64_t a = tc::sm90::gmma_desc_mn<kChunkRows, kD>(x + wg * kChunkRows * 64);
    const uint64_t b = tc::sm90::gmma_desc_mn<kChunkRows, kD>(x);
#pragma unroll
    for (int kt = 0; kt < kChunkRows / 16; ++kt) {
      tc::sm90::wgmma_ss<T, kD / 8, 1, 1>(acc, tc::sm90::desc_at<T>(a, kt * 16 * 64),
                                          tc::sm90::desc_at<T>(b, kt * 16 * 64), 1);
    }
    tc::sm90::wgmma_commit();
    tc::sm90::wgmma_wait<0>(acc);
  }

  __device__ void store(float* out, int lane) const {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int nt = 0; nt < kD / 8; ++nt) {
      if (nt * 8 >= row0 + 16) break;  // this n-tile and those after it lie above the diagonal
      const int row = row0 + g, col = nt * 8 + 2 * t;
      *reinterpret_cast<float2*>(out + row * kD + col) = make_float2(acc[nt][0], acc[nt][1]);
      *reinterpret_cast<float2*>(out + (row + 8) * kD + col) =
          make_float2(acc[nt][2], acc[nt][3]);
    }
  }
};

// Alignment slack of the wgmma stages (their 128-byte swizzle is a function of the address:
// tiles start 1024-byte aligned).
template <typename Tiles>
constexpr int smem_slack() {
  return Tiles::kGmma ? 1024 : 0;
}

template <typename T, int kD, int kStages, typename Tiles>
constexpr int smem_bytes() {
  return kStages * kChunkRows * kD * static_cast<int>(sizeof(T)) + smem_slack<Tiles>();
}

template <typename T, int kD, int kStages, typename Tiles>
__global__ void __launch_bounds__(kThreads, kCtasPerSm)
    sym_gram_partial_kernel(GramRows q, GramRows k, int d, float* partial) {
  extern __shared__ __align__(128) unsigned char smem[];
  auto stage = reinterpret_cast<T(*)[kChunkRows * kD]>(
      smem + ((1024 - (tc::smem_addr(smem) & 1023)) & 1023) * Tiles::kGmma);

  const int tid = threadIdx.x, lane = tid & 31;
  const int64_t n = blockIdx.x;
  const int split = blockIdx.y, splits = gridDim.y;
  const int64_t q_chunks = (q.rows + kChunkRows - 1) / kChunkRows;
  const int64_t chunks = q_chunks + (k.rows + kChunkRows - 1) / kChunkRows;
  const int64_t first = chunks * split / splits, last = chunks * (split + 1) / splits;

  auto load = [&](int64_t c, int slot) {
    const bool from_q = c < q_chunks;
    const GramRows& x = from_q ? q : k;
    const int64_t row0 = (from_q ? c : c - q_chunks) * kChunkRows;
    const T* src = static_cast<const T*>(x.data) + n * x.batch_stride + row0 * x.row_stride;
    const int valid = static_cast<int>(std::min<int64_t>(kChunkRows, x.rows - row0));
    if constexpr (Tiles::kGmma) {
      tc::sm90::load_tile_gmma<kChunkRows, kD, kThreads>(stage[slot], src, x.row_stride, valid,
                                                          tid, d);
    } else {
      tc::load_tile_async<kChunkRows, kD, kThreads>(stage[slot], src, x.row_stride, valid, tid,
                                                    d);
    }
  };

  Tiles tiles(tid >> 5);
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (first + s < last) load(first + s, s);
    tc::cp_async_commit();
  }
  int slot = 0;
  for (int64_t c = first; c < last; ++c) {
    tc::cp_async_wait<kStages - 2>();
    if constexpr (Tiles::kGmma) tc::sm90::fence_proxy_async();  // the copies, before wgmma
    // Chunk c has landed for every thread, and every warp is done with the slot refilled below
    // (it held chunk c - 1).
    __syncthreads();
    const int refill = slot == 0 ? kStages - 1 : slot - 1;
    if (c + kStages - 1 < last) load(c + kStages - 1, refill);
    tc::cp_async_commit();
    tiles.multiply(stage[slot], lane);
    slot = slot == kStages - 1 ? 0 : slot + 1;
  }
  tc::cp_async_wait_all();
  tiles.store(partial + (n * splits + split) * kD * kD, lane);
}

// g[n] from the splits' lower triangles, a 32 x 32 tile pair a CTA (blockIdx.y enumerates the
// tiles (I, J), I >= J, row by row): the sum over the splits, in order, of tile (I, J), written
// there and, transposed, at (J, I); a diagonal tile reads its lower half and mirrors it. Every
// global access is a coalesced 128-byte row.
constexpr int kReduceTile = 32;
constexpr int kReduceThreads = 256;

template <int kD>
__global__ void __launch_bounds__(kReduceThreads)
    sym_gram_reduce_kernel(const float* partial, int splits, int d, float* g) {
  __shared__ float tile[kReduceTile][kReduceTile + 1];
  const int64_t n = blockIdx.x;
  int ti = 0, tj = blockIdx.y;
  while (tj > ti) tj -= ++ti;
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
  const float* src = partial + n * splits * kD * kD;
#pragma unroll
  for (int r = ty; r < kReduceTile; r += kReduceThreads / 32) {
    float sum = 0.f;
    if (ti != tj || r >= tx) {
      const int at = (ti * kReduceTile + r) * kD + tj * kReduceTile + tx;
      for (int s = 0; s < splits; ++s) sum += src[s * kD * kD + at];
    }
    tile[r][tx] = sum;
  }
  __syncthreads();
  float* dst = g + n * d * d;
#pragma unroll
  for (int r = ty; r < kReduceTile; r += kReduceThreads / 32) {
    const int row = ti * kReduceTile + r, col = tj * kReduceTile + tx;
    if (ti == tj) {
      if (row < d && col < d) dst[row * d + col] = r >= tx ? tile[r][tx] : tile[tx][r];
    } else {
      if (row < d && col < d) dst[row * d + col] = tile[r][tx];
      // (J, I): row tj * 32 + r, column ti * 32 + tx holds G[ti * 32 + tx][tj * 32 + r].
      const int t_row = tj * kReduceTile + r, t_col = ti * kReduceTile + tx;
      if (t_row < d && t_col < d) dst[t_row * d + t_col] = tile[tx][r];
    }
  }
}

GramRows rows_of(const at::Tensor& x) {
  return {x.data_ptr(), x.stride(0), x.stride(1), x.size(1)};
}

template <typename T, int kD, int kStages, typename Tiles>
void launch(const at::Tensor& q, const at::Tensor& k, at::Tensor& g) {
  const int64_t n = q.size(0);
  const int d = static_cast<int>(q.size(2));
  const int64_t chunks = (q.size(1) + kChunkRows - 1) / kChunkRows +
                         (k.size(1) + kChunkRows - 1) / kChunkRows;
  // As many splits as keep the grid within one wave of kCtasPerSm CTAs an SM.
  const int64_t slots =
      static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) *
      kCtasPerSm;
  const int splits = static_cast<int>(std::clamp<int64_t>(slots / n, 1, std::max<int64_t>(chunks, 1)));
  at::Tensor partial = at::empty({n, splits, kD, kD}, q.options().dtype(at::kFloat));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  constexpr int kSmem = smem_bytes<T, kD, kStages, Tiles>();
  if constexpr (kSmem > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(sym_gram_partial_kernel<T, kD, kStages, Tiles>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  }
  sym_gram_partial_kernel<T, kD, kStages, Tiles>
      <<<dim3(static_cast<unsigned>(n), splits), kThreads, kSmem, stream>>>(
          rows_of(q), rows_of(k), d, partial.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  constexpr int kTiles = kD / kReduceTile;
  sym_gram_reduce_kernel<kD>
      <<<dim3(static_cast<unsigned>(n), kTiles * (kTiles + 1) / 2), kReduceThreads, 0, stream>>>(
          partial.data_ptr<float>(), splits, d, g.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void launch_for_dim(const at::Tensor& q, const at::Tensor& k, at::Tensor& g) {
  if (q.size(2) <= 64) {
    launch<T, 64, kStagesD64, RectangleTiles<T, 64>>(q, k, g);
    return;
  }
  if constexpr (tc::kBuiltSm90a) {
    if (tc::use_sm90()) {
      launch<T, 128, kStagesWgmma, WgmmaTiles<T, 128>>(q, k, g);
      return;
    }
  }
  launch<T, 128, kStagesD128, SymmetricTiles<T, 128>>(q, k, g);
}

at::Tensor sym_gram_cuda(const at::Tensor& q, const at::Tensor& k) {
  check_sym_gram_args(q, k);
  const c10::cuda::CUDAGuard guard(q.device());
  const int64_t d = q.size(2);
  at::Tensor g = at::empty({q.size(0), d, d}, q.options().dtype(at::kFloat));
  if (g.numel() == 0) return g;
  if (q.scalar_type() == at::kBFloat16) {
    launch_for_dim<__nv_bfloat16>(q, k, g);
  } else {
    launch_for_dim<__half>(q, k, g);
  }
  return g;
}

}  // namespace

TORCH_LIBRARY_IMPL(adaattn, CUDA, m) {
  m.impl("sym_gram", &sym_gram_cuda);
}

}  // namespace adaattn
