// The CUDA half of adaattn::build_info, compiled by nvcc so that it sees the architectures of
// this build (__CUDA_ARCH_LIST__) and the generated table of tensor-core instantiations.
#include <cuda_runtime_api.h>

#include <initializer_list>
#include <string>

#include "../attention_api.h"
#include "../build_info.h"

namespace adaattn {
namespace {

struct TcEntry {
  VariantId variant;
  int head_dim;
  int head_dim_v;
};

#define ADAATTN_TC_KERNEL(ID, VARIANT, DK, DV) {VariantId::ID, DK, DV},
const TcEntry kTcEntries[] = {
#include "tc/inst/table.inc"
};
#undef ADAATTN_TC_KERNEL

// The variants by the Python calls that select them.
constexpr const char* kVariantNames[] = {"flash", "softcap", "lazy", "alibi/sinks/rel_bias"};
static_assert(sizeof(kVariantNames) / sizeof(kVariantNames[0]) ==
              static_cast<size_t>(VariantId::kCount));

std::string archs() {
  // __CUDA_ARCH_LIST__: nvcc's list of the virtual architectures of the -gencode flags (800,
  // 900, ...); the "a" (arch-specific) suffix is not in it, so it comes from ADAATTN_SM90A.
  std::string text;
  for (const int arch : {__CUDA_ARCH_LIST__}) {
    text += (text.empty() ? "sm_" : ", sm_") + std::to_string(arch / 10);
#ifdef ADAATTN_SM90A
    if (arch == 900) text += "a";
#endif
  }
  return text;
}

std::string tc_pairs() {
  std::string text;
  for (int v = 0; v < static_cast<int>(VariantId::kCount); ++v) {
    std::string pairs;
    for (const TcEntry& e : kTcEntries) {
      if (static_cast<int>(e.variant) != v) continue;
      pairs += (pairs.empty() ? "(" : ", (") + std::to_string(e.head_dim) + ", " +
               std::to_string(e.head_dim_v) + ")";
    }
    if (pairs.empty()) continue;
    text += (text.empty() ? "" : "; ") + std::string(kVariantNames[v]) + " " + pairs;
  }
  return text;
}

// Head dims D = Dv of the plain decode kernel, on a 16-bit or an 8-bit (fp8_cache) cache.
std::string decode_dims(bool fp8_cache) {
  std::string text;
  for (const TcEntry& e : kTcEntries) {
    if (e.variant != VariantId::kPlain || e.head_dim != e.head_dim_v ||
        !decode_tc_supported(e.variant, e.head_dim, e.head_dim_v, fp8_cache)) {
      continue;
    }
    text += (text.empty() ? "" : ", ") + std::to_string(e.head_dim);
  }
  return text;
}

}  // namespace

std::string cuda_build_info() {
  return "cuda: " + std::to_string(CUDART_VERSION / 1000) + "." +
         std::to_string(CUDART_VERSION % 1000 / 10) + "\narchs: " + archs() +
         "\ntensor_core_head_dims: " + tc_pairs() + "\ndecode_head_dims: " + decode_dims(false) +
         "\ndecode_fp8_cache_head_dims: " + decode_dims(true) + "\n";
}

}  // namespace adaattn
