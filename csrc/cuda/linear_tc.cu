// Entry points of the tensor-core linear attention (linear_api.h): dtype dispatch to the
// instantiations in linear_tc_{bf16,fp16}_{fwd,bwd}.cu, and the dtype-independent chunk scan.
// Design in tc/linear_kernels.h.
#include <ATen/ATen.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../linear_api.h"
#include "tc/linear_launch.h"

namespace adaattn {
namespace tc {
namespace lin {

// Per (sequence, head) and state entry: walks the sequence's chunks in order (reverse: backwards)
// replacing local[c] by the exclusive running sum (causal only; non-causal needs just the
// total), which starts at init (null: 0) and ends in total. Sequential over chunks, parallel
// over entries; kScanBatch loads are issued before their sums.
__global__ void __launch_bounds__(kScanThreads)
    scan_kernel(const LinearParams p, int64_t cps, float* __restrict__ local,
                const float* __restrict__ init, float* __restrict__ total, bool reverse) {
  const int64_t de = static_cast<int64_t>(p.dim) * p.state_cols;
  const int64_t idx = static_cast<int64_t>(blockIdx.y) * kScanThreads + threadIdx.x;
  if (idx >= de) return;
  const int64_t pair = blockIdx.x;  // n * H + h
  const int n = static_cast<int>(pair / p.heads), h = static_cast<int>(pair % p.heads);
  int64_t start, len;
  seq_range(p, n, start, len);
  const int64_t chunks = (len + kChunk - 1) / kChunk;
  const int64_t base = chunk_base(p, cps, n);
  float run = init != nullptr ? init[pair * de + idx] : 0.f;
  auto at = [&](int64_t j) {
    const int64_t c = reverse ? chunks - 1 - j : j;
    return local + ((base + c) * p.heads + h) * de + idx;
  };
  for (int64_t j0 = 0; j0 < chunks; j0 += kScanBatch) {
    float x[kScanBatch];
#pragma unroll
    for (int u = 0; u < kScanBatch; ++u) x[u] = j0 + u < chunks ? *at(j0 + u) : 0.f;
#pragma unroll
    for (int u = 0; u < kScanBatch; ++u) {
      if (p.causal && j0 + u < chunks) *at(j0 + u) = run;
      run += x[u];
    }
  }
  total[pair * de + idx] = run;
}

void launch_scan(const LinearParams& p, const Grid& g, float* local, const void* init,
                 void* total, bool reverse) {
  const int64_t de = static_cast<int64_t>(p.dim) * p.state_cols;
  const int64_t pairs = static_cast<int64_t>(p.num_seqs) * p.heads;
  const dim3 blocks(static_cast<unsigned>(grid_size(pairs)),
                    static_cast<unsigned>((de + kScanThreads - 1) / kScanThreads));
  scan_kernel<<<blocks, kScanThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      p, g.cps, local, static_cast<const float*>(init), static_cast<float*>(total), reverse);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Instantiated in linear_tc_{bf16,fp16}_{fwd,bwd}.cu.
extern template void run_linear<__nv_bfloat16, false>(const LinearParams& p);
extern template void run_linear<__nv_bfloat16, true>(const LinearParams& p);
extern template void run_linear<__half, false>(const LinearParams& p);
extern template void run_linear<__half, true>(const LinearParams& p);
}  // namespace lin
}  // namespace tc

namespace {

template <bool kBwd>
void dispatch(const LinearParams& p, c10::ScalarType dtype, const char* name) {
  TORCH_CHECK(linear_tc_supports(dtype, p.dim, p.dim_v), "adaattn: ", name,
              " takes float16/bfloat16 with D, Dv in {64, 128}, got ", dtype, ", D = ", p.dim,
              ", Dv = ", p.dim_v);
  if (dtype == at::kBFloat16) {
    tc::lin::run_linear<__nv_bfloat16, kBwd>(p);
  } else {
    tc::lin::run_linear<__half, kBwd>(p);
  }
}

}  // namespace

void linear_fwd_tc_cuda(const LinearParams& p, c10::ScalarType dtype) {
  dispatch<false>(p, dtype, "linear_fwd_tc_cuda");
}

void linear_bwd_tc_cuda(const LinearParams& p, c10::ScalarType dtype) {
  dispatch<true>(p, dtype, "linear_bwd_tc_cuda");
}

}  // namespace adaattn
