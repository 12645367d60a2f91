// Tensor-core linear attention, bf16 forward (one file per dtype and pass for parallel builds).
#include "tc/linear_launch.h"

namespace adaattn {
namespace tc {
namespace lin {
template void run_linear<__nv_bfloat16, false>(const LinearParams& p);
}  // namespace lin
}  // namespace tc
}  // namespace adaattn
