// CPU block-sparse attention in fp32/fp64 (spec 3.3): the flash CPU kernel's tiles and online
// softmax, visiting only the key blocks listed for each query block. Work scales with the number
// of listed blocks; extra memory is O(L) (the backward's per-row statistics).
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "../block_sparse_api.h"
#include "../core/block_sparse.h"
#include "../core/mask.h"
#include "tile_ops.h"

namespace adaattn {
namespace {

using namespace cpu;

int64_t row_index(const AttnParams& p, int b, int h, int i) {
  return (static_cast<int64_t>(b) * p.heads_q + h) * p.len_q + i;
}

// A task owns kBlockM query rows of one (b, h); they lie in one query block because block_m is a
// multiple of kBlockM.
struct RowTile {
  int b, h, m0, rows;
};

RowTile row_tile(const AttnParams& p, int64_t task, int row_tiles) {
  const int m0 = static_cast<int>(task % row_tiles) * kBlockM;
  const int h = static_cast<int>((task / row_tiles) % p.heads_q);
  const int b = static_cast<int>(task / row_tiles / p.heads_q);
  return {b, h, m0, std::min(kBlockM, p.len_q - m0)};
}

// Calls visit(n0, cols) for the key tiles of the key blocks listed for the query block of `tile`,
// clipped to `span` (the union of the tile rows' causal ranges), in list order.
template <typename Visit>
void for_each_listed_key_tile(const AttnParams& p, const RowTile& tile, KeyRange span,
                              Visit&& visit) {
  const BlockList list = kv_blocks(p, tile.b, tile.h, tile.m0 / p.block_m);
  for (int e = 0; e < list.count; ++e) {
    const int nb = list.at(e);
    if (nb == kNoBlock) continue;
    const KeyRange keys = block_keys(p, nb);
    const int lo = std::max(keys.lo, span.lo), hi = std::min(keys.hi, span.hi);
    for (int n0 = lo; n0 < hi; n0 += kBlockN) visit(n0, std::min(kBlockN, hi - n0));
  }
}

template <typename T>
void block_sparse_fwd_impl(const AttnParams& p) {
  const int dim = p.head_dim;
  const int group = p.heads_q / p.heads_kv;
  const T scale = static_cast<T>(p.scale);
  const Operand<const T> q{static_cast<const T*>(p.q), p.q_batch_stride, p.q_head_stride,
                           p.q_row_stride};
  const Operand<const T> k{static_cast<const T*>(p.k), p.k_batch_stride, p.k_head_stride,
                           p.k_row_stride};
  const Operand<const T> v{static_cast<const T*>(p.v), p.v_batch_stride, p.v_head_stride,
                           p.v_row_stride};
  const Operand<T> out{static_cast<T*>(p.out), p.o_batch_stride, p.o_head_stride,
                       p.o_row_stride};
  const int row_tiles = (p.len_q + kBlockM - 1) / kBlockM;
  const int64_t tasks = static_cast<int64_t>(p.batch) * p.heads_q * row_tiles;

  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> key_tile(static_cast<size_t>(dim) * kBlockN);
    std::vector<T> acc(static_cast<size_t>(kBlockM) * dim);
    std::vector<T> scores(kBlockN);
    std::vector<T> row_max(kBlockM), row_sum(kBlockM);
    std::vector<KeyRange> ranges(kBlockM);
    for (int64_t task = begin; task < end; ++task) {
      const RowTile t = row_tile(p, task, row_tiles);
      const int g = t.h / group;
      const SeqLens lens = seq_lens(p, t.b);
      for (int r = 0; r < t.rows; ++r) {
        ranges[r] = key_range(p, lens, t.m0 + r);
        row_max[r] = neg_inf<T>();
        row_sum[r] = 0;
      }
      std::fill(acc.begin(), acc.end(), T(0));

      const KeyRange span = tile_key_range(p, lens, t.m0, t.m0 + t.rows);
      for_each_listed_key_tile(p, t, span, [&](int n0, int cols) {
        load_transposed(k, t.b, g, n0, cols, dim, key_tile.data());
        for (int r = 0; r < t.rows; ++r) {
          const int c0 = std::max(ranges[r].lo, n0) - n0;
          const int c1 = std::min(ranges[r].hi, n0 + cols) - n0;
          if (c0 >= c1) continue;
          dot_tile(q.row(t.b, t.h, t.m0 + r), key_tile.data(), dim, c0, c1, scores.data());
          T* acc_row = acc.data() + static_cast<size_t>(r) * dim;
          online_softmax_step(scores.data(), c0, c1, scale, row_max[r], row_sum[r], acc_row, dim,
                              [&](int c, T weight) {
                                axpy(weight, v.row(t.b, g, n0 + c), acc_row, dim);
                              });
        }
      });

      for (int r = 0; r < t.rows; ++r) {
        T* out_row = out.row(t.b, t.h, t.m0 + r);
        const T* acc_row = acc.data() + static_cast<size_t>(r) * dim;
        const bool seen = row_sum[r] > T(0);
        for (int d = 0; d < dim; ++d) out_row[d] = seen ? acc_row[d] / row_sum[r] : T(0);
        p.lse[row_index(p, t.b, t.h, t.m0 + r)] =
            seen ? static_cast<float>(row_max[r] + std::log(row_sum[r])) : neg_inf<float>();
      }
    }
  });
}

