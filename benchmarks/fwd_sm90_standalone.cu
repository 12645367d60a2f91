// Standalone timing of the Hopper forward kernel (csrc/cuda/tc/flash_fwd_sm90.h) without torch:
// it builds in seconds, so two source trees can be compared in one device call. Build (here or
// on the GPU machine; --use_fast_math as in setup.py) and run on an sm_90 GPU:
//
//   nvcc -O3 -std=c++17 --use_fast_math --expt-relaxed-constexpr \
//       -gencode=arch=compute_90a,code=sm_90a -DADAATTN_SM90A -Icsrc \
//       benchmarks/fwd_sm90_standalone.cu -o fwd_sm90 && ./fwd_sm90
//
// For an A/B, build a second binary with -I<other tree>/csrc and run the two alternately.
// Shapes (bf16, dense [B, H, L, D], random normal inputs, softmax scale 1/sqrt(128)): the 32-wide
// low-rank scores with Dv = 128 and flash D = 128 at B = 4, H = 16, L = 4096; flash D = 64 at
// B = 4, H = 32, L = 4096; each non-causal and causal. Prints the median and minimum of 25 timed
// launches (CUDA events, after 5 warmup launches) and a checksum of the output, so that two
// builds of the same math can be compared at a glance.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda/tc/flash_fwd_sm90.h"
#include "standalone_cuda.cuh"

using T = __nv_bfloat16;

template <int DK, int DV>
void time_forward(int batch, int heads, int len, bool causal) {
  using Traits = adaattn::tc::Sm90FwdTraits<T, DK, DV>;
  auto kernel =
      adaattn::tc::flash_fwd_sm90_kernel<Traits, T, DK, DV, adaattn::tc::SoftmaxVariant, false>;
  const long long rows = static_cast<long long>(batch) * heads * len;
  T *q, *k, *v, *o;
  float* lse;
  CK(cudaMalloc(&q, rows * DK * sizeof(T)));
  CK(cudaMalloc(&k, rows * DK * sizeof(T)));
  CK(cudaMalloc(&v, rows * DV * sizeof(T)));
  CK(cudaMalloc(&o, rows * DV * sizeof(T)));
  CK(cudaMalloc(&lse, rows * sizeof(float)));
  fill_normal<<<1024, 256>>>(q, rows * DK, 1);
  fill_normal<<<1024, 256>>>(k, rows * DK, 2);
  fill_normal<<<1024, 256>>>(v, rows * DV, 3);
  adaattn::AttnParams p{};
  p.q = q;
  p.k = k;
  p.v = v;
  p.out = o;
  p.lse = lse;
  p.q_row_stride = p.k_row_stride = DK;
  p.q_head_stride = p.k_head_stride = static_cast<int64_t>(len) * DK;
  p.q_batch_stride = p.k_batch_stride = static_cast<int64_t>(heads) * len * DK;
  p.v_row_stride = p.o_row_stride = DV;
  p.v_head_stride = p.o_head_stride = static_cast<int64_t>(len) * DV;
  p.v_batch_stride = p.o_batch_stride = static_cast<int64_t>(heads) * len * DV;
  p.batch = batch;
  p.heads_q = p.heads_kv = heads;
  p.len_q = p.len_k = len;
  p.head_dim = DK;
  p.head_dim_v = DV;
  p.window_left = -1;
  p.window_right = causal ? 0 : -1;
  p.scale = 1.0 / std::sqrt(128.0);
  p.scale_log2 = static_cast<float>(p.scale * 1.4426950408889634);
  const int grid = batch * heads * ((len + Traits::kBlockM - 1) / Traits::kBlockM);
  CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          Traits::kSmemBytes));
  cudaEvent_t start, stop;
  CK(cudaEventCreate(&start));
  CK(cudaEventCreate(&stop));
  std::vector<float> ms;
  for (int r = 0; r < 30; ++r) {
    CK(cudaEventRecord(start));
    kernel<<<grid, Traits::kThreads, Traits::kSmemBytes>>>(p);
    CK(cudaEventRecord(stop));
    CK(cudaEventSynchronize(stop));
    float t;
    CK(cudaEventElapsedTime(&t, start, stop));
    if (r >= 5) ms.push_back(t);
  }
  CK(cudaGetLastError());
  std::sort(ms.begin(), ms.end());
  std::vector<uint16_t> host(rows * DV);
  CK(cudaMemcpy(host.data(), o, host.size() * sizeof(uint16_t), cudaMemcpyDeviceToHost));
  double sum = 0, sumsq = 0;
  for (const uint16_t h : host) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    sum += f;
    sumsq += static_cast<double>(f) * f;
  }
  std::printf("DK=%3d DV=%3d B=%d H=%2d L=%d causal=%d: median %.4f ms (min %.4f), out sum %.6e "
              "sumsq %.8e\n",
              DK, DV, batch, heads, len, causal, ms[ms.size() / 2], ms[0], sum, sumsq);
  CK(cudaEventDestroy(start));
  CK(cudaEventDestroy(stop));
  CK(cudaFree(q));
  CK(cudaFree(k));
  CK(cudaFree(v));
  CK(cudaFree(o));
  CK(cudaFree(lse));
}

int main() {
  for (const bool causal : {false, true}) {
    time_forward<32, 128>(4, 16, 4096, causal);
    time_forward<128, 128>(4, 16, 4096, causal);
    time_forward<64, 64>(4, 32, 4096, causal);
  }
  return 0;
}
