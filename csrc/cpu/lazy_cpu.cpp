// CPU lazy attention (spec 3.2) in fp32/fp64, tiled like flash_cpu.cpp: a task owns a tile of
// query rows (forward, backward dq pass) or a tile of keys (backward dk/dv pass), keys are copied
// transposed into a small tile so the inner loops run with unit stride, and extra memory is O(L).
//
// Forward: pass 1 computes each row's log-sum-exp online; pass 2 recomputes the probabilities,
// forms a = max(0, p + tau/(i+1)) and accumulates a V, skipping the V work of (row tile, key tile)
// pairs whose weights are all zero (and of single zero weights), which changes no result.
// Backward: the mask M = [p + tau/(i+1) > 0] depends on normalised probabilities, so the dq pass
// cannot use flash's online rescaling. It sweeps each row once, accumulating G_i = sum_j M dA,
// Delta_i = sum_j M p dA, X_i = sum_j M p dA k_j and Y_i = sum_j p k_j, and writes
// dq_i = scale (X_i - Delta_i Y_i) = scale sum_j p (M dA - Delta_i) k_j. Delta_i is summed
// directly rather than as g_i.o_i - tau/(i+1) G_i: equal in exact arithmetic, but the saved output
// is rounded to the input dtype (bf16/fp16), which would put that rounding into every gradient.
// The dk/dv pass then owns a tile of keys of one kv head and loops over its group's query heads
// (fixed summation order).
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "../core/lazy.h"
#include "../core/mask.h"
#include "../lazy_api.h"
#include "tile_ops.h"

namespace adaattn {
namespace {

using namespace cpu;

// A dk/dv task that also accumulates dbias keeps one partial table of min(W, Lk) entries per
// query head; it covers enough key tiles that the tables hold at most about this many entries
// per key, so their memory stays O(L) even when W >= L.
constexpr int kBiasEntriesPerKey = 8;

int ceil_div(int a, int b) { return (a + b - 1) / b; }

// max(0, w) that keeps a NaN (as torch.clamp does) instead of hiding it as a zero weight.
template <typename T>
T clip_weight(T w) {
  return w < T(0) ? T(0) : w;
}

// The problem as every pass sees it: inputs, positions, shifts and biased scores. entry(b) gives
// the view of batch entry b (its operands start at the entry's first row; positions are its own).
template <typename T>
struct LazyProblem {
  const AttnParams& p;
  int dim, group, window;
  T scale;
  Operand<const T> q, k, v;
  SeqLens lens{};

  explicit LazyProblem(const AttnParams& params)
      : p(params),
        dim(params.head_dim),
        group(params.heads_q / params.heads_kv),
        window(params.bias_window),
        scale(static_cast<T>(params.scale)),
        q{static_cast<const T*>(params.q), params.q_batch_stride, params.q_head_stride,
          params.q_row_stride},
        k{static_cast<const T*>(params.k), params.k_batch_stride, params.k_head_stride,
          params.k_row_stride},
        v{static_cast<const T*>(params.v), params.v_batch_stride, params.v_head_stride,
          params.v_row_stride} {}

  LazyProblem entry(int b) const {
    LazyProblem e = *this;
    e.lens = seq_lens(p, b);
    e.q = q.shifted(e.lens.q_start);
    e.k = k.shifted(e.lens.k_start);
    e.v = v.shifted(e.lens.k_start);
    return e;
  }

  int64_t row_index(int b, int h, int r) const { return row_stat_offset(p, lens, b, h) + r; }

  // Position i of query row r within its sequence (bottom-right aligned).
  int position(int r) const { return lazy_position(lens, r); }

  // tau_h / (i + 1), the shift added to the row's probabilities.
  T shift(int h, int r) const {
    return static_cast<T>(p.tau[h]) / static_cast<T>(position(r) + 1);
  }

  // scores[c] = scale q_r.k_(n0+c) + (i - j < W ? bias[h, i - j] : 0) for c in [c0, c1), where
  // key_tile holds keys [n0, n0 + kBlockN) transposed and every column is causal (i - j >= 0).
  void scores(int b, int h, int r, int n0, int c0, int c1, const T* key_tile,
              T* __restrict__ out) const {
    dot_tile(q.row(b, h, r), key_tile, dim, c0, c1, out);
    for (int c = c0; c < c1; ++c) out[c] *= scale;
    const float* __restrict__ bias = p.bias + static_cast<int64_t>(h) * window;
    const int dist0 = position(r) - n0;  // i - j of column 0
    for (int c = std::max(c0, dist0 - window + 1); c < c1; ++c) {
      out[c] += static_cast<T>(bias[dist0 - c]);
    }
  }

