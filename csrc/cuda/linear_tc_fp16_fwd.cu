// Tensor-core linear attention, fp16 forward (one file per dtype and pass for parallel builds).
#include "tc/linear_launch.h"

namespace adaattn {
namespace tc {
namespace lin {
template void run_linear<__half, false>(const LinearParams& p);
}  // namespace lin
}  // namespace tc
}  // namespace adaattn
