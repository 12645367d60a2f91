// What this op library was compiled with, for adaattn::build_info (adaattn.show_config).
#pragma once

#include <string>

namespace adaattn {

#ifdef ADAATTN_WITH_CUDA
// "key: value" lines of the CUDA build (csrc/cuda/build_info.cu): the CUDA runtime version,
// the compiled architectures, the tensor-core (D, Dv) pairs per variant (tc/inst/table.inc)
// and the head dims of the split-KV decode kernel (on 16-bit and on 8-bit caches).
std::string cuda_build_info();
#endif

}  // namespace adaattn