  // Log-sum-exp in T of rows [m0, m0 + rows) of head (b, h) (-inf for a row that sees no key),
  // online over key tiles. The forward and the fp64 backward share it, so both see bit-identical
  // probabilities and therefore the same clipping mask.
  void block_lse(int b, int h, int m0, int rows, SeqLens lens, const KeyRange* ranges,
                 T* key_tile, T* scores_buf, T* lse) const {
    std::array<T, kBlockM> row_max, row_sum;
    row_max.fill(neg_inf<T>());
    row_sum.fill(T(0));
    const KeyRange span = tile_key_range(p, lens, m0, m0 + rows);
    for (int n0 = span.lo; n0 < span.hi; n0 += kBlockN) {
      const int cols = std::min(kBlockN, span.hi - n0);
      load_transposed(k, b, h / group, n0, cols, dim, key_tile);
      for (int r = 0; r < rows; ++r) {
        const int c0 = std::max(ranges[r].lo, n0) - n0;
        const int c1 = std::min(ranges[r].hi, n0 + cols) - n0;
        if (c0 >= c1) continue;
        scores(b, h, m0 + r, n0, c0, c1, key_tile, scores_buf);
        T tile_max = neg_inf<T>();
        for (int c = c0; c < c1; ++c) tile_max = std::max(tile_max, scores_buf[c]);
        const T new_max = std::max(row_max[r], tile_max);
        T sum = row_sum[r] * std::exp(row_max[r] - new_max);  // exp(-inf) = 0 on the first tile
        for (int c = c0; c < c1; ++c) sum += std::exp(scores_buf[c] - new_max);
        row_sum[r] = sum;
        row_max[r] = new_max;
      }
    }
    for (int r = 0; r < rows; ++r) {
      lse[r] = row_sum[r] > T(0) ? row_max[r] + std::log(row_sum[r]) : neg_inf<T>();
    }
  }
};

template <typename T>
void lazy_fwd_impl(const AttnParams& p) {
  const LazyProblem<T> problem(p);
  const int dim = problem.dim;
  const Operand<T> out_all{static_cast<T*>(p.out), p.o_batch_stride, p.o_head_stride,
                           p.o_row_stride};
  const int row_blocks = ceil_div(max_entry_rows<false>(p), kBlockM);
  const int64_t tasks = static_cast<int64_t>(p.batch) * p.heads_q * row_blocks;
  // Per-task counters {zero weights, attended weights, skipped tiles, visited tiles}, summed in
  // task order afterwards.
  std::vector<std::array<int64_t, 4>> counts(p.stats != nullptr ? tasks : 0);

  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> key_tile(static_cast<size_t>(dim) * kBlockN);
    std::vector<T> acc(static_cast<size_t>(kBlockM) * dim);
    std::vector<T> weights(static_cast<size_t>(kBlockM) * kBlockN);
    std::vector<T> scores(kBlockN);
    std::array<T, kBlockM> lse, shift;
    std::array<KeyRange, kBlockM> ranges;
    for (int64_t task = begin; task < end; ++task) {
      const int m0 = static_cast<int>(task % row_blocks) * kBlockM;
      const int h = static_cast<int>((task / row_blocks) % p.heads_q);
      const int b = static_cast<int>(task / row_blocks / p.heads_q);
      const LazyProblem<T> x = problem.entry(b);
      const SeqLens& lens = x.lens;
      const int g = h / x.group;
      const int rows = std::min(kBlockM, lens.rows_q - m0);
      if (rows <= 0) continue;
      const auto out = out_all.shifted(lens.q_start);
      for (int r = 0; r < rows; ++r) {
        ranges[r] = key_range(p, lens, m0 + r);
        shift[r] = x.shift(h, m0 + r);
      }
      x.block_lse(b, h, m0, rows, lens, ranges.data(), key_tile.data(), scores.data(),
                  lse.data());
      std::fill(acc.begin(), acc.end(), T(0));

      int64_t zero_weights = 0, attended = 0, skipped = 0, visited = 0;
      const KeyRange span = tile_key_range(p, lens, m0, m0 + rows);
      for (int n0 = span.lo; n0 < span.hi; n0 += kBlockN) {
        const int cols = std::min(kBlockN, span.hi - n0);
        load_transposed(x.k, b, g, n0, cols, dim, key_tile.data());
        bool any_weight = false;
        for (int r = 0; r < rows; ++r) {
          const int c0 = std::max(ranges[r].lo, n0) - n0;
          const int c1 = std::min(ranges[r].hi, n0 + cols) - n0;
          if (c0 >= c1) continue;
          x.scores(b, h, m0 + r, n0, c0, c1, key_tile.data(), scores.data());
          T* __restrict__ w = weights.data() + static_cast<size_t>(r) * kBlockN;
          for (int c = c0; c < c1; ++c) {
            w[c] = clip_weight(std::exp(scores[c] - lse[r]) + shift[r]);
            const bool zero = w[c] == T(0);
            zero_weights += zero;
            any_weight |= !zero;
          }
          attended += c1 - c0;
        }
        ++visited;
        if (!any_weight) {
          ++skipped;
          continue;
        }
        for (int r = 0; r < rows; ++r) {
          const int c0 = std::max(ranges[r].lo, n0) - n0;
          const int c1 = std::min(ranges[r].hi, n0 + cols) - n0;
          const T* w = weights.data() + static_cast<size_t>(r) * kBlockN;
          T* acc_row = acc.data() + static_cast<size_t>(r) * dim;
          for (int c = c0; c < c1; ++c) {
            if (w[c] != T(0)) axpy(w[c], x.v.row(b, g, n0 + c), acc_row, dim);
          }
        }
      }

      for (int r = 0; r < rows; ++r) {
        std::copy_n(acc.data() + static_cast<size_t>(r) * dim, dim, out.row(b, h, m0 + r));
        p.lse[x.row_index(b, h, m0 + r)] = static_cast<float>(lse[r]);
      }
      if (p.stats != nullptr) counts[task] = {zero_weights, attended, skipped, visited};
    }
  });

