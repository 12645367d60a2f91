// The producer warpgroup of the Hopper backward's query-tile kernels (the dQ pass and the row
// pass of a non-normalised transform), which stream every key tile past one tile of query rows.
#pragma once

#include <cstdint>

#include "../../core/params.h"
#include "tiles.h"
#include "wgmma.h"

namespace adaattn {
namespace tc {

// Q and dO of the CTA's kBlockM rows from m0 join the first load group; then K_j and V_j of key
// tile j (BN keys; k and v point at the sequence's first key) go to stage j % 2 of a two-stage
// mbarrier ring (`full`: landed; `empty`: every consumer warp is done with it). Padding rows and
// keys, and columns past the caller's head dims, load as zeros. Called by the 128 producer
// threads (ptid 0..127) with at least one key tile.
template <int kBlockM, int BN, int DK, int DV, typename T, typename Tiles>
__device__ __forceinline__ void produce_query_tile_ring(const AttnParams& p, const SeqLens& lens,
                                                        int b, int h, int m0, const T* k,
                                                        const T* v, const Tiles& tiles, T* sQ,
                                                        T* sdO, T* sK, T* sV, uint64_t (&full)[2],
                                                        uint64_t (&empty)[2], int ptid) {
  sm90::load_tile_gmma<kBlockM, DK, 128>(sQ, q_rows<T>(p, lens, b, h, m0), p.q_row_stride,
                                         lens.q - m0, ptid, p.head_dim);
  sm90::load_tile_gmma<kBlockM, DV, 128>(sdO, dout_rows<T>(p, lens, b, h, m0), p.do_row_stride,
                                         lens.q - m0, ptid, p.head_dim_v);
  for (int j = 0; j < tiles.count; ++j) {
    if (j >= 2) sm90::mbar_wait(&empty[j % 2], ((j - 2) >> 1) & 1);
    const int n0 = tiles.at(j) * BN;
    sm90::load_tile_gmma<BN, DK, 128>(sK + (j % 2) * BN * DK,
                                      k + static_cast<int64_t>(n0) * p.k_row_stride,
                                      p.k_row_stride, lens.k - n0, ptid, p.head_dim);
    sm90::load_tile_gmma<BN, DV, 128>(sV + (j % 2) * BN * DV,
                                      v + static_cast<int64_t>(n0) * p.v_row_stride,
                                      p.v_row_stride, lens.k - n0, ptid, p.head_dim_v);
    sm90::publish_stage(&full[j % 2]);
  }
}

}  // namespace tc
}  // namespace adaattn
