// Exact CUDA linear attention in fp32/fp64 (scalar arithmetic; validation and gradcheck path).
//
// One block per (sequence, head) scans the rows in order with the state S [D, E] (E = Dv +
// normalize, see core/linear.h) accumulated in double in a global workspace. Thread c owns the
// state columns c, c + blockDim, ...: it alone updates them, so the scan needs no atomics and is
// deterministic; a row's phi(q), phi(k), [v | 1] are staged in shared memory.
// Forward, per row t: S[:, c] += phi(k_t) va_t[c] (causal), u_t[c] = phi(q_t) . S[:, c].
// Backward (formulas in cpu/linear_cpu.cpp): a forward sweep recomputes u_t, du_t and
// dq_t = (S_t du_t) * phi'(q_t), keeping du (causal) in a workspace; a reverse sweep accumulates
// dR = dstate + sum_{t >= s} phi(q_t)^T du_t and writes dv_s = (phi(k_s) dR)[:Dv] and
// dk_s = (dR va_s) * phi'(k_s). Non-causal: S is summed first and dR over the forward sweep.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>

#include <cstdint>
#include <limits>

#include "../core/linear.h"
#include "../linear_api.h"

namespace adaattn {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxDim = 256;       // D and Dv (validated by check_linear_inputs)
constexpr int kMaxCols = 256 + 1;  // E = Dv + normalize

// phi of row t of q or k (from the sequence's first row) into dst[0:D].
template <typename T>
__device__ void load_features(const LinearParams& p, const void* base, const LinearStrides& s,
                              int n, int h, int64_t start, int64_t t, double* dst) {
  const T* row = static_cast<const T*>(base) + row_offset(s, p, n, h, start, t);
  for (int x = threadIdx.x; x < p.dim; x += blockDim.x) {
    dst[x] = feature(p.feature_map, static_cast<double>(row[x]));
  }
}

// [v_t | 1] into dst[0:E].
template <typename T>
__device__ void load_values(const LinearParams& p, int n, int h, int64_t start, int64_t t,
                            double* dst) {
  const T* row = static_cast<const T*>(p.v) + row_offset(p.v_s, p, n, h, start, t);
  for (int c = threadIdx.x; c < p.dim_v; c += blockDim.x) dst[c] = static_cast<double>(row[c]);
  if (p.normalize && threadIdx.x == 0) dst[p.dim_v] = 1.0;
}

// Copies a [D, E] state of type T (or zeros for null) into the double workspace.
template <typename T>
__device__ void init_state(const void* src, int64_t offset, int64_t size, double* dst) {
  const T* s = src == nullptr ? nullptr : static_cast<const T*>(src) + offset;
  for (int64_t i = threadIdx.x; i < size; i += blockDim.x) {
    dst[i] = s == nullptr ? 0.0 : static_cast<double>(s[i]);
  }
}

// S += phi(k_t)^T va_t for every row of the sequence (the non-causal state).
template <typename T>
__device__ void sum_state(const LinearParams& p, int n, int h, int64_t start, int64_t len,
                          double* S, double* kf, double* va) {
  const int d = p.dim, e = p.state_cols;
  for (int64_t t = 0; t < len; ++t) {
    load_features<T>(p, p.k, p.k_s, n, h, start, t, kf);
    load_values<T>(p, n, h, start, t, va);
    __syncthreads();
    for (int c = threadIdx.x; c < e; c += blockDim.x) {
      for (int x = 0; x < d; ++x) S[static_cast<int64_t>(x) * e + c] += kf[x] * va[c];
    }
    __syncthreads();
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    linear_fwd_exact_kernel(const LinearParams p, double* __restrict__ ws) {
  __shared__ double qf[kMaxDim], kf[kMaxDim], va[kMaxCols], u[kMaxCols];
  const int n = blockIdx.x / p.heads, h = blockIdx.x % p.heads;
  const int d = p.dim, e = p.state_cols;
  const int64_t size = static_cast<int64_t>(d) * e;
  const int64_t offset = static_cast<int64_t>(blockIdx.x) * size;  // (n * H + h) * D * E
  int64_t start, len;
  seq_range(p, n, start, len);
  double* S = ws + offset;
  init_state<T>(p.state_in, offset, size, S);
  __syncthreads();
  if (!p.causal) sum_state<T>(p, n, h, start, len, S, kf, va);
  for (int64_t t = 0; t < len; ++t) {
    load_features<T>(p, p.q, p.q_s, n, h, start, t, qf);
    if (p.causal) {
      load_features<T>(p, p.k, p.k_s, n, h, start, t, kf);
      load_values<T>(p, n, h, start, t, va);
    }
    __syncthreads();
    for (int c = threadIdx.x; c < e; c += blockDim.x) {
      double acc = 0;
      for (int x = 0; x < d; ++x) {
        double* s = S + static_cast<int64_t>(x) * e + c;
        if (p.causal) *s += kf[x] * va[c];
        acc += qf[x] * *s;
      }
      u[c] = acc;
    }
    __syncthreads();
    const double r = p.normalize ? safe_reciprocal(u[p.dim_v]) : 1.0;
    T* o = static_cast<T*>(p.out) + row_offset(p.o_s, p, n, h, start, t);
    for (int c = threadIdx.x; c < p.dim_v; c += blockDim.x) o[c] = static_cast<T>(u[c] * r);
    __syncthreads();  // the next row overwrites the shared rows and u
  }
  T* so = static_cast<T*>(p.state_out) + offset;
  for (int64_t i = threadIdx.x; i < size; i += blockDim.x) so[i] = static_cast<T>(S[i]);
}

// ws_s, ws_r: [N * H, D, E] workspaces (S and dR); du_ws: [rows, H, E] (causal only), where a
// row is n * T + t (dense) or start + t (packed).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    linear_bwd_exact_kernel(const LinearParams p, double* __restrict__ ws_s,
                            double* __restrict__ ws_r, double* __restrict__ du_ws) {
  __shared__ double qf[kMaxDim], kf[kMaxDim], va[kMaxCols], u[kMaxCols], du[kMaxCols];
  __shared__ double g[kMaxDim];
  __shared__ double du_norm;  // du[Dv] = -(g . u[:Dv]) / u[Dv]^2
  const int n = blockIdx.x / p.heads, h = blockIdx.x % p.heads;
  const int d = p.dim, e = p.state_cols, dv = p.dim_v;
  const int64_t size = static_cast<int64_t>(d) * e;
  const int64_t offset = static_cast<int64_t>(blockIdx.x) * size;
  int64_t start, len;
  seq_range(p, n, start, len);
  const int64_t first_row = p.cu_seqlens == nullptr ? static_cast<int64_t>(n) * p.len : start;
  double* S = ws_s + offset;
  double* R = ws_r + offset;
  init_state<T>(p.state_in, offset, size, S);
  init_state<T>(p.dstate, offset, size, R);
  __syncthreads();
  if (!p.causal) sum_state<T>(p, n, h, start, len, S, kf, va);

  // Forward sweep: u, du, dq.
  for (int64_t t = 0; t < len; ++t) {
    load_features<T>(p, p.q, p.q_s, n, h, start, t, qf);
    if (p.causal) {
      load_features<T>(p, p.k, p.k_s, n, h, start, t, kf);
      load_values<T>(p, n, h, start, t, va);
    }
    const T* go = static_cast<const T*>(p.dout) + row_offset(p.do_s, p, n, h, start, t);
    for (int c = threadIdx.x; c < dv; c += blockDim.x) g[c] = static_cast<double>(go[c]);
    __syncthreads();
    for (int c = threadIdx.x; c < e; c += blockDim.x) {
      double acc = 0;
      for (int x = 0; x < d; ++x) {
        double* s = S + static_cast<int64_t>(x) * e + c;
        if (p.causal) *s += kf[x] * va[c];
        acc += qf[x] * *s;
      }
      u[c] = acc;
    }
    __syncthreads();
    const double r = p.normalize ? safe_reciprocal(u[dv]) : 1.0;
    if (p.normalize && threadIdx.x == 0) {
      double gu = 0;
      for (int c = 0; c < dv; ++c) gu += g[c] * u[c];
      du_norm = -gu * r * r;
    }
    __syncthreads();
    for (int c = threadIdx.x; c < e; c += blockDim.x) {
      const double duc = c < dv ? g[c] * r : du_norm;
      du[c] = duc;
      if (p.causal) {
        du_ws[((first_row + t) * p.heads + h) * e + c] = duc;
      } else {
        for (int x = 0; x < d; ++x) R[static_cast<int64_t>(x) * e + c] += qf[x] * duc;
      }
    }
    __syncthreads();
    const T* qr = static_cast<const T*>(p.q) + row_offset(p.q_s, p, n, h, start, t);
    T* dqr = static_cast<T*>(p.dq) + row_offset(p.dq_s, p, n, h, start, t);
    for (int x = threadIdx.x; x < d; x += blockDim.x) {
      const double* srow = S + static_cast<int64_t>(x) * e;
      double acc = 0;
      for (int c = 0; c < e; ++c) acc += srow[c] * du[c];
      dqr[x] = static_cast<T>(acc * feature_grad(p.feature_map, static_cast<double>(qr[x])));
    }
    __syncthreads();  // S columns are updated by their owners in the next row
  }

  // Reverse sweep: dk, dv (causal: dR gains row t before row t's gradients).
  for (int64_t t = len - 1; t >= 0; --t) {
    load_features<T>(p, p.k, p.k_s, n, h, start, t, kf);
    load_values<T>(p, n, h, start, t, va);
    if (p.causal) {
      load_features<T>(p, p.q, p.q_s, n, h, start, t, qf);
      for (int c = threadIdx.x; c < e; c += blockDim.x) {
        du[c] = du_ws[((first_row + t) * p.heads + h) * e + c];
      }
    }
    __syncthreads();
    T* dvr = static_cast<T*>(p.dv) + row_offset(p.dv_s, p, n, h, start, t);
    for (int c = threadIdx.x; c < e; c += blockDim.x) {
      double acc = 0;
      for (int x = 0; x < d; ++x) {
        double* rr = R + static_cast<int64_t>(x) * e + c;
        if (p.causal) *rr += qf[x] * du[c];
        acc += kf[x] * *rr;
      }
      if (c < dv) dvr[c] = static_cast<T>(acc);
    }
    __syncthreads();
    const T* kr = static_cast<const T*>(p.k) + row_offset(p.k_s, p, n, h, start, t);
    T* dkr = static_cast<T*>(p.dk) + row_offset(p.dk_s, p, n, h, start, t);
    for (int x = threadIdx.x; x < d; x += blockDim.x) {
      const double* rrow = R + static_cast<int64_t>(x) * e;
      double acc = 0;
      for (int c = 0; c < e; ++c) acc += rrow[c] * va[c];
      dkr[x] = static_cast<T>(acc * feature_grad(p.feature_map, static_cast<double>(kr[x])));
    }
    __syncthreads();
  }
  T* ds = static_cast<T*>(p.dstate_in) + offset;
  for (int64_t i = threadIdx.x; i < size; i += blockDim.x) ds[i] = static_cast<T>(R[i]);
}

at::Tensor workspace(int64_t numel) {
  // Stream-ordered caching allocator: freed on return, alive for the kernel queued here.
  return at::empty({numel}, at::TensorOptions()
                                .dtype(at::kDouble)
                                .device(at::kCUDA, c10::cuda::current_device()));
}

unsigned problem_blocks(const LinearParams& p) {
  const int64_t blocks = static_cast<int64_t>(p.num_seqs) * p.heads;
  TORCH_CHECK(blocks <= std::numeric_limits<int>::max(),
              "adaattn: linear attention supports at most 2^31 - 1 (sequence, head) pairs, got ",
              blocks);
  return static_cast<unsigned>(blocks);
}

template <typename T>
void launch_fwd(const LinearParams& p) {
  const unsigned blocks = problem_blocks(p);
  if (blocks == 0) return;
  const at::Tensor ws = workspace(static_cast<int64_t>(blocks) * p.dim * p.state_cols);
  linear_fwd_exact_kernel<T><<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      p, ws.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void launch_bwd(const LinearParams& p) {
  const unsigned blocks = problem_blocks(p);
  if (blocks == 0) return;
  const int64_t state = static_cast<int64_t>(blocks) * p.dim * p.state_cols;
  const at::Tensor ws = workspace(2 * state);
  // Row count of the du workspace: B * T (dense) or the packed total T.
  const int64_t rows = p.cu_seqlens == nullptr ? static_cast<int64_t>(p.num_seqs) * p.len : p.len;
  const at::Tensor du = workspace(p.causal ? rows * p.heads * p.state_cols : 0);
  linear_bwd_exact_kernel<T><<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      p, ws.data_ptr<double>(), ws.data_ptr<double>() + state, du.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void linear_fwd_exact_cuda(const LinearParams& p, c10::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble,
              "adaattn: linear_fwd_exact_cuda computes in float32/float64, got ", dtype);
  if (dtype == at::kFloat) {
    launch_fwd<float>(p);
  } else {
    launch_fwd<double>(p);
  }
}

void linear_bwd_exact_cuda(const LinearParams& p, c10::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble,
              "adaattn: linear_bwd_exact_cuda computes in float32/float64, got ", dtype);
  if (dtype == at::kFloat) {
    launch_bwd<float>(p);
  } else {
    launch_bwd<double>(p);
  }
}

}  // namespace adaattn
