// Helpers of the torch-free benchmark programs (fwd_sm90_standalone.cu, sym_eig_stages.cu): a
// checked CUDA call and standard normal inputs from a hash of the index, so that every launch
// configuration fills the same values.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CK(x)                                                                            \
  do {                                                                                   \
    const cudaError_t err_ = (x);                                                        \
    if (err_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(err_)); \
      std::exit(2);                                                                      \
    }                                                                                    \
  } while (0)

// Standard normal value number i of stream `seed` (splitmix64-style hash, Box-Muller).
__device__ inline float hash_normal(unsigned long long i, unsigned seed) {
  auto mix = [](unsigned long long x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    return x ^ (x >> 33);
  };
  const unsigned long long h = mix(i * 0x9e3779b97f4a7c15ull + seed);
  const float u1 = (static_cast<float>(h >> 40) + 1.f) * (1.f / 16777217.f);
  const float u2 = static_cast<float>((h >> 8) & 0xffffffu) * (1.f / 16777216.f);
  return sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
}

// x[i] = hash_normal(i, seed) for i < count, converted to T.
template <typename T>
__global__ void fill_normal(T* x, size_t count, unsigned seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count;
       i += size_t(gridDim.x) * blockDim.x) {
    x[i] = static_cast<T>(hash_normal(i, seed));
  }
}