  if (p.stats != nullptr) {
    std::array<int64_t, 4> total{};
    for (const auto& c : counts) {
      for (int i = 0; i < 4; ++i) total[i] += c[i];
    }
    std::copy(total.begin(), total.end(), p.stats);
  }
}

template <typename T>
void lazy_bwd_impl(const AttnParams& p) {
  const LazyProblem<T> problem(p);
  const int dim = problem.dim;
  const int group = problem.group;
  const T scale = problem.scale;
  const Operand<const T> dout_all{static_cast<const T*>(p.dout), p.do_batch_stride,
                                  p.do_head_stride, p.do_row_stride};
  const Operand<T> dq_all{static_cast<T*>(p.dq), p.dq_batch_stride, p.dq_head_stride,
                          p.dq_row_stride};
  const Operand<T> dk_all{static_cast<T*>(p.dk), p.dk_batch_stride, p.dk_head_stride,
                          p.dk_row_stride};
  const Operand<T> dv_all{static_cast<T*>(p.dv), p.dv_batch_stride, p.dv_head_stride,
                          p.dv_row_stride};
  const bool param_grads = p.dtau != nullptr;
  // Per-row {lse, Delta, G} in T (lse order): p.delta/p.row_g are float32, too coarse for fp64.
  std::vector<T> row_stats(static_cast<size_t>(row_items<false>(p)) * 3);

  // ---- pass 1: per row tile, lse (fp64: recomputed), G, Delta and dq ------------------------
  const int row_blocks = ceil_div(max_entry_rows<false>(p), kBlockM);
  const int64_t row_tasks = static_cast<int64_t>(p.batch) * p.heads_q * row_blocks;
  at::parallel_for(0, row_tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> key_tile(static_cast<size_t>(dim) * kBlockN);
    std::vector<T> value_tile(static_cast<size_t>(dim) * kBlockN);
    std::vector<T> x_acc(static_cast<size_t>(kBlockM) * dim);
    std::vector<T> y_acc(static_cast<size_t>(kBlockM) * dim);
    std::vector<T> scores(kBlockN), dweights(kBlockN);
    std::array<T, kBlockM> lse, shift, row_g, delta;
    std::array<KeyRange, kBlockM> ranges;
    for (int64_t task = begin; task < end; ++task) {
      const int m0 = static_cast<int>(task % row_blocks) * kBlockM;
      const int h = static_cast<int>((task / row_blocks) % p.heads_q);
      const int b = static_cast<int>(task / row_blocks / p.heads_q);
      const int g = h / group;
      const LazyProblem<T> x = problem.entry(b);
      const SeqLens& lens = x.lens;
      const int rows = std::min(kBlockM, lens.rows_q - m0);
      if (rows <= 0) continue;
      const auto dout = dout_all.shifted(lens.q_start);
      const auto dq = dq_all.shifted(lens.q_start);
      for (int r = 0; r < rows; ++r) {
        ranges[r] = key_range(p, lens, m0 + r);
        shift[r] = x.shift(h, m0 + r);
        row_g[r] = 0;
        delta[r] = 0;
      }
      if constexpr (std::is_same_v<T, float>) {
        // The forward's float32 lse is exactly its T value: reuse it.
        for (int r = 0; r < rows; ++r) lse[r] = p.lse[x.row_index(b, h, m0 + r)];
      } else {
        x.block_lse(b, h, m0, rows, lens, ranges.data(), key_tile.data(), scores.data(),
                    lse.data());
      }
      std::fill(x_acc.begin(), x_acc.end(), T(0));
      std::fill(y_acc.begin(), y_acc.end(), T(0));

      const KeyRange span = tile_key_range(p, lens, m0, m0 + rows);
      for (int n0 = span.lo; n0 < span.hi; n0 += kBlockN) {
        const int cols = std::min(kBlockN, span.hi - n0);
        load_transposed(x.k, b, g, n0, cols, dim, key_tile.data());
        load_transposed(x.v, b, g, n0, cols, dim, value_tile.data());
        for (int r = 0; r < rows; ++r) {
          const int c0 = std::max(ranges[r].lo, n0) - n0;
          const int c1 = std::min(ranges[r].hi, n0 + cols) - n0;
          if (c0 >= c1) continue;
          x.scores(b, h, m0 + r, n0, c0, c1, key_tile.data(), scores.data());
          dot_tile(dout.row(b, h, m0 + r), value_tile.data(), dim, c0, c1, dweights.data());
          T* x_row = x_acc.data() + static_cast<size_t>(r) * dim;
          T* y_row = y_acc.data() + static_cast<size_t>(r) * dim;
          for (int c = c0; c < c1; ++c) {
            const T prob = std::exp(scores[c] - lse[r]);
            const T* k_row = x.k.row(b, g, n0 + c);
            axpy(prob, k_row, y_row, dim);
            if (prob + shift[r] > T(0)) {
              const T pd = prob * dweights[c];
              row_g[r] += dweights[c];
              delta[r] += pd;
              axpy(pd, k_row, x_row, dim);
            }
          }
        }
      }

      for (int r = 0; r < rows; ++r) {
        const T* x_row = x_acc.data() + static_cast<size_t>(r) * dim;
        const T* y_row = y_acc.data() + static_cast<size_t>(r) * dim;
        T* dq_row = dq.row(b, h, m0 + r);
        for (int d = 0; d < dim; ++d) dq_row[d] = scale * (x_row[d] - delta[r] * y_row[d]);
        T* stats = row_stats.data() + 3 * x.row_index(b, h, m0 + r);
        stats[0] = lse[r];
        stats[1] = delta[r];
        stats[2] = row_g[r];
      }
    }
  });

  // ---- pass 2: per key tile(s) of one kv head, dk, dv and the dbias partials ------------------
  const int key_blocks = ceil_div(max_entry_rows<true>(p), kBlockN);
  const int bias_entries = std::min(problem.window, p.len_k);  // i - j <= Lk - 1
  const int tiles_per_task =
      param_grads ? ceil_div(bias_entries, kBiasEntriesPerKey * kBlockN) : 1;
  const int key_tasks_per_head = ceil_div(key_blocks, tiles_per_task);
  // bias_partial[((b * Hq + h) * key_tasks_per_head + t) * bias_entries + d]: sum of dS_ij over
  // i - j = d for the keys of task t; reduced over b and t in a fixed order below.
  std::vector<T> bias_partial(
      param_grads ? static_cast<size_t>(p.batch) * p.heads_q * key_tasks_per_head * bias_entries
                  : 0,
      T(0));
  const int64_t key_tasks = static_cast<int64_t>(p.batch) * p.heads_kv * key_tasks_per_head;
  at::parallel_for(0, key_tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> key_tile(static_cast<size_t>(dim) * kBlockN);
    std::vector<T> value_tile(static_cast<size_t>(dim) * kBlockN);
    std::vector<T> dk_acc(static_cast<size_t>(kBlockN) * dim);
    std::vector<T> dv_acc(static_cast<size_t>(kBlockN) * dim);
    std::vector<T> scores(kBlockN), dweights(kBlockN);
    for (int64_t task = begin; task < end; ++task) {
      const int t = static_cast<int>(task % key_tasks_per_head);
      const int g = static_cast<int>((task / key_tasks_per_head) % p.heads_kv);
      const int b = static_cast<int>(task / key_tasks_per_head / p.heads_kv);
      const LazyProblem<T> x = problem.entry(b);
      const SeqLens& lens = x.lens;
      const auto dout = dout_all.shifted(lens.q_start);
      const auto dk = dk_all.shifted(lens.k_start);
      const auto dv = dv_all.shifted(lens.k_start);
      const int tile_end = std::min(key_blocks, (t + 1) * tiles_per_task);
      for (int tile = t * tiles_per_task; tile < tile_end; ++tile) {
        const int n0 = tile * kBlockN;
        const int cols = std::min(kBlockN, lens.rows_k - n0);
        if (cols <= 0) break;
        // Padding keys (at or past lens.k) are seen by no row: their gradients stay zero.
        const int live_cols = std::max(0, std::min(cols, lens.k - n0));
        std::fill(dk_acc.begin(), dk_acc.end(), T(0));
        std::fill(dv_acc.begin(), dv_acc.end(), T(0));

        if (live_cols > 0) {
          load_transposed(x.k, b, g, n0, live_cols, dim, key_tile.data());
          load_transposed(x.v, b, g, n0, live_cols, dim, value_tile.data());
          const RowSpan span = rows_meeting_keys(p, lens, n0, n0 + live_cols);
          for (int h = g * group; h < (g + 1) * group; ++h) {
            T* partial = param_grads
                             ? bias_partial.data() +
                                   ((static_cast<size_t>(b) * p.heads_q + h) * key_tasks_per_head +
                                    t) * bias_entries
                             : nullptr;
            for (int i = span.first; i < span.last; ++i) {
              const KeyRange range = key_range(p, lens, i);
              const int c0 = std::max(range.lo, n0) - n0;
              const int c1 = std::min(range.hi, n0 + live_cols) - n0;
              if (c0 >= c1) continue;
              const T* stats = row_stats.data() + 3 * x.row_index(b, h, i);
              const T row_lse = stats[0], delta = stats[1];
              const T shift = x.shift(h, i);
              const T* q_row = x.q.row(b, h, i);
              const T* dout_row = dout.row(b, h, i);
              x.scores(b, h, i, n0, c0, c1, key_tile.data(), scores.data());
              dot_tile(dout_row, value_tile.data(), dim, c0, c1, dweights.data());
              const int dist0 = x.position(i) - n0;
              for (int c = c0; c < c1; ++c) {
                const T prob = std::exp(scores[c] - row_lse);
                const T w = prob + shift;
                const bool live = w > T(0);
                const T dscore = prob * ((live ? dweights[c] : T(0)) - delta);
                axpy(dscore, q_row, dk_acc.data() + static_cast<size_t>(c) * dim, dim);
                // Zero weights add nothing to dv: skipping them is exact.
                if (live) axpy(w, dout_row, dv_acc.data() + static_cast<size_t>(c) * dim, dim);
                if (partial != nullptr && dist0 - c < x.window) partial[dist0 - c] += dscore;
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
    }
  });

  if (!param_grads) return;
  // ---- parameter gradients: fixed-order sums of the per-row and per-task partials ------------
  for (int h = 0; h < p.heads_q; ++h) {
    T dtau = 0;
    for (int b = 0; b < p.batch; ++b) {
      const LazyProblem<T> x = problem.entry(b);
      for (int r = 0; r < x.lens.rows_q; ++r) {
        dtau += row_stats[3 * x.row_index(b, h, r) + 2] / static_cast<T>(x.position(r) + 1);
      }
    }
    p.dtau[h] = static_cast<float>(dtau);
    float* dbias = p.dbias + static_cast<int64_t>(h) * problem.window;
    for (int d = 0; d < problem.window; ++d) {
      T sum = 0;
      if (d < bias_entries) {
        for (int b = 0; b < p.batch; ++b) {
          const T* partial = bias_partial.data() +
                             (static_cast<size_t>(b) * p.heads_q + h) * key_tasks_per_head *
                                 bias_entries +
                             d;
          for (int t = 0; t < key_tasks_per_head; ++t) sum += partial[t * bias_entries];
        }
      }
      dbias[d] = static_cast<float>(sum);
    }
  }
}

}  // namespace

void lazy_fwd_cpu(const AttnParams& p, c10::ScalarType dtype) {
  switch (dtype) {
    case c10::kFloat:
      lazy_fwd_impl<float>(p);
      break;
    case c10::kDouble:
      lazy_fwd_impl<double>(p);
      break;
    default:
      TORCH_CHECK(false, "adaattn: the CPU lazy kernel takes float32 or float64, got ", dtype);
  }
}

void lazy_bwd_cpu(const AttnParams& p, c10::ScalarType dtype) {
  switch (dtype) {
    case c10::kFloat:
      lazy_bwd_impl<float>(p);
      break;
    case c10::kDouble:
      lazy_bwd_impl<double>(p);
      break;
    default:
      TORCH_CHECK(false, "adaattn: the CPU lazy kernel takes float32 or float64, got ", dtype);
  }
}

}  // namespace adaattn
