// CPU kernels of linear attention, float32 and float64 inputs.
//
// One task per (sequence, head), run in parallel; every task owns its outputs, so results do not
// depend on the thread count. Rows are processed in chunks of kChunk: a chunk's outputs are
// phi(Q_c) S_prev (inter-chunk state) plus the masked intra-chunk product (phi(Q_c) phi(K_c)^T
// o mask) [V_c | 1], then S_prev += phi(K_c)^T [V_c | 1]: O(T * C * (D + E) + T * D * E) work.
// Everything is accumulated in double (the state included) and rounded once on store.
//
// Backward, with u = phi(q) S (E columns) and o = u[:Dv] / u[Dv] (normalize):
//   du[:Dv] = g / u[Dv],  du[Dv] = -(g . u[:Dv]) / u[Dv]^2          (du = g without normalize)
//   dphi(q_t) = S_t du_t                       (S_t: the state after row t, causal)
//   dR_s = dstate + sum_{t >= s} phi(q_t)^T du_t   (reverse scan; all t when non-causal)
//   dphi(k_s) = dR_s [v_s | 1],  d[v_s | 1] = phi(k_s) dR_s,  d initial_state = dR_0.
// The forward sweep recomputes u and keeps du ([len, E] per task) for the reverse sweep.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../linear_api.h"

namespace adaattn {
namespace {

constexpr int kChunk = 64;
using acc_t = double;

template <typename T>
class LinearTask {
 public:
  LinearTask(const LinearParams& p, int n, int h) : p_(p), n_(n), h_(h) {
    seq_range(p, n, start_, len_);
    state_offset_ = (static_cast<int64_t>(n) * p.heads + h) * p.dim * p.state_cols;
    const int d = p.dim, e = p.state_cols;
    S_.assign(static_cast<size_t>(d) * e, 0);
    qf_.resize(static_cast<size_t>(kChunk) * d);
    kf_.resize(static_cast<size_t>(kChunk) * d);
    va_.resize(static_cast<size_t>(kChunk) * e);
    u_.resize(static_cast<size_t>(kChunk) * e);
    if (p.state_in != nullptr) {
      const T* s = static_cast<const T*>(p.state_in) + state_offset_;
      std::copy(s, s + S_.size(), S_.begin());
    }
  }

  void forward() {
    if (!p_.causal) {
      for (int64_t c0 = 0; c0 < len_; c0 += kChunk) {
        const int rows = chunk_rows(c0);
        load_features(p_.k, p_.k_s, c0, rows, kf_);
        load_values(c0, rows);
        add_to_state(rows);
      }
    }
    for (int64_t c0 = 0; c0 < len_; c0 += kChunk) {
      const int rows = chunk_rows(c0);
      load_features(p_.q, p_.q_s, c0, rows, qf_);
      if (p_.causal) {
        load_features(p_.k, p_.k_s, c0, rows, kf_);
        load_values(c0, rows);
      }
      compute_u(rows);
      for (int i = 0; i < rows; ++i) {
        T* o = static_cast<T*>(p_.out) + row_offset(p_.o_s, p_, n_, h_, start_, c0 + i);
        const acc_t* u = &u_[static_cast<size_t>(i) * p_.state_cols];
        const acc_t r = p_.normalize ? safe_reciprocal(u[p_.dim_v]) : acc_t(1);
        for (int j = 0; j < p_.dim_v; ++j) o[j] = static_cast<T>(u[j] * r);
      }
      if (p_.causal) add_to_state(rows);
    }
    T* s = static_cast<T*>(p_.state_out) + state_offset_;
    for (size_t i = 0; i < S_.size(); ++i) s[i] = static_cast<T>(S_[i]);
  }