// Backward, as flash_bwd_impl: pass 1 walks the forward lists per row tile, accumulating dq and
// recomputing each row's log-sum-exp in T (the float32 lse is too coarse for fp64 gradients)
// with Delta_i = dO_i . O_i. Pass 2 owns dk/dv for a key tile of one kv head and walks, for each
// query head of its group, the query blocks of the transposed list: no output element is
// written twice and the summation order is fixed.
template <typename T>
void block_sparse_bwd_impl(const AttnParams& p) {
  const int dim = p.head_dim;
  const int group = p.heads_q / p.heads_kv;
  const T scale = static_cast<T>(p.scale);
  const Operand<const T> q{static_cast<const T*>(p.q), p.q_batch_stride, p.q_head_stride,
                           p.q_row_stride};
  const Operand<const T> k{static_cast<const T*>(p.k), p.k_batch_stride, p.k_head_stride,
                           p.k_row_stride};
  const Operand<const T> v{static_cast<const T*>(p.v), p.v_batch_stride, p.v_head_stride,
                           p.v_row_stride};
  const Operand<const T> out{static_cast<const T*>(p.out), p.o_batch_stride, p.o_head_stride,
                             p.o_row_stride};
  const Operand<const T> dout{static_cast<const T*>(p.dout), p.do_batch_stride,
                              p.do_head_stride, p.do_row_stride};
  const Operand<T> dq{static_cast<T*>(p.dq), p.dq_batch_stride, p.dq_head_stride,
                      p.dq_row_stride};
  const Operand<T> dk{static_cast<T*>(p.dk), p.dk_batch_stride, p.dk_head_stride,
                      p.dk_row_stride};
  const Operand<T> dv{static_cast<T*>(p.dv), p.dv_batch_stride, p.dv_head_stride,
                      p.dv_row_stride};
  // row_stats[2 * row] = log-sum-exp, row_stats[2 * row + 1] = Delta.
  std::vector<T> row_stats(static_cast<size_t>(p.batch) * p.heads_q * p.len_q * 2);

  const int row_tiles = (p.len_q + kBlockM - 1) / kBlockM;
  const int64_t row_tasks = static_cast<int64_t>(p.batch) * p.heads_q * row_tiles;
  at::parallel_for(0, row_tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> key_tile(static_cast<size_t>(dim) * kBlockN);
    std::vector<T> value_tile(static_cast<size_t>(dim) * kBlockN);
    std::vector<T> dq_acc(static_cast<size_t>(kBlockM) * dim);
    std::vector<T> scores(kBlockN), dprobs(kBlockN);
    std::vector<T> row_max(kBlockM), row_sum(kBlockM), delta(kBlockM);
    std::vector<KeyRange> ranges(kBlockM);
    for (int64_t task = begin; task < end; ++task) {
      const RowTile t = row_tile(p, task, row_tiles);
      const int g = t.h / group;
      const SeqLens lens = seq_lens(p, t.b);
      for (int r = 0; r < t.rows; ++r) {
        ranges[r] = key_range(p, lens, t.m0 + r);
        row_max[r] = neg_inf<T>();
        row_sum[r] = 0;
        delta[r] = dot(dout.row(t.b, t.h, t.m0 + r), out.row(t.b, t.h, t.m0 + r), dim);
      }
      std::fill(dq_acc.begin(), dq_acc.end(), T(0));

      const KeyRange span = tile_key_range(p, lens, t.m0, t.m0 + t.rows);
      for_each_listed_key_tile(p, t, span, [&](int n0, int cols) {
        load_transposed(k, t.b, g, n0, cols, dim, key_tile.data());
        load_transposed(v, t.b, g, n0, cols, dim, value_tile.data());
        for (int r = 0; r < t.rows; ++r) {
          const int c0 = std::max(ranges[r].lo, n0) - n0;
          const int c1 = std::min(ranges[r].hi, n0 + cols) - n0;
          if (c0 >= c1) continue;
          const T* q_row = q.row(t.b, t.h, t.m0 + r);
          dot_tile(q_row, key_tile.data(), dim, c0, c1, scores.data());
          dot_tile(dout.row(t.b, t.h, t.m0 + r), value_tile.data(), dim, c0, c1, dprobs.data());
          T* acc_row = dq_acc.data() + static_cast<size_t>(r) * dim;
          // Unnormalised weights; dq is divided by the row sum once the row is complete.
          online_softmax_step(scores.data(), c0, c1, scale, row_max[r], row_sum[r], acc_row, dim,
                              [&](int c, T weight) {
                                axpy(weight * (dprobs[c] - delta[r]), k.row(t.b, g, n0 + c),
                                     acc_row, dim);
                              });
        }
      });

      for (int r = 0; r < t.rows; ++r) {
        T* dq_row = dq.row(t.b, t.h, t.m0 + r);
        const T* acc_row = dq_acc.data() + static_cast<size_t>(r) * dim;
        const bool seen = row_sum[r] > T(0);
        for (int d = 0; d < dim; ++d) dq_row[d] = seen ? acc_row[d] / row_sum[r] * scale : T(0);
        T* stats = row_stats.data() + 2 * row_index(p, t.b, t.h, t.m0 + r);
        stats[0] = seen ? row_max[r] + std::log(row_sum[r]) : neg_inf<T>();
        stats[1] = delta[r];
      }
    }
  });

  const int key_tiles = (p.len_k + kBlockN - 1) / kBlockN;
  const int64_t key_tasks = static_cast<int64_t>(p.batch) * p.heads_kv * key_tiles;
  at::parallel_for(0, key_tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> key_tile(static_cast<size_t>(dim) * kBlockN);
    std::vector<T> value_tile(static_cast<size_t>(dim) * kBlockN);
    std::vector<T> dk_acc(static_cast<size_t>(kBlockN) * dim);
    std::vector<T> dv_acc(static_cast<size_t>(kBlockN) * dim);
    std::vector<T> scores(kBlockN), dprobs(kBlockN);
    for (int64_t task = begin; task < end; ++task) {
      const int n0 = static_cast<int>(task % key_tiles) * kBlockN;
      const int g = static_cast<int>((task / key_tiles) % p.heads_kv);
      const int b = static_cast<int>(task / key_tiles / p.heads_kv);
      const int cols = std::min(kBlockN, p.len_k - n0);
      const SeqLens lens = seq_lens(p, b);
      std::fill(dk_acc.begin(), dk_acc.end(), T(0));
      std::fill(dv_acc.begin(), dv_acc.end(), T(0));
      load_transposed(k, b, g, n0, cols, dim, key_tile.data());
      load_transposed(v, b, g, n0, cols, dim, value_tile.data());
      // Rows whose causal range meets these keys (all rows without causal).
      const RowSpan meeting = rows_meeting_keys(p, lens, n0, n0 + cols);

      for (int h = g * group; h < (g + 1) * group; ++h) {
        const BlockList list = q_blocks(p, b, h, n0 / p.block_n);
        for (int e = 0; e < list.count; ++e) {
          const int mb = list.at(e);
          if (mb == kNoBlock) continue;
          const RowSpan rows = block_rows(p, mb);
          const int first = std::max(rows.first, meeting.first);
          const int last = std::min(rows.last, meeting.last);
          for (int i = first; i < last; ++i) {
            const KeyRange range = key_range(p, lens, i);
            const int c0 = std::max(range.lo, n0) - n0;
            const int c1 = std::min(range.hi, n0 + cols) - n0;
            if (c0 >= c1) continue;
            const T* stats = row_stats.data() + 2 * row_index(p, b, h, i);
            const T* q_row = q.row(b, h, i);
            const T* dout_row = dout.row(b, h, i);
            dot_tile(q_row, key_tile.data(), dim, c0, c1, scores.data());
            dot_tile(dout_row, value_tile.data(), dim, c0, c1, dprobs.data());
            for (int c = c0; c < c1; ++c) {
              const T prob = std::exp(scores[c] * scale - stats[0]);
              const T dscore = prob * (dprobs[c] - stats[1]);
              axpy(dscore, q_row, dk_acc.data() + static_cast<size_t>(c) * dim, dim);
              axpy(prob, dout_row, dv_acc.data() + static_cast<size_t>(c) * dim, dim);
            }
          }
        }
      }

      for (int c = 0; c < cols; ++c) {
        T* dk_row = dk.row(b, g, n0 + c);
        T* dv_row = dv.row(b, g, n0 + c);
        const T* dk_src = dk_acc.data() + static_cast<size_t>(c) * dim;
        const T* dv_src = dv_acc.data() + static_cast<size_t>(c) * dim;
        for (int d = 0; d < dim; ++d) {
          dk_row[d] = dk_src[d] * scale;
          dv_row[d] = dv_src[d];
        }
      }
    }
  });
}

