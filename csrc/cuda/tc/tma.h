// Hopper tensor memory accelerator (TMA) loads of the attention operands: a 4-d tensor map of a
// [B, H, L, D] operand (any strides that are multiples of 16 bytes), read in boxes of 64 columns
// x ROWS rows with the 128-byte swizzle, which lands each box exactly as one column block of a
// GmmaLayout tile (wgmma.h). One thread issues a tile's boxes; the copy engine zero-fills rows
// and columns past the tensor and completes the stage's mbarrier by byte count, so the
// producer neither waits for its copies nor fences them (TMA writes are the async proxy's, as
// wgmma's reads).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "wgmma.h"

namespace adaattn {
namespace tc {

// Encodes `map` for a 16-bit operand whose element (b, h, r, c) lives at base + b * batch_stride +
// h * head_stride + r * row_stride + c (strides in elements), cols x rows x heads x batch, read in
// boxes of 64 x box_rows. False where TMA cannot describe it (alignment, strides, the driver
// lacking the entry point): the caller keeps its cp.async loads. Defined in runtime.cu.
bool encode_operand_map(CUtensorMap* map, const void* base, bool bf16, int64_t cols, int64_t rows,
                        int64_t heads, int64_t batch, int64_t row_stride, int64_t head_stride,
                        int64_t batch_stride, int box_rows);

namespace sm90 {

// Arrives on `bar` (one of its expected arrivals) and adds `bytes` to the transaction count its
// phase waits for.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
#ifdef ADAATTN_SM90A_DEVICE
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
#endif
}

// The [ROWS][D] tile at rows row .. row + ROWS - 1 of head h of batch entry b into a GmmaLayout<D>
// tile at dst (D % 64 == 0): D / 64 boxes, completing on `bar` (ROWS * D * 2 bytes in all).
template <int ROWS, int D, typename T>
__device__ __forceinline__ void load_tile_tma(T* dst, const CUtensorMap* map, int row, int h,
                                              int b, uint64_t* bar) {
  static_assert(D % 64 == 0, "TMA tiles are whole 64-column blocks");
#ifdef ADAATTN_SM90A_DEVICE
#pragma unroll
  for (int block = 0; block < D / 64; ++block) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(smem_addr(dst + block * ROWS * 64)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(block * 64), "r"(row), "r"(h), "r"(b),
        "r"(smem_addr(bar))
        : "memory");
  }
#endif
}

}  // namespace sm90
}  // namespace tc
}  // namespace adaattn
