#include "checks.h"

#include <cstdlib>
#include <cstring>

namespace adaattn {

void check_cu_seqlens_tensor(const at::Tensor& cu, const char* name, const at::Tensor& q) {
  TORCH_CHECK(cu.scalar_type() == at::kInt, "adaattn: ", name, " must be int32, got ",
              cu.scalar_type());
  TORCH_CHECK(cu.dim() == 1 && cu.size(0) >= 1, "adaattn: ", name,
              " must have shape [N + 1] (N >= 0 sequences), got ", cu.sizes());
  TORCH_CHECK(cu.is_contiguous(), "adaattn: ", name, " must be contiguous");
  TORCH_CHECK(cu.device() == q.device(), "adaattn: ", name, " must be on q's device ",
              q.device(), ", got ", cu.device());
}

void check_cu_seqlens_values(const at::Tensor& cu, const char* name, int64_t total,
                             const char* total_desc) {
  const char* env = std::getenv("ADAATTN_CHECK_INPUTS");
  const bool requested = env != nullptr && std::strcmp(env, "1") == 0;
  if (!cu.device().is_cpu() && !requested) return;
  const at::Tensor host = cu.device().is_cpu() ? cu : cu.cpu();
  const int* c = host.data_ptr<int>();
  const int64_t n = host.size(0);
  TORCH_CHECK(c[0] == 0, "adaattn: ", name, " must start at 0, got ", c[0]);
  for (int64_t i = 1; i < n; ++i) {
    TORCH_CHECK(c[i] >= c[i - 1], "adaattn: ", name, " must be non-decreasing, got ", c[i - 1],
                " then ", c[i], " at index ", i);
  }
  TORCH_CHECK(c[n - 1] == total, "adaattn: ", name, " must end at ", total_desc, total,
              ", got ", c[n - 1]);
}

}  // namespace adaattn
