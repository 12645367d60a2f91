// The environment knobs of the library, read in one place. Each is read at every call, so a
// test or an A/B run can flip it between calls.
//   ADAATTN_DISABLE_SM90=1     run the SM80 tensor-core kernels on Hopper too (A/B runs, testing
//                              both paths on one GPU)
//   ADAATTN_BWD_TWO_PASS=1|0   force / forbid the Hopper two-pass backward (A/B runs)
//   ADAATTN_CHECK_INPUTS=1     validate cu_seqlens values on CUDA too (costs a device sync)
//   ADAATTN_HEAD_MAJOR=1       head-major CTA order for every tensor-core launch (A/B runs)
//   ADAATTN_FWD_TMA=0          cp.async loads instead of TMA in the Hopper forward (A/B runs)
#pragma once

#include <cstdlib>

namespace adaattn {
namespace env {

// -1 when `name` is unset or empty, else whether it starts with '1'.
inline int flag(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || value[0] == '\0') return -1;
  return value[0] == '1' ? 1 : 0;
}

inline bool disable_sm90() { return flag("ADAATTN_DISABLE_SM90") == 1; }
inline int bwd_two_pass() { return flag("ADAATTN_BWD_TWO_PASS"); }
inline bool check_inputs() { return flag("ADAATTN_CHECK_INPUTS") == 1; }
inline bool head_major() { return flag("ADAATTN_HEAD_MAJOR") == 1; }
inline bool fwd_tma() { return flag("ADAATTN_FWD_TMA") != 0; }

}  // namespace env
}  // namespace adaattn