void check_cpu_block_size(const AttnParams& p) {
  TORCH_CHECK(p.block_m % kBlockM == 0 && p.block_n % kBlockN == 0,
              "adaattn: the CPU block-sparse kernel needs block sizes that are multiples of ",
              kBlockM, "x", kBlockN, ", got ", p.block_m, "x", p.block_n);
}

}  // namespace

void block_sparse_fwd_cpu(const AttnParams& p, c10::ScalarType dtype) {
  check_cpu_block_size(p);
  switch (dtype) {
    case c10::kFloat:
      block_sparse_fwd_impl<float>(p);
      break;
    case c10::kDouble:
      block_sparse_fwd_impl<double>(p);
      break;
    default:
      TORCH_CHECK(false, "adaattn: the CPU block-sparse kernel takes float32 or float64, got ",
                  dtype);
  }
}

void block_sparse_bwd_cpu(const AttnParams& p, c10::ScalarType dtype) {
  check_cpu_block_size(p);
  switch (dtype) {
    case c10::kFloat:
      block_sparse_bwd_impl<float>(p);
      break;
    case c10::kDouble:
      block_sparse_bwd_impl<double>(p);
      break;
    default:
      TORCH_CHECK(false, "adaattn: the CPU block-sparse kernel takes float32 or float64, got ",
                  dtype);
  }
}

}  // namespace adaattn
