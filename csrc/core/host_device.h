// ADAATTN_HD marks the core's shared helpers (masks, sequence lengths, variants, the linear and
// eigensolver math): host and device functions, inlined, under nvcc; plain inline functions in the
// CPU-only translation units.
#pragma once

#if defined(__CUDACC__)
#define ADAATTN_HD __host__ __device__ __forceinline__
#else
#define ADAATTN_HD inline
#endif
