#include "checks.h"

#include "../../core/env.h"

namespace adaattn {

bool check_values_of(const at::Tensor& t) {
  if (t.is_meta()) return false;
  return t.device().is_cpu() || env::check_inputs();
}

void check_cu_seqlens_tensor(const char* op, const at::Tensor& cu, const char* name,
                             const at::Tensor& q) {
  ADAATTN_CHECK_TYPE(cu.scalar_type() == at::kInt, name, " must be int32, got ",
                     cu.scalar_type());
  ADAATTN_CHECK_VALUE(cu.dim() == 1 && cu.size(0) >= 1, name,
                      " must have shape [N + 1] (N >= 0 sequences), got ", cu.sizes());
  ADAATTN_CHECK_VALUE(cu.is_contiguous(), name, " must be contiguous");
  ADAATTN_CHECK_DEVICE(cu.device() == q.device(), name, " must be on q's device ", q.device(),
                       ", got ", cu.device());
}

void check_cu_seqlens_values(const char* op, const at::Tensor& cu, const char* name,
                             int64_t total, const char* total_desc) {
  if (!check_values_of(cu)) return;
  const at::Tensor host = cu.cpu();
  const int* c = host.data_ptr<int>();
  const int64_t n = host.size(0);
  ADAATTN_CHECK_VALUE(c[0] == 0, name, " must start at 0, got ", c[0]);
  for (int64_t i = 1; i < n; ++i) {
    ADAATTN_CHECK_VALUE(c[i] >= c[i - 1], name, " must be non-decreasing, got ", c[i - 1],
                        " then ", c[i], " at index ", i);
  }
  ADAATTN_CHECK_VALUE(c[n - 1] == total, name, " must end at ", total_desc, total, ", got ",
                      c[n - 1]);
}

}  // namespace adaattn
