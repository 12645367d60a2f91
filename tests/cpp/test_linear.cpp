// LibTorch-only tests of adaattn::linear_attn: the op is reached through the dispatcher, trained
// through its C++ autograd Function (q, k, v and initial_state get gradients, from out and from
// the final state), and checked in float64 against a naive step-by-step implementation
// differentiated by autograd.
#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/torch.h>

// c10's glog shim defines a CHECK(cond) that aborts; Catch's CHECK must win.
#undef CHECK
#include <catch2/catch.hpp>

#include <optional>
#include <tuple>
#include <vector>

namespace {

using LinearAttnSig = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, c10::string_view, bool, bool);

c10::TypedOperatorHandle<LinearAttnSig> linear_attn_op() {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow("adaattn::linear_attn", "")
      .typed<LinearAttnSig>();
}

// Causal, normalised, elu + 1 (spec 3.5), one row at a time: S += phi(k_t)^T [v_t | 1],
// u_t = phi(q_t) S, o_t = u_t[:Dv] / u_t[Dv].
std::tuple<at::Tensor, at::Tensor> naive_linear(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v, const at::Tensor& s0) {
  const at::Tensor qf = torch::elu(q) + 1, kf = torch::elu(k) + 1;
  const at::Tensor va = torch::cat({v, torch::ones_like(v.narrow(-1, 0, 1))}, -1);
  at::Tensor state = s0;
  std::vector<at::Tensor> rows;
  for (int64_t t = 0; t < q.size(2); ++t) {
    state = state + kf.select(2, t).unsqueeze(-1) * va.select(2, t).unsqueeze(-2);
    const at::Tensor u = torch::matmul(qf.select(2, t).unsqueeze(-2), state).squeeze(-2);
    rows.push_back(u.narrow(-1, 0, v.size(-1)) / u.narrow(-1, v.size(-1), 1));
  }
  return {torch::stack(rows, 2), state};
}

}  // namespace

TEST_CASE("linear_attn float64 forward+backward of q, k, v, initial_state", "[linear]") {
  at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/true);
  at::globalContext().setDeterministicFillUninitializedMemory(true);
  torch::manual_seed(0);
  const auto opts = torch::TensorOptions().dtype(torch::kDouble);
  // T = 70 crosses the kernel's chunk boundary (64 rows).
  at::Tensor q = torch::randn({2, 3, 70, 8}, opts).requires_grad_();
  at::Tensor k = torch::randn({2, 3, 70, 8}, opts).requires_grad_();
  at::Tensor v = torch::randn({2, 3, 70, 5}, opts).requires_grad_();
  at::Tensor s0 = torch::rand({2, 3, 8, 6}, opts).requires_grad_();
  const at::Tensor dout = torch::randn({2, 3, 70, 5}, opts);
  const at::Tensor dstate = torch::randn({2, 3, 8, 6}, opts);

  auto [out, state] = linear_attn_op().call(q, k, v, s0, std::nullopt, "elu", true, true);
  const auto grads = torch::autograd::grad({out, state}, {q, k, v, s0}, {dout, dstate});
  auto [ref_out, ref_state] = naive_linear(q, k, v, s0);
  const auto ref_grads =
      torch::autograd::grad({ref_out, ref_state}, {q, k, v, s0}, {dout, dstate});

  REQUIRE(torch::allclose(out, ref_out, 1e-10, 1e-12));
  REQUIRE(torch::allclose(state, ref_state, 1e-10, 1e-12));
  for (size_t i = 0; i < grads.size(); ++i) {
    INFO("gradient " << i);
    REQUIRE(torch::allclose(grads[i], ref_grads[i], 1e-10, 1e-12));
  }
}
