// The CPU attention core in fp32/fp64, written once over a variant V (variants/variant.h: score
// modifier V::Mod, probability transform V::Transform) and the mask policy (core/mask.h,
// core/block_sparse.h). A task owns a tile of kBlockM query rows (forward, backward row pass) or
// tiles of kBlockN keys of one kv head (backward key pass, which sums over the kv head's query
// heads: no output element is written twice and every sum has a fixed order). Keys are copied
// transposed into a small tile so the inner loops run with unit stride; extra memory is O(L).
//
// Forward. A normalised transform (a = p) takes one online-softmax pass. Any other needs each
// row's finished lse before its weights: an lse pass, then a weight pass that skips the V work
// of key tiles whose weights are all zero (and of single zero weights), which changes no result.
//
// Backward. The op's float32 lse is too coarse for fp64 gradients, so the row pass keeps its
// per-row statistics in T. Normalised: it recomputes the lse online while accumulating dq
// (rescaled like the forward accumulator), with Delta_i = dO_i.o_i. Otherwise M_ij depends on
// finished probabilities, so after an lse pass (fp64; fp32 reuses the forward's lse, which is
// exactly its T value) the row pass sweeps each row once, accumulating G_i = sum_j M dA,
// Delta_i = sum_j M p dA, X_i = sum_j M p g dA k_j and Y_i = sum_j p g k_j (g = ds/dx of the
// modifier), and writes dq_i = scale (X_i - Delta_i Y_i) = scale sum_j p g (M dA - Delta_i) k_j.
// Delta_i is summed directly rather than as dO_i.o_i - c_i G_i: equal in exact arithmetic, but
// the saved output is rounded to the input dtype (bf16/fp16), which would put that rounding into
// every gradient. The key pass then forms dS, dk, dv and the modifier's table gradient; the
// transform's per-head parameter gradient sums G_i row_term_grad(i) in a fixed order.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../attention_api.h"
#include "tile_ops.h"

namespace adaattn {
namespace {

using namespace cpu;

// A key-pass task that accumulates the modifier's table gradient keeps one partial table per
// query head; it covers enough key tiles that the tables hold at most about this many entries
// per key, so their memory stays O(L) even when the table is longer than the sequence.
constexpr int kParamEntriesPerKey = 8;

int ceil_div(int a, int b) { return (a + b - 1) / b; }

// The problem as every pass sees it; entry(b) views batch entry b (its operands start at the
// entry's first row, positions are its own).
template <typename V, typename T>
struct Problem {
  using Mod = typename V::Mod;
  using Transform = typename V::Transform;

  const AttnParams& p;
  int dim, dim_v, group;
  T scale;
  Operand<const T> q, k, v;
  SeqLens lens{};

  explicit Problem(const AttnParams& params)
      : p(params),
        dim(params.head_dim),
        dim_v(params.head_dim_v),
        group(params.heads_q / params.heads_kv),
        scale(static_cast<T>(params.scale)),
        q{static_cast<const T*>(params.q), params.q_batch_stride, params.q_head_stride,
          params.q_row_stride},
        k{static_cast<const T*>(params.k), params.k_batch_stride, params.k_head_stride,
          params.k_row_stride},
        v{static_cast<const T*>(params.v), params.v_batch_stride, params.v_head_stride,
          params.v_row_stride} {}

  Problem entry(int b) const {
    Problem e = *this;
    e.lens = seq_lens(p, b);
    e.q = q.shifted(e.lens.q_start);
    e.k = k.shifted(e.lens.k_start);
    e.v = v.shifted(e.lens.k_start);
    return e;
  }

  int64_t row_index(int b, int h, int r) const { return row_stat_offset(p, lens, b, h) + r; }
  int position(int r) const { return row_position(lens, r); }
  T row_term(int h, int r) const {
    return Transform::template row_term<T>(p, h, query_position(lens, r));
  }