  void backward() {
    const int d = p_.dim, e = p_.state_cols, dv = p_.dim_v;
    std::vector<acc_t> dR(S_.size(), 0);
    if (p_.dstate != nullptr) {
      const T* s = static_cast<const T*>(p_.dstate) + state_offset_;
      std::copy(s, s + dR.size(), dR.begin());
    }
    // du of every row (causal: read back by the reverse sweep); non-causal needs only a chunk.
    std::vector<acc_t> du(static_cast<size_t>(p_.causal ? len_ : kChunk) * e);
    std::vector<acc_t> g(static_cast<size_t>(kChunk) * dv);
    std::vector<acc_t> grad(static_cast<size_t>(std::max(d, e)));
    if (!p_.causal) {
      for (int64_t c0 = 0; c0 < len_; c0 += kChunk) {
        const int rows = chunk_rows(c0);
        load_features(p_.k, p_.k_s, c0, rows, kf_);
        load_values(c0, rows);
        add_to_state(rows);
      }
    }
    // Forward sweep: u, du and dq.
    for (int64_t c0 = 0; c0 < len_; c0 += kChunk) {
      const int rows = chunk_rows(c0);
      acc_t* du_c = &du[static_cast<size_t>(p_.causal ? c0 : 0) * e];
      load_features(p_.q, p_.q_s, c0, rows, qf_);
      load_features(p_.k, p_.k_s, c0, rows, kf_);
      load_values(c0, rows);
      compute_u(rows);
      for (int i = 0; i < rows; ++i) {
        const T* go =
            static_cast<const T*>(p_.dout) + row_offset(p_.do_s, p_, n_, h_, start_, c0 + i);
        const acc_t* u = &u_[static_cast<size_t>(i) * e];
        acc_t* dui = du_c + static_cast<size_t>(i) * e;
        if (p_.normalize) {
          const acc_t r = safe_reciprocal(u[dv]);
          acc_t gu = 0;
          for (int j = 0; j < dv; ++j) {
            dui[j] = static_cast<acc_t>(go[j]) * r;
            gu += static_cast<acc_t>(go[j]) * u[j];
          }
          dui[dv] = -gu * r * r;
        } else {
          for (int j = 0; j < dv; ++j) dui[j] = static_cast<acc_t>(go[j]);
        }
      }
      // dphi(q_i) = S_prev du_i + sum_{j <= i in chunk} (du_i . va_j) phi(k_j).
      for (int i = 0; i < rows; ++i) {
        const acc_t* dui = du_c + static_cast<size_t>(i) * e;
        for (int x = 0; x < d; ++x) {
          const acc_t* srow = &S_[static_cast<size_t>(x) * e];
          acc_t s = 0;
          for (int j = 0; j < e; ++j) s += srow[j] * dui[j];
          grad[x] = s;
        }
        if (p_.causal) {
          for (int j = 0; j <= i; ++j) {
            const acc_t w = dot(dui, &va_[static_cast<size_t>(j) * e], e);
            const acc_t* kj = &kf_[static_cast<size_t>(j) * d];
            for (int x = 0; x < d; ++x) grad[x] += w * kj[x];
          }
        }
        store_input_grad(p_.q, p_.q_s, p_.dq, p_.dq_s, c0 + i, grad);
      }
      if (p_.causal) {
        add_to_state(rows);
      } else {
        accumulate_outer(qf_, du_c, rows, dR);
      }
    }
    // Reverse sweep: dk, dv (dR holds the chunks after this one when causal).
    const int64_t last = len_ == 0 ? 0 : ((len_ - 1) / kChunk) * kChunk;
    for (int64_t c0 = last; c0 >= 0 && len_ > 0; c0 -= kChunk) {
      const int rows = chunk_rows(c0);
      const acc_t* du_c = p_.causal ? &du[static_cast<size_t>(c0) * e] : nullptr;
      if (p_.causal) load_features(p_.q, p_.q_s, c0, rows, qf_);
      load_features(p_.k, p_.k_s, c0, rows, kf_);
      load_values(c0, rows);
      for (int s = 0; s < rows; ++s) {
        const acc_t* vs = &va_[static_cast<size_t>(s) * e];
        const acc_t* ks = &kf_[static_cast<size_t>(s) * d];
        // dphi(k_s) = dR va_s + sum_{t >= s in chunk} (du_t . va_s) phi(q_t).
        for (int x = 0; x < d; ++x) grad[x] = dot(&dR[static_cast<size_t>(x) * e], vs, e);
        if (p_.causal) {
          for (int t = s; t < rows; ++t) {
            const acc_t w = dot(du_c + static_cast<size_t>(t) * e, vs, e);
            const acc_t* qt = &qf_[static_cast<size_t>(t) * d];
            for (int x = 0; x < d; ++x) grad[x] += w * qt[x];
          }
        }
        store_input_grad(p_.k, p_.k_s, p_.dk, p_.dk_s, c0 + s, grad);
        // dva_s = phi(k_s) dR + sum_{t >= s in chunk} (phi(q_t) . phi(k_s)) du_t.
        for (int j = 0; j < e; ++j) grad[j] = 0;
        for (int x = 0; x < d; ++x) {
          const acc_t* rrow = &dR[static_cast<size_t>(x) * e];
          for (int j = 0; j < e; ++j) grad[j] += ks[x] * rrow[j];
        }
        if (p_.causal) {
          for (int t = s; t < rows; ++t) {
            const acc_t w = dot(&qf_[static_cast<size_t>(t) * d], ks, d);
            const acc_t* dut = du_c + static_cast<size_t>(t) * e;
            for (int j = 0; j < e; ++j) grad[j] += w * dut[j];
          }
        }
        T* dvr = static_cast<T*>(p_.dv) + row_offset(p_.dv_s, p_, n_, h_, start_, c0 + s);
        for (int j = 0; j < dv; ++j) dvr[j] = static_cast<T>(grad[j]);
      }
      if (p_.causal) accumulate_outer(qf_, du_c, rows, dR);
    }
    T* ds = static_cast<T*>(p_.dstate_in) + state_offset_;
    for (size_t i = 0; i < dR.size(); ++i) ds[i] = static_cast<T>(dR[i]);
  }

