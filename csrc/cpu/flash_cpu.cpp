// CPU flash attention in fp32/fp64: tiles of query rows against tiles of keys, online softmax,
// O(L) extra memory. Keys are copied transposed into a small tile so every inner loop runs with
// unit stride over keys or over the head dim (vectorisable, fixed summation order). Key tiles
// come from the mask policy: the row tile's key range, cut to the listed blocks when the mask is
// block-sparse (for_each_key_span / for_each_row_span, core/block_sparse.h).
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "../core/block_sparse.h"
#include "../core/mask.h"
#include "../flash_api.h"
#include "tile_ops.h"

namespace adaattn {
namespace {

using namespace cpu;

template <typename T>
void flash_fwd_impl(const AttnParams& p) {
  const int dim = p.head_dim;
  const int dim_v = p.head_dim_v;
  const int group = p.heads_q / p.heads_kv;
  const T scale = static_cast<T>(p.scale);
  const Operand<const T> q_all{static_cast<const T*>(p.q), p.q_batch_stride, p.q_head_stride,
                               p.q_row_stride};
  const Operand<const T> k_all{static_cast<const T*>(p.k), p.k_batch_stride, p.k_head_stride,
                               p.k_row_stride};
  const Operand<const T> v_all{static_cast<const T*>(p.v), p.v_batch_stride, p.v_head_stride,
                               p.v_row_stride};
  const Operand<T> out_all{static_cast<T*>(p.out), p.o_batch_stride, p.o_head_stride,
                           p.o_row_stride};
  const int row_blocks = (max_entry_rows<false>(p) + kBlockM - 1) / kBlockM;
  const int64_t tasks = static_cast<int64_t>(p.batch) * p.heads_q * row_blocks;

  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> key_tile(static_cast<size_t>(dim) * kBlockN);
    std::vector<T> acc(static_cast<size_t>(kBlockM) * dim_v);
    std::vector<T> scores(kBlockN);
    std::vector<T> row_max(kBlockM), row_sum(kBlockM);
    std::vector<KeyRange> ranges(kBlockM);
    for (int64_t task = begin; task < end; ++task) {
      const int m0 = static_cast<int>(task % row_blocks) * kBlockM;
      const int h = static_cast<int>((task / row_blocks) % p.heads_q);
      const int b = static_cast<int>(task / row_blocks / p.heads_q);
      const int g = h / group;
      const SeqLens lens = seq_lens(p, b);
      const int rows = std::min(kBlockM, lens.rows_q - m0);
      if (rows <= 0) continue;
      const auto q = q_all.shifted(lens.q_start);
      const auto k = k_all.shifted(lens.k_start);
      const auto v = v_all.shifted(lens.k_start);
      const auto out = out_all.shifted(lens.q_start);
      for (int r = 0; r < rows; ++r) {
        ranges[r] = key_range(p, lens, m0 + r);
        row_max[r] = neg_inf<T>();
        row_sum[r] = 0;
      }
      std::fill(acc.begin(), acc.end(), T(0));

      const KeyRange span = tile_key_range(p, lens, m0, m0 + rows);
      for_each_key_span(p, b, h, m0, span, [&](int lo, int hi) {
        for (int n0 = lo; n0 < hi; n0 += kBlockN) {
          const int cols = std::min(kBlockN, hi - n0);
          load_transposed(k, b, g, n0, cols, dim, key_tile.data());
          for (int r = 0; r < rows; ++r) {
            const int c0 = std::max(ranges[r].lo, n0) - n0;
            const int c1 = std::min(ranges[r].hi, n0 + cols) - n0;
            if (c0 >= c1) continue;
            dot_tile(q.row(b, h, m0 + r), key_tile.data(), dim, c0, c1, scores.data());
            T* acc_row = acc.data() + static_cast<size_t>(r) * dim_v;
            online_softmax_step(scores.data(), c0, c1, scale, row_max[r], row_sum[r], acc_row,
                                dim_v, [&](int c, T weight) {
                                  axpy(weight, v.row(b, g, n0 + c), acc_row, dim_v);
                                });
          }
        }
      });

      for (int r = 0; r < rows; ++r) {
        T* out_row = out.row(b, h, m0 + r);
        const T* acc_row = acc.data() + static_cast<size_t>(r) * dim_v;
        const bool seen = row_sum[r] > T(0);
        for (int d = 0; d < dim_v; ++d) out_row[d] = seen ? acc_row[d] / row_sum[r] : T(0);
        p.lse[row_stat_offset(p, lens, b, h) + m0 + r] =
            seen ? static_cast<float>(row_max[r] + std::log(row_sum[r])) : neg_inf<float>();
      }
    }
  });
}