  // s[c] = Mod(scale q_r.k_j), j = n0 + c, for c in [c0, c1); key_tile holds keys
  // [n0, n0 + kBlockN) transposed. x, when given, gets the unmodified scale q_r.k_j.
  void scores(int b, int h, int r, int n0, int c0, int c1, const T* key_tile, T* __restrict__ s,
              T* __restrict__ x = nullptr) const {
    dot_tile(q.row(b, h, r), key_tile, dim, c0, c1, s);
    for (int c = c0; c < c1; ++c) s[c] *= scale;
    if constexpr (!Mod::kIdentity) {
      if (x != nullptr) std::copy(s + c0, s + c1, x + c0);
      const int i = position(r);
      for (int c = c0; c < c1; ++c) s[c] = Mod::apply(p, b, h, i, n0 + c, s[c]);
    }
  }

  // ds/dx at column c (1 for a modifier of unit derivative, which keeps no x).
  T score_grad(const T* x, const T* s, int c) const {
    if constexpr (Mod::kUnitGrad) {
      return T(1);
    } else {
      return Mod::grad(p, x[c], s[c]);
    }
  }

  // Log-sum-exp in T of rows [m0, m0 + rows) of (b, h) (-inf for a row that sees no key), online
  // over the visited key tiles. The forward and the fp64 backward share it, so both see
  // bit-identical probabilities and therefore the same M.
  void row_lse(int b, int h, int m0, int rows, const KeyRange* ranges, T* key_tile, T* s,
               T* lse) const {
    std::array<T, kBlockM> row_max, row_sum;
    row_max.fill(neg_inf<T>());
    row_sum.fill(T(0));
    for_each_key_tile(p, lens, b, h, m0, rows, [&](int n0, int cols) {
      load_transposed(k, b, h / group, n0, cols, dim, key_tile);
      for (int r = 0; r < rows; ++r) {
        const KeyRange cc = tile_columns(ranges[r], n0, cols);
        if (cc.lo >= cc.hi) continue;
        scores(b, h, m0 + r, n0, cc.lo, cc.hi, key_tile, s);
        online_softmax_step(s, cc.lo, cc.hi, row_max[r], row_sum[r], static_cast<T*>(nullptr), 0,
                            [](int, T) {});
      }
    });
    for (int r = 0; r < rows; ++r) {
      lse[r] = row_saw_keys(row_sum[r]) ? row_max[r] + std::log(row_sum[r]) : neg_inf<T>();
    }
  }
};

template <typename V, typename T>
void attention_fwd(const AttnParams& p) {
  using Transform = typename V::Transform;
  const Problem<V, T> problem(p);
  const int dim = problem.dim, dim_v = problem.dim_v;
  const Operand<T> out_all{static_cast<T*>(p.out), p.o_batch_stride, p.o_head_stride,
                           p.o_row_stride};
  const int row_blocks = ceil_div(max_entry_rows<false>(p), kBlockM);
  const int64_t tasks = static_cast<int64_t>(p.batch) * p.heads_q * row_blocks;
  // Per-task counters {zero weights, attended weights, skipped tiles, visited tiles}, summed in
  // task order afterwards.
  const bool count = Transform::kCountsZeros && p.stats != nullptr;
  std::vector<std::array<int64_t, 4>> counts(count ? tasks : 0);

  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> key_tile(static_cast<size_t>(dim) * kBlockN);
    std::vector<T> acc(static_cast<size_t>(kBlockM) * dim_v);
    std::vector<T> weights(Transform::kNormalized ? 0 : static_cast<size_t>(kBlockM) * kBlockN);
    std::vector<T> scores(kBlockN);
    std::array<T, kBlockM> row_max, row_sum, lse, term;
    std::array<KeyRange, kBlockM> ranges;
    for (int64_t task = begin; task < end; ++task) {
      const int m0 = static_cast<int>(task % row_blocks) * kBlockM;
      const int h = static_cast<int>((task / row_blocks) % p.heads_q);
      const int b = static_cast<int>(task / row_blocks / p.heads_q);
      const Problem<V, T> x = problem.entry(b);
      const SeqLens& lens = x.lens;
      const int g = h / x.group;
      const int rows = std::min(kBlockM, lens.rows_q - m0);
      if (rows <= 0) continue;
      const auto out = out_all.shifted(lens.q_start);
      for (int r = 0; r < rows; ++r) ranges[r] = key_range(p, lens, m0 + r);
      std::fill(acc.begin(), acc.end(), T(0));

      if constexpr (Transform::kNormalized) {
        for (int r = 0; r < rows; ++r) Transform::row_init(p, h, row_max[r], row_sum[r]);
        for_each_key_tile(p, lens, b, h, m0, rows, [&](int n0, int cols) {
          load_transposed(x.k, b, g, n0, cols, dim, key_tile.data());
          for (int r = 0; r < rows; ++r) {
            const KeyRange cc = tile_columns(ranges[r], n0, cols);
            if (cc.lo >= cc.hi) continue;
            x.scores(b, h, m0 + r, n0, cc.lo, cc.hi, key_tile.data(), scores.data());
            T* acc_row = acc.data() + static_cast<size_t>(r) * dim_v;
            online_softmax_step(scores.data(), cc.lo, cc.hi, row_max[r], row_sum[r], acc_row,
                                dim_v, [&](int c, T weight) {
                                  axpy(weight, x.v.row(b, g, n0 + c), acc_row, dim_v);
                                });
          }
        });
        for (int r = 0; r < rows; ++r) {
          const bool seen = row_saw_keys(row_sum[r]);
          lse[r] = seen ? row_max[r] + std::log(row_sum[r]) : neg_inf<T>();
          // A row without a finite score keeps its sum of 0 * v_j: 0, or NaN where a value is
          // non-finite (as the reference's P V).
          if (!seen) continue;
          T* acc_row = acc.data() + static_cast<size_t>(r) * dim_v;
          for (int d = 0; d < dim_v; ++d) acc_row[d] /= row_sum[r];
        }
      } else {
        if (p.lse_pass == LsePass::kGiven) {
          for (int r = 0; r < rows; ++r) lse[r] = p.lse[x.row_index(b, h, m0 + r)];
        } else {
          x.row_lse(b, h, m0, rows, ranges.data(), key_tile.data(), scores.data(), lse.data());
        }
        if (p.lse_pass == LsePass::kOnly) {
          for (int r = 0; r < rows; ++r) {
            p.lse[x.row_index(b, h, m0 + r)] = static_cast<float>(lse[r]);
          }
          continue;
        }
        for (int r = 0; r < rows; ++r) term[r] = x.row_term(h, m0 + r);
        int64_t zero_weights = 0, attended = 0, skipped = 0, visited = 0;
        for_each_key_tile(p, lens, b, h, m0, rows, [&](int n0, int cols) {
          load_transposed(x.k, b, g, n0, cols, dim, key_tile.data());
          bool any_weight = false;
          for (int r = 0; r < rows; ++r) {
            const KeyRange cc = tile_columns(ranges[r], n0, cols);
            if (cc.lo >= cc.hi) continue;
            x.scores(b, h, m0 + r, n0, cc.lo, cc.hi, key_tile.data(), scores.data());
            T* __restrict__ w = weights.data() + static_cast<size_t>(r) * kBlockN;
            for (int c = cc.lo; c < cc.hi; ++c) {
              w[c] = Transform::weight(prob_from_lse(scores[c], lse[r]), term[r]);
              const bool zero = w[c] == T(0);
              zero_weights += zero;
              any_weight |= !zero;
            }
            attended += cc.hi - cc.lo;
          }
          ++visited;
          if (!any_weight) {
            ++skipped;
            return;
          }
          for (int r = 0; r < rows; ++r) {
            const KeyRange cc = tile_columns(ranges[r], n0, cols);
            const T* w = weights.data() + static_cast<size_t>(r) * kBlockN;
            T* acc_row = acc.data() + static_cast<size_t>(r) * dim_v;
            for (int c = cc.lo; c < cc.hi; ++c) {
              if (w[c] != T(0)) axpy(w[c], x.v.row(b, g, n0 + c), acc_row, dim_v);
            }
          }
        });
        if (count) counts[task] = {zero_weights, attended, skipped, visited};
      }

      for (int r = 0; r < rows; ++r) {
        std::copy_n(acc.data() + static_cast<size_t>(r) * dim_v, dim_v, out.row(b, h, m0 + r));
        if (p.lse_pass != LsePass::kGiven) {
          p.lse[x.row_index(b, h, m0 + r)] = static_cast<float>(lse[r]);
        }
      }
    }
  });

