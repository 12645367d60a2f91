// adaattn::build_info() -> str: how this op library was built, as "key: value" lines (read by
// adaattn.show_config). No tensor arguments, so one catch-all kernel serves every device.
#include <torch/library.h>

#include <string>

#include "../build_info.h"

namespace adaattn {
namespace {

std::string build_info() {
#ifdef ADAATTN_WITH_CUDA
  return cuda_build_info();
#else
  return "cuda: none (CPU-only build)\n";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(adaattn, m) { m.def("build_info() -> str", &build_info); }

}  // namespace adaattn
