// LibTorch-only tests of adaattn::sym_eig (batched symmetric eigendecomposition) through the
// dispatcher: accuracy in float64 against the input, order and sign conventions, errors.
#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/torch.h>

// c10's glog shim defines a CHECK(cond) that aborts; Catch's CHECK must win.
#undef CHECK
#include <catch2/catch.hpp>

#include <tuple>

namespace {

using SymEigSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&);

c10::TypedOperatorHandle<SymEigSig> sym_eig_op() {
  return c10::Dispatcher::singleton().findSchemaOrThrow("adaattn::sym_eig", "").typed<SymEigSig>();
}

}  // namespace

TEST_CASE("sym_eig decomposes random symmetric float32 matrices", "[sym_eig]") {
  at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/true);
  at::globalContext().setDeterministicFillUninitializedMemory(true);
  torch::manual_seed(0);
  const double eps = std::numeric_limits<float>::epsilon();
  for (const int64_t dim : {1, 17, 64}) {
    const at::Tensor x = torch::randn({3, dim, dim}, torch::kDouble);
    const at::Tensor a = (x + x.transpose(-1, -2)).to(torch::kFloat);
    auto [w, v] = sym_eig_op().call(a);
    REQUIRE(w.sizes() == at::IntArrayRef({3, dim}));
    REQUIRE(v.sizes() == at::IntArrayRef({3, dim, dim}));
    const at::Tensor a64 = a.to(torch::kDouble), w64 = w.to(torch::kDouble);
    const at::Tensor v64 = v.to(torch::kDouble);
    const at::Tensor eye = torch::eye(dim, torch::kDouble);
    REQUIRE((torch::matmul(v64.transpose(-1, -2), v64) - eye).abs().max().item<double>() <=
            64 * eps);
    const double norm = torch::linalg_matrix_norm(a64).max().item<double>();
    const at::Tensor residual = torch::matmul(a64, v64) - v64 * w64.unsqueeze(-2);
    REQUIRE(residual.abs().max().item<double>() <= 1e-5 * norm);
    const at::Tensor ref = std::get<0>(torch::linalg_eigh(a64, "L")).flip(-1);
    REQUIRE((w64 - ref).abs().max().item<double>() <= 1e-5 * norm);
    if (dim > 1) {
      const int64_t d = dim;
      REQUIRE((w.narrow(-1, 0, d - 1) >= w.narrow(-1, 1, d - 1)).all().item<bool>());
    }
    const at::Tensor largest = v.gather(-2, v.abs().argmax(-2, /*keepdim=*/true));
    REQUIRE((largest > 0).all().item<bool>());
  }
}

TEST_CASE("sym_eig rejects inputs that are not float32 [N, D, D]", "[sym_eig]") {
  REQUIRE_THROWS_AS(sym_eig_op().call(torch::eye(3, torch::kDouble).unsqueeze(0)),
                    c10::TypeError);
  REQUIRE_THROWS_WITH(sym_eig_op().call(torch::eye(3, torch::kDouble).unsqueeze(0)),
                      Catch::StartsWith("adaattn.sym_eig: a must be float32"));
  REQUIRE_THROWS_AS(sym_eig_op().call(torch::zeros({2, 3, 4})), c10::ValueError);
  REQUIRE_THROWS_WITH(sym_eig_op().call(torch::zeros({2, 3, 4})),
                      Catch::StartsWith("adaattn.sym_eig: a must be square"));
}