  if (count) {
    std::array<int64_t, 4> total{};
    for (const auto& c : counts) {
      for (int i = 0; i < 4; ++i) total[i] += c[i];
    }
    std::copy(total.begin(), total.end(), p.stats);
  }
}

template <typename V, typename T>
void attention_bwd(const AttnParams& p) {
  using Mod = typename V::Mod;
  using Transform = typename V::Transform;
  constexpr bool kNormalized = Transform::kNormalized;
  static_assert(!(kNormalized && Transform::kRowParamGrad),
                "the online row pass of a normalised transform computes no G_i");
  // Per-row statistics in T, lse order: {lse, Delta} and, without normalisation, G.
  constexpr int kStats = kNormalized ? 2 : 3;
  constexpr bool kKeepX = !Mod::kUnitGrad;  // pre-modifier scores, for ds/dx
  const Problem<V, T> problem(p);
  const int dim = problem.dim, dim_v = problem.dim_v, group = problem.group;
  const T scale = problem.scale;
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
  bool mod_grad = false, row_grad = false;
  if constexpr (Mod::kParamGrad) mod_grad = Mod::wants_param_grad(p);
  if constexpr (Transform::kRowParamGrad) {
    row_grad = Transform::wants_param_grad(p) && p.row_pass == LsePass::kCompute;
  }
  // A block of a sharded row (LsePass::kOnly / kGiven) normalises by the whole row's lse, which
  // the caller passes (float32 is then as fine as it gets).
  const bool given_lse = p.row_pass != LsePass::kCompute;
  std::vector<T> row_stats(static_cast<size_t>(row_items<false>(p)) * kStats);

  // ---- row pass: per row tile, the row statistics and dq --------------------------------------
  const int row_blocks = ceil_div(max_entry_rows<false>(p), kBlockM);
  const int64_t row_tasks = static_cast<int64_t>(p.batch) * p.heads_q * row_blocks;
  at::parallel_for(0, row_tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> key_tile(static_cast<size_t>(dim) * kBlockN);
    std::vector<T> value_tile(static_cast<size_t>(dim_v) * kBlockN);
    std::vector<T> dq_acc(static_cast<size_t>(kBlockM) * dim);  // X (unnormalised: / row sum)
    std::vector<T> y_acc(kNormalized ? 0 : static_cast<size_t>(kBlockM) * dim);
    std::vector<T> scores(kBlockN), dprobs(kBlockN), x_buf(kKeepX ? kBlockN : 0);
    T* const xs = kKeepX ? x_buf.data() : nullptr;
    std::array<T, kBlockM> row_max, row_sum, lse, delta, row_g, term;
    std::array<KeyRange, kBlockM> ranges;
    for (int64_t task = begin; task < end; ++task) {
      const int m0 = static_cast<int>(task % row_blocks) * kBlockM;
      const int h = static_cast<int>((task / row_blocks) % p.heads_q);
      const int b = static_cast<int>(task / row_blocks / p.heads_q);
      const int g = h / group;
      const Problem<V, T> x = problem.entry(b);
      const SeqLens& lens = x.lens;
      const int rows = std::min(kBlockM, lens.rows_q - m0);
      if (rows <= 0) continue;
      const auto dout = dout_all.shifted(lens.q_start);
      const auto dq = dq_all.shifted(lens.q_start);
      for (int r = 0; r < rows; ++r) ranges[r] = key_range(p, lens, m0 + r);
      std::fill(dq_acc.begin(), dq_acc.end(), T(0));

      if constexpr (kNormalized) {
        const auto out = out_all.shifted(lens.q_start);
        for (int r = 0; r < rows; ++r) {
          Transform::row_init(p, h, row_max[r], row_sum[r]);
          delta[r] = dot(dout.row(b, h, m0 + r), out.row(b, h, m0 + r), dim_v);
        }
        for_each_key_tile(p, lens, b, h, m0, rows, [&](int n0, int cols) {
          load_transposed(x.k, b, g, n0, cols, dim, key_tile.data());
          load_transposed(x.v, b, g, n0, cols, dim_v, value_tile.data());
          for (int r = 0; r < rows; ++r) {
            const KeyRange cc = tile_columns(ranges[r], n0, cols);
            if (cc.lo >= cc.hi) continue;
            x.scores(b, h, m0 + r, n0, cc.lo, cc.hi, key_tile.data(), scores.data(), xs);
            dot_tile(dout.row(b, h, m0 + r), value_tile.data(), dim_v, cc.lo, cc.hi,
                     dprobs.data());
            T* acc_row = dq_acc.data() + static_cast<size_t>(r) * dim;
            // Unnormalised weights; dq is divided by the row sum once the row is complete.
            online_softmax_step(scores.data(), cc.lo, cc.hi, row_max[r], row_sum[r], acc_row, dim,
                                [&](int c, T weight) {
                                  const T ds = weight * (dprobs[c] - delta[r]) *
                                               x.score_grad(xs, scores.data(), c);
                                  axpy(ds, x.k.row(b, g, n0 + c), acc_row, dim);
                                });
          }
        });
        for (int r = 0; r < rows; ++r) {
          const bool seen = row_saw_keys(row_sum[r]);
          lse[r] = seen ? row_max[r] + std::log(row_sum[r]) : neg_inf<T>();
          T* dq_row = dq.row(b, h, m0 + r);
          const T* acc_row = dq_acc.data() + static_cast<size_t>(r) * dim;
          // Unseen: the sum of 0 * k_j, as in the forward.
          for (int d = 0; d < dim; ++d) {
            dq_row[d] = (seen ? acc_row[d] / row_sum[r] : acc_row[d]) * scale;
          }
        }
      } else {
        if (std::is_same_v<T, float> || given_lse) {
          for (int r = 0; r < rows; ++r) lse[r] = p.lse[x.row_index(b, h, m0 + r)];
        } else {
          x.row_lse(b, h, m0, rows, ranges.data(), key_tile.data(), scores.data(), lse.data());
        }
        const bool given_delta = p.row_pass == LsePass::kGiven;
        for (int r = 0; r < rows; ++r) {
          term[r] = x.row_term(h, m0 + r);
          delta[r] = given_delta ? static_cast<T>(p.delta[x.row_index(b, h, m0 + r)]) : T(0);
          row_g[r] = 0;
        }
        std::fill(y_acc.begin(), y_acc.end(), T(0));
        for_each_key_tile(p, lens, b, h, m0, rows, [&](int n0, int cols) {
          load_transposed(x.k, b, g, n0, cols, dim, key_tile.data());
          load_transposed(x.v, b, g, n0, cols, dim_v, value_tile.data());
          for (int r = 0; r < rows; ++r) {
            const KeyRange cc = tile_columns(ranges[r], n0, cols);
            if (cc.lo >= cc.hi) continue;
            x.scores(b, h, m0 + r, n0, cc.lo, cc.hi, key_tile.data(), scores.data(), xs);
            dot_tile(dout.row(b, h, m0 + r), value_tile.data(), dim_v, cc.lo, cc.hi,
                     dprobs.data());
            T* x_row = dq_acc.data() + static_cast<size_t>(r) * dim;
            T* y_row = y_acc.data() + static_cast<size_t>(r) * dim;
            for (int c = cc.lo; c < cc.hi; ++c) {
              const T prob = prob_from_lse(scores[c], lse[r]);
              const T sg = x.score_grad(xs, scores.data(), c);
              const T* k_row = x.k.row(b, g, n0 + c);
              axpy(prob * sg, k_row, y_row, dim);
              if (Transform::live(prob, term[r])) {
                const T pd = prob * dprobs[c];
                row_g[r] += dprobs[c];
                if (!given_delta) delta[r] += pd;
                axpy(pd * sg, k_row, x_row, dim);
              }
            }
          }
        });
        if (p.row_pass == LsePass::kOnly) {
          for (int r = 0; r < rows; ++r) {
            const int64_t i = x.row_index(b, h, m0 + r);
            p.delta[i] = static_cast<float>(delta[r]);
            p.row_g[i] = static_cast<float>(
                row_g[r] * Transform::template row_term_grad<T>(p, query_position(lens, m0 + r)));
          }
          continue;
        }
        for (int r = 0; r < rows; ++r) {
          const T* x_row = dq_acc.data() + static_cast<size_t>(r) * dim;
          const T* y_row = y_acc.data() + static_cast<size_t>(r) * dim;
          T* dq_row = dq.row(b, h, m0 + r);
          for (int d = 0; d < dim; ++d) dq_row[d] = scale * (x_row[d] - delta[r] * y_row[d]);
        }
      }

      for (int r = 0; r < rows; ++r) {
        T* stats = row_stats.data() + kStats * x.row_index(b, h, m0 + r);
        stats[0] = lse[r];
        stats[1] = delta[r];
        if constexpr (!kNormalized) stats[2] = row_g[r];
      }
    }
  });

  if (p.row_pass == LsePass::kOnly) return;

  // ---- key pass: per key tile(s) of one kv head, dk, dv and the table-gradient partials -----
  const int key_blocks = ceil_div(max_entry_rows<true>(p), kBlockN);
  int slots = 0;
  if constexpr (Mod::kParamGrad) slots = mod_grad ? Mod::param_slots(p) : 0;
  const int tiles_per_task = std::max(1, ceil_div(slots, kParamEntriesPerKey * kBlockN));
  const int key_tasks_per_head = ceil_div(key_blocks, tiles_per_task);
  // partial[((b * Hq + h) * key_tasks_per_head + t) * slots + s]: sum of dS_ij over the (i, j)
  // of slot s among the keys of task t; reduced over b and t in a fixed order below.
  std::vector<T> partials(static_cast<size_t>(p.batch) * p.heads_q * key_tasks_per_head * slots,
                          T(0));
  const int64_t key_tasks = static_cast<int64_t>(p.batch) * p.heads_kv * key_tasks_per_head;
  at::parallel_for(0, key_tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> key_tile(static_cast<size_t>(dim) * kBlockN);
    std::vector<T> value_tile(static_cast<size_t>(dim_v) * kBlockN);
    std::vector<T> dk_acc(static_cast<size_t>(kBlockN) * dim);
    std::vector<T> dv_acc(static_cast<size_t>(kBlockN) * dim_v);
    std::vector<T> scores(kBlockN), dprobs(kBlockN), x_buf(kKeepX ? kBlockN : 0);
    T* const xs = kKeepX ? x_buf.data() : nullptr;
    for (int64_t task = begin; task < end; ++task) {
      const int t = static_cast<int>(task % key_tasks_per_head);
      const int g = static_cast<int>((task / key_tasks_per_head) % p.heads_kv);
      const int b = static_cast<int>(task / key_tasks_per_head / p.heads_kv);
      const Problem<V, T> x = problem.entry(b);
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
          load_transposed(x.v, b, g, n0, live_cols, dim_v, value_tile.data());
          const RowSpan span = rows_meeting_keys(p, lens, n0, n0 + live_cols);
          for (int h = g * group; h < (g + 1) * group; ++h) {
            T* partial = slots > 0 ? partials.data() +
                                         ((static_cast<size_t>(b) * p.heads_q + h) *
                                              key_tasks_per_head + t) * slots
                                   : nullptr;
            for_each_row_span(p, b, h, n0, span, [&](int first, int last) {
              for (int i = first; i < last; ++i) {
                const KeyRange cc = tile_columns(key_range(p, lens, i), n0, live_cols);
                if (cc.lo >= cc.hi) continue;
                const T* stats = row_stats.data() + kStats * x.row_index(b, h, i);
                const T row_lse = stats[0], delta = stats[1];
                const T term = x.row_term(h, i);
                const T* q_row = x.q.row(b, h, i);
                const T* dout_row = dout.row(b, h, i);
                x.scores(b, h, i, n0, cc.lo, cc.hi, key_tile.data(), scores.data(), xs);
                dot_tile(dout_row, value_tile.data(), dim_v, cc.lo, cc.hi, dprobs.data());
                for (int c = cc.lo; c < cc.hi; ++c) {
                  const T prob = prob_from_lse(scores[c], row_lse);
                  const bool live = Transform::live(prob, term);
                  // dS (of the modified score, which the table is added to) and dX = dS ds/dx.
                  const T dscore = prob * ((live ? dprobs[c] : T(0)) - delta);
                  const T ds = dscore * x.score_grad(xs, scores.data(), c);
                  axpy(ds, q_row, dk_acc.data() + static_cast<size_t>(c) * dim, dim);
                  // A clipped (zero) weight drops its key, as in the forward: skipping it is
                  // exact. A NaN weight is not zero and reaches dv.
                  const T weight = Transform::weight(prob, term);
                  if (Transform::kNormalized || weight != T(0)) {
                    axpy(weight, dout_row, dv_acc.data() + static_cast<size_t>(c) * dim_v, dim_v);
                  }
                  if constexpr (Mod::kParamGrad) {
                    if (partial != nullptr) {
                      const int slot = Mod::param_slot(p, x.position(i), n0 + c);
                      if (slot >= 0) partial[slot] += dscore;
                    }
                  }
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
          std::copy_n(dv_src, dim_v, dv_row);
        }
      }
    }
  });

  // ---- parameter gradients: fixed-order sums of the per-row and per-task partials ------------
  if constexpr (Transform::kRowParamGrad) {
    if (row_grad) {
      for (int h = 0; h < p.heads_q; ++h) {
        T sum = 0;
        for (int b = 0; b < p.batch; ++b) {
          const Problem<V, T> x = problem.entry(b);
          for (int r = 0; r < x.lens.rows_q; ++r) {
            sum += row_stats[kStats * x.row_index(b, h, r) + 2] *
                   Transform::template row_term_grad<T>(p, query_position(x.lens, r));
          }
        }
        Transform::param_grad_out(p)[h] = static_cast<float>(sum);
      }
    }
  }
  if constexpr (Transform::kLseParamGrad) {
    if (Transform::wants_lse_param_grad(p)) {
      for (int h = 0; h < p.heads_q; ++h) {
        T sum = 0;
        for (int b = 0; b < p.batch; ++b) {
          const Problem<V, T> x = problem.entry(b);
          // Padding rows (o = 0, Delta = 0) add nothing.
          for (int r = 0; r < x.lens.q; ++r) {
            const T* stats = row_stats.data() + kStats * x.row_index(b, h, r);
            sum += Transform::lse_param_term(p, h, stats[0], stats[1]);
          }
        }
        Transform::lse_param_grad_out(p)[h] = static_cast<float>(sum);
      }
    }
  }
  if constexpr (Mod::kParamGrad) {
    if (mod_grad) {
      const int size = Mod::param_count(p);
      for (int h = 0; h < p.heads_q; ++h) {
        float* grad = Mod::param_grad_out(p) + static_cast<int64_t>(h) * size;
        for (int s = 0; s < size; ++s) {
          T sum = 0;
          if (s < slots) {
            for (int b = 0; b < p.batch; ++b) {
              const T* partial = partials.data() +
                                 (static_cast<size_t>(b) * p.heads_q + h) * key_tasks_per_head *
                                     slots + s;
              for (int t = 0; t < key_tasks_per_head; ++t) sum += partial[t * slots];
            }
          }
          grad[s] = static_cast<float>(sum);
        }
      }
    }
  }
}

// Calls f(V{}, T{}) for the variant and the scalar type T of dtype.
template <typename F>
void dispatch(VariantId variant, c10::ScalarType dtype, F&& f) {
  with_variant(variant, [&](auto v) {
    switch (dtype) {
      case c10::kFloat:
        f(v, float{});
        break;
      case c10::kDouble:
        f(v, double{});
        break;
      default:
        TORCH_CHECK(false, "adaattn: the CPU attention kernel takes float32 or float64, got ",
                    dtype);
    }
  });
}

}  // namespace

void attention_fwd_cpu(VariantId variant, const AttnParams& p, c10::ScalarType dtype) {
  dispatch(variant, dtype, [&](auto v, auto t) { attention_fwd<decltype(v), decltype(t)>(p); });
}

void attention_bwd_cpu(VariantId variant, const AttnParams& p, c10::ScalarType dtype) {
  dispatch(variant, dtype, [&](auto v, auto t) { attention_bwd<decltype(v), decltype(t)>(p); });
}

}  // namespace adaattn