 private:
  static acc_t dot(const acc_t* a, const acc_t* b, int n) {
    acc_t s = 0;
    for (int i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
  }

  int chunk_rows(int64_t c0) const {
    return static_cast<int>(std::min<int64_t>(kChunk, len_ - c0));
  }

  // phi of rows [c0, c0 + rows) of q or k into dst [rows, D].
  void load_features(const void* base, const LinearStrides& s, int64_t c0, int rows,
                     std::vector<acc_t>& dst) const {
    for (int i = 0; i < rows; ++i) {
      const T* x = static_cast<const T*>(base) + row_offset(s, p_, n_, h_, start_, c0 + i);
      acc_t* y = &dst[static_cast<size_t>(i) * p_.dim];
      for (int j = 0; j < p_.dim; ++j) y[j] = feature(p_.feature_map, static_cast<acc_t>(x[j]));
    }
  }

  // [v | 1] rows into va_ [rows, E].
  void load_values(int64_t c0, int rows) {
    for (int i = 0; i < rows; ++i) {
      const T* x = static_cast<const T*>(p_.v) + row_offset(p_.v_s, p_, n_, h_, start_, c0 + i);
      acc_t* y = &va_[static_cast<size_t>(i) * p_.state_cols];
      for (int j = 0; j < p_.dim_v; ++j) y[j] = static_cast<acc_t>(x[j]);
      if (p_.normalize) y[p_.dim_v] = 1;
    }
  }

  // S += kf_^T va_ over the chunk's rows.
  void add_to_state(int rows) { accumulate_outer(kf_, va_.data(), rows, S_); }

  // dst [D, E] += a^T b with a [rows, D], b [rows, E].
  void accumulate_outer(const std::vector<acc_t>& a, const acc_t* b, int rows,
                        std::vector<acc_t>& dst) const {
    const int d = p_.dim, e = p_.state_cols;
    for (int i = 0; i < rows; ++i) {
      const acc_t* ai = &a[static_cast<size_t>(i) * d];
      const acc_t* bi = b + static_cast<size_t>(i) * e;
      for (int x = 0; x < d; ++x) {
        acc_t* row = &dst[static_cast<size_t>(x) * e];
        const acc_t w = ai[x];
        for (int j = 0; j < e; ++j) row[j] += w * bi[j];
      }
    }
  }

  // u_ = qf_ S_ (+ the masked intra-chunk product when causal; S_ is the state before the chunk).
  void compute_u(int rows) {
    const int d = p_.dim, e = p_.state_cols;
    for (int i = 0; i < rows; ++i) {
      acc_t* u = &u_[static_cast<size_t>(i) * e];
      std::fill(u, u + e, acc_t(0));
      const acc_t* qi = &qf_[static_cast<size_t>(i) * d];
      for (int x = 0; x < d; ++x) {
        const acc_t w = qi[x];
        const acc_t* srow = &S_[static_cast<size_t>(x) * e];
        for (int j = 0; j < e; ++j) u[j] += w * srow[j];
      }
      if (p_.causal) {
        for (int j = 0; j <= i; ++j) {
          const acc_t a = dot(qi, &kf_[static_cast<size_t>(j) * d], d);
          const acc_t* vj = &va_[static_cast<size_t>(j) * e];
          for (int c = 0; c < e; ++c) u[c] += a * vj[c];
        }
      }
    }
  }

  // d input = d phi * phi'(input) for row t (d phi in grad[0:D]).
  void store_input_grad(const void* in, const LinearStrides& in_s, void* out,
                        const LinearStrides& out_s, int64_t t,
                        const std::vector<acc_t>& grad) const {
    const T* x = static_cast<const T*>(in) + row_offset(in_s, p_, n_, h_, start_, t);
    T* y = static_cast<T*>(out) + row_offset(out_s, p_, n_, h_, start_, t);
    for (int j = 0; j < p_.dim; ++j) {
      y[j] = static_cast<T>(grad[j] * feature_grad(p_.feature_map, static_cast<acc_t>(x[j])));
    }
  }

  const LinearParams& p_;
  int n_, h_;
  int64_t start_ = 0, len_ = 0, state_offset_ = 0;
  std::vector<acc_t> S_, qf_, kf_, va_, u_;
};

template <typename T, typename Fn>
void for_each_task(const LinearParams& p, Fn&& fn) {
  const int64_t tasks = static_cast<int64_t>(p.num_seqs) * p.heads;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      LinearTask<T> t(p, static_cast<int>(task / p.heads), static_cast<int>(task % p.heads));
      fn(t);
    }
  });
}

}  // namespace

void linear_fwd_cpu(const LinearParams& p, c10::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble,
              "adaattn: linear_fwd_cpu computes in float32/float64, got ", dtype);
  if (dtype == at::kFloat) {
    for_each_task<float>(p, [](LinearTask<float>& t) { t.forward(); });
  } else {
    for_each_task<double>(p, [](LinearTask<double>& t) { t.forward(); });
  }
}

void linear_bwd_cpu(const LinearParams& p, c10::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble,
              "adaattn: linear_bwd_cpu computes in float32/float64, got ", dtype);
  if (dtype == at::kFloat) {
    for_each_task<float>(p, [](LinearTask<float>& t) { t.backward(); });
  } else {
    for_each_task<double>(p, [](LinearTask<double>& t) { t.backward(); });
  }
}

}  // namespace adaattn