// Backward. The float32 lse and delta of the op are too coarse for fp64 gradients, so pass 1
// recomputes each row's log-sum-exp in T (in the same sweep that accumulates dq, rescaled like
// the forward accumulator) and keeps it with Delta_i = dO_i . O_i in an lse-shaped [*][2] scratch.
// Pass 2 owns dk/dv for a tile of keys of one kv head and sums over its group's query heads, so
// no output element is written twice and the summation order is fixed.
template <typename T>
void flash_bwd_impl(const AttnParams& p) {
  const int dim = p.head_dim;
  const int dim_v = p.head_dim_v;
  const int group = p.heads_q / p.heads_kv;
  const T scale = static_cast<T>(p.scale);
  const Operand<const T> q_all{static_cast<const T*>(p.q), p.q_batch_stride, p.q_head_stride,
                               p.q_row_stride};
  const Operand<const T> k_all{static_cast<const T*>(p.k), p.k_batch_stride, p.k_head_stride,
                               p.k_row_stride};
  const Operand<const T> v_all{static_cast<const T*>(p.v), p.v_batch_stride, p.v_head_stride,
                               p.v_row_stride};
  const Operand<const T> out_all{static_cast<const T*>(p.out), p.o_batch_stride,
                                 p.o_head_stride, p.o_row_stride};
  const Operand<const T> dout_all{static_cast<const T*>(p.dout), p.do_batch_stride,
                                  p.do_head_stride, p.do_row_stride};
  const Operand<T> dq_all{static_cast<T*>(p.dq), p.dq_batch_stride, p.dq_head_stride,
                          p.dq_row_stride};
  const Operand<T> dk_all{static_cast<T*>(p.dk), p.dk_batch_stride, p.dk_head_stride,
                          p.dk_row_stride};
  const Operand<T> dv_all{static_cast<T*>(p.dv), p.dv_batch_stride, p.dv_head_stride,
                          p.dv_row_stride};
  // row_stats[2 * row] = log-sum-exp, row_stats[2 * row + 1] = Delta, rows in lse order.
  std::vector<T> row_stats(static_cast<size_t>(row_items<false>(p)) * 2);

  const int row_blocks = (max_entry_rows<false>(p) + kBlockM - 1) / kBlockM;
  const int64_t row_tasks = static_cast<int64_t>(p.batch) * p.heads_q * row_blocks;
  at::parallel_for(0, row_tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> key_tile(static_cast<size_t>(dim) * kBlockN);
    std::vector<T> value_tile(static_cast<size_t>(dim_v) * kBlockN);
    std::vector<T> dq_acc(static_cast<size_t>(kBlockM) * dim);
    std::vector<T> scores(kBlockN), dprobs(kBlockN);
    std::vector<T> row_max(kBlockM), row_sum(kBlockM), delta(kBlockM);
    std::vector<KeyRange> ranges(kBlockM);
    for (int64_t task = begin; task < end; ++task) {
      const int m0 = static_cast<int>(task % row_blocks) * kBlockM;
      const int h = static_cast<int>((task / row_blocks) % p.heads_q);
      const int b = static_cast<int>(task / row_blocks / p.heads_q);
      const int g = h / group;
      const SeqLens lens = seq_lens(p, b);
      const int rows = std::min(kBlockM, lens.rows_q - m0);
      if (rows <= 0) continue;
      const auto q = q_all.shifted(lens.q_start);
      const auto k = k_all.shifted(lens.k_start);
      const auto v = v_all.shifted(lens.k_start);
      const auto out = out_all.shifted(lens.q_start);
      const auto dout = dout_all.shifted(lens.q_start);
      const auto dq = dq_all.shifted(lens.q_start);
      for (int r = 0; r < rows; ++r) {
        ranges[r] = key_range(p, lens, m0 + r);
        row_max[r] = neg_inf<T>();
        row_sum[r] = 0;
        delta[r] = dot(dout.row(b, h, m0 + r), out.row(b, h, m0 + r), dim_v);
      }
      std::fill(dq_acc.begin(), dq_acc.end(), T(0));

      const KeyRange span = tile_key_range(p, lens, m0, m0 + rows);
      for_each_key_span(p, b, h, m0, span, [&](int lo, int hi) {
        for (int n0 = lo; n0 < hi; n0 += kBlockN) {
          const int cols = std::min(kBlockN, hi - n0);
          load_transposed(k, b, g, n0, cols, dim, key_tile.data());
          load_transposed(v, b, g, n0, cols, dim_v, value_tile.data());
          for (int r = 0; r < rows; ++r) {
            const int c0 = std::max(ranges[r].lo, n0) - n0;
            const int c1 = std::min(ranges[r].hi, n0 + cols) - n0;
            if (c0 >= c1) continue;
            dot_tile(q.row(b, h, m0 + r), key_tile.data(), dim, c0, c1, scores.data());
            dot_tile(dout.row(b, h, m0 + r), value_tile.data(), dim_v, c0, c1, dprobs.data());
            T* acc_row = dq_acc.data() + static_cast<size_t>(r) * dim;
            // Unnormalised weights; dq is divided by the row sum once the row is complete.
            online_softmax_step(scores.data(), c0, c1, scale, row_max[r], row_sum[r], acc_row, dim,
                                [&](int c, T weight) {
                                  axpy(weight * (dprobs[c] - delta[r]), k.row(b, g, n0 + c),
                                       acc_row, dim);
                                });
          }
        }
      });

      for (int r = 0; r < rows; ++r) {
        T* dq_row = dq.row(b, h, m0 + r);
        const T* acc_row = dq_acc.data() + static_cast<size_t>(r) * dim;
        const bool seen = row_sum[r] > T(0);
        for (int d = 0; d < dim; ++d) dq_row[d] = seen ? acc_row[d] / row_sum[r] * scale : T(0);
        T* stats = row_stats.data() + 2 * (row_stat_offset(p, lens, b, h) + m0 + r);
        stats[0] = seen ? row_max[r] + std::log(row_sum[r]) : neg_inf<T>();
        stats[1] = delta[r];
      }
    }
  });

  const int key_blocks = (max_entry_rows<true>(p) + kBlockN - 1) / kBlockN;
  const int64_t key_tasks = static_cast<int64_t>(p.batch) * p.heads_kv * key_blocks;
  at::parallel_for(0, key_tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> key_tile(static_cast<size_t>(dim) * kBlockN);
    std::vector<T> value_tile(static_cast<size_t>(dim_v) * kBlockN);
    std::vector<T> dk_acc(static_cast<size_t>(kBlockN) * dim);
    std::vector<T> dv_acc(static_cast<size_t>(kBlockN) * dim_v);
    std::vector<T> scores(kBlockN), dprobs(kBlockN);
    for (int64_t task = begin; task < end; ++task) {
      const int n0 = static_cast<int>(task % key_blocks) * kBlockN;
      const int g = static_cast<int>((task / key_blocks) % p.heads_kv);
      const int b = static_cast<int>(task / key_blocks / p.heads_kv);
      const SeqLens lens = seq_lens(p, b);
      const int cols = std::min(kBlockN, lens.rows_k - n0);
      if (cols <= 0) continue;
      const auto q = q_all.shifted(lens.q_start);
      const auto k = k_all.shifted(lens.k_start);
      const auto v = v_all.shifted(lens.k_start);
      const auto dout = dout_all.shifted(lens.q_start);
      const auto dk = dk_all.shifted(lens.k_start);
      const auto dv = dv_all.shifted(lens.k_start);
      // Padding keys (at or past lens.k) are seen by no row: their gradients stay zero.
      const int live_cols = std::max(0, std::min(cols, lens.k - n0));
      std::fill(dk_acc.begin(), dk_acc.end(), T(0));
      std::fill(dv_acc.begin(), dv_acc.end(), T(0));

      if (live_cols > 0) {
        load_transposed(k, b, g, n0, live_cols, dim, key_tile.data());
        load_transposed(v, b, g, n0, live_cols, dim_v, value_tile.data());
        const RowSpan span = rows_meeting_keys(p, lens, n0, n0 + live_cols);
        for (int h = g * group; h < (g + 1) * group; ++h) {
          for_each_row_span(p, b, h, n0, span, [&](int first, int last) {
            for (int i = first; i < last; ++i) {
              const KeyRange range = key_range(p, lens, i);
              const int c0 = std::max(range.lo, n0) - n0;
              const int c1 = std::min(range.hi, n0 + live_cols) - n0;
              if (c0 >= c1) continue;
              const T* stats = row_stats.data() + 2 * (row_stat_offset(p, lens, b, h) + i);
              const T* q_row = q.row(b, h, i);
              const T* dout_row = dout.row(b, h, i);
              dot_tile(q_row, key_tile.data(), dim, c0, c1, scores.data());
              dot_tile(dout_row, value_tile.data(), dim_v, c0, c1, dprobs.data());
              for (int c = c0; c < c1; ++c) {
                const T prob = std::exp(scores[c] * scale - stats[0]);
                const T dscore = prob * (dprobs[c] - stats[1]);
                axpy(dscore, q_row, dk_acc.data() + static_cast<size_t>(c) * dim, dim);
                axpy(prob, dout_row, dv_acc.data() + static_cast<size_t>(c) * dim_v, dim_v);
              }
            }
          });
        }
      }

      for (int c = 0; c < cols; ++c) {
        T* dk_row = dk.row(b, g, n0 + c);
        T* dv_row = dv.row(b, g, n0 + c);
        const T* dk_src = dk_acc.data() + static_cast<size_t>(c) * dim;
        const T* dv_src = dv_acc.data() + static_cast<size_t>(c) * dim_v;
        for (int d = 0; d < dim; ++d) dk_row[d] = dk_src[d] * scale;
        for (int d = 0; d < dim_v; ++d) dv_row[d] = dv_src[d];
      }
    }
  });
}

}  // namespace

void flash_fwd_cpu(const AttnParams& p, c10::ScalarType dtype) {
  switch (dtype) {
    case c10::kFloat:
      flash_fwd_impl<float>(p);
      break;
    case c10::kDouble:
      flash_fwd_impl<double>(p);
      break;
    default:
      TORCH_CHECK(false, "adaattn: the CPU flash kernel takes float32 or float64, got ", dtype);
  }
}

void flash_bwd_cpu(const AttnParams& p, c10::ScalarType dtype) {
  switch (dtype) {
    case c10::kFloat:
      flash_bwd_impl<float>(p);
      break;
    case c10::kDouble:
      flash_bwd_impl<double>(p);
      break;
    default:
      TORCH_CHECK(false, "adaattn: the CPU flash kernel takes float32 or float64, got ", dtype);
  }
}

}  // namespace adaattn
