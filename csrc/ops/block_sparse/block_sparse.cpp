// Block-sparse attention: its schemas, validation of the BCSR mask, AttnParams
// construction, the CPU ops and the C++ autograd function registered at the Autograd key; the
// CUDA registration is block_sparse_cuda.cpp. The kernels are the flash family's: with
// AttnParams' block-sparse section set they visit only the listed blocks (core/block_sparse.h,
// cuda/tc/tiles.h).
#include <torch/autograd.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "../../attention_api.h"
#include "../common/attention_inputs.h"
#include "../common/autograd_util.h"
#include "../common/checks.h"
#include "block_sparse_ops.h"

namespace adaattn {

namespace {

// Every check of this family names the op the user calls.
constexpr const char* op = "block_sparse_attn";

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

void check_block_size(int64_t size, const char* name) {
  ADAATTN_CHECK_VALUE(size == 64 || size == 128, name, " must be 64 or 128, got ", size);
}

void check_index_tensor(const at::Tensor& t, const char* name, const at::Tensor& q) {
  ADAATTN_CHECK_TYPE(t.scalar_type() == at::kInt, name, " must be int32, got ", t.scalar_type());
  ADAATTN_CHECK_DEVICE(t.device() == q.device(), name, " must be on q's device ", q.device(),
                       ", got ", t.device());
}

// num [Bm, Hm, rows] and idx [Bm, Hm, rows, cols] with Bm in {1, B}, Hm in {1, Hq}.
void check_index_pair(const at::Tensor& num, const at::Tensor& idx, const char* num_name,
                      const char* idx_name, const at::Tensor& q, int64_t rows, int64_t cols,
                      const char* rows_text, const char* cols_text) {
  check_index_tensor(num, num_name, q);
  check_index_tensor(idx, idx_name, q);
  const int64_t batch = q.size(0), heads = q.size(1);
  ADAATTN_CHECK_VALUE(num.dim() == 3 && (num.size(0) == 1 || num.size(0) == batch) &&
                          (num.size(1) == 1 || num.size(1) == heads) && num.size(2) == rows,
                      num_name, " must have shape [B or 1, Hq or 1, ", rows_text, "] = [", batch,
                      " or 1, ", heads, " or 1, ", rows, "], got ", num.sizes());
  ADAATTN_CHECK_VALUE(idx.dim() == 4 && idx.size(0) == num.size(0) &&
                          idx.size(1) == num.size(1) && idx.size(2) == rows && idx.size(3) == cols,
                      idx_name, " must have shape [", num.size(0), ", ", num.size(1), ", ",
                      rows_text, ", ", cols_text, "] = [", num.size(0), ", ", num.size(1), ", ",
                      rows, ", ", cols, "] (", num_name, "'s leading dims), got ", idx.sizes());
}

// Checks one contiguous (num, idx) pair's values; marks the listed blocks in `listed`
// ([Bm * Hm, rows, cols] row-major) so that the two indices can be compared.
void check_list_values(const at::Tensor& num, const at::Tensor& idx, const char* num_name,
                       const char* idx_name, std::vector<uint8_t>& listed) {
  const int64_t slots = num.size(0) * num.size(1), rows = num.size(2), cols = idx.size(3);
  const int* n = num.data_ptr<int>();
  const int* x = idx.data_ptr<int>();
  listed.assign(static_cast<size_t>(slots * rows * cols), 0);
  for (int64_t s = 0; s < slots; ++s) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t list = s * rows + r;
      const int count = n[list];
      ADAATTN_CHECK_VALUE(count >= 0 && count <= cols, num_name, "[", s / num.size(1), ", ",
                          s % num.size(1), ", ", r, "] = ", count, " is out of range [0, ", cols,
                          "]");
      uint8_t* seen = listed.data() + list * cols;
      for (int e = 0; e < count; ++e) {
        const int block = x[list * cols + e];
        ADAATTN_CHECK_VALUE(block >= 0 && block < cols, idx_name, "[", s / num.size(1), ", ",
                            s % num.size(1), ", ", r, ", ", e, "] = ", block,
                            " is out of range [0, ", cols, ")");
        ADAATTN_CHECK_VALUE(!seen[block], idx_name, "[", s / num.size(1), ", ", s % num.size(1),
                            ", ", r, "] lists block ", block, " twice");
        seen[block] = 1;
      }
    }
  }
}

int64_t broadcast_stride(const at::Tensor& t, int64_t dim) {
  return t.size(dim) == 1 ? 0 : t.stride(dim);
}

}  // namespace

void check_block_sparse_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const BlockSparseMaskTensors& mask, int64_t block_m,
                               int64_t block_n) {
  check_flash_inputs(op, q, k, v, std::nullopt, std::nullopt, std::nullopt);
  check_block_size(block_m, "block_m");
  check_block_size(block_n, "block_n");
  const int64_t nq = ceil_div(q.size(2), block_m), nkv = ceil_div(k.size(2), block_n);
  check_index_pair(mask.kv_num_blocks, mask.kv_indices, "kv_num_blocks", "kv_indices", q, nq, nkv,
                   "nQ = ceil(Lq / block_m)", "nKV = ceil(Lk / block_n)");
  if (mask.q_num_blocks.defined()) {
    check_index_pair(mask.q_num_blocks, mask.q_indices, "q_num_blocks", "q_indices", q, nkv, nq,
                     "nKV = ceil(Lk / block_n)", "nQ = ceil(Lq / block_m)");
    ADAATTN_CHECK_VALUE(mask.q_num_blocks.size(0) == mask.kv_num_blocks.size(0) &&
                            mask.q_num_blocks.size(1) == mask.kv_num_blocks.size(1),
                        "q_num_blocks must have kv_num_blocks' leading dims [",
                        mask.kv_num_blocks.size(0), ", ", mask.kv_num_blocks.size(1), "], got ",
                        mask.q_num_blocks.sizes());
  }
}

void check_block_sparse_mask_values(const BlockSparseMaskTensors& given) {
  if (!check_values_of(given.kv_num_blocks)) return;
  auto host = [](const at::Tensor& t) { return t.defined() ? t.cpu().contiguous() : t; };
  const BlockSparseMaskTensors mask{host(given.kv_num_blocks), host(given.kv_indices),
                                    host(given.q_num_blocks), host(given.q_indices)};
  std::vector<uint8_t> forward, transposed;
  check_list_values(mask.kv_num_blocks, mask.kv_indices, "kv_num_blocks", "kv_indices", forward);
  if (!mask.q_num_blocks.defined()) return;
  check_list_values(mask.q_num_blocks, mask.q_indices, "q_num_blocks", "q_indices", transposed);
  const int64_t slots = mask.kv_num_blocks.size(0) * mask.kv_num_blocks.size(1);
  const int64_t nq = mask.kv_indices.size(2), nkv = mask.kv_indices.size(3);
  for (int64_t s = 0; s < slots; ++s) {
    for (int64_t mb = 0; mb < nq; ++mb) {
      for (int64_t nb = 0; nb < nkv; ++nb) {
        ADAATTN_CHECK_VALUE(
            forward[(s * nq + mb) * nkv + nb] == transposed[(s * nkv + nb) * nq + mb],
            "q_num_blocks/q_indices are not the transpose of kv_num_blocks/kv_indices: block "
            "(query ", mb, ", key ", nb, ") of mask slot [", s / mask.kv_num_blocks.size(1), ", ",
            s % mask.kv_num_blocks.size(1), "] is listed in only one of them; build the "
            "transposed index from the forward one (BlockSparseMask does)");
      }
    }
  }
}

BlockSparseMaskTensors contiguous_mask(const BlockSparseMaskTensors& mask) {
  auto c = [](const at::Tensor& t) { return t.defined() ? t.contiguous() : t; };
  return {c(mask.kv_num_blocks), c(mask.kv_indices), c(mask.q_num_blocks), c(mask.q_indices)};
}

BwdMode parse_bwd_mode(c10::string_view bwd_mode) {
  if (bwd_mode == "atomic") return BwdMode::kAtomic;
  if (bwd_mode == "two_pass") return BwdMode::kTwoPass;
  ADAATTN_CHECK_VALUE(false, "bwd_mode must be 'atomic' or 'two_pass', got '", bwd_mode, "'");
}

FlashOptions block_sparse_options(const at::Tensor& q, std::optional<double> softmax_scale,
                                  bool causal, BwdMode bwd_mode, double softcap) {
  return resolve_flash_options(op, q, softmax_scale, causal, /*window_left=*/-1,
                               /*window_right=*/-1, bwd_mode, softcap);
}

AttnParams make_block_sparse_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const BlockSparseMaskTensors& mask, int64_t block_m,
                                    int64_t block_n, const FlashOptions& opt) {
  AttnParams p = make_params(q, k, v, std::nullopt, std::nullopt, std::nullopt, opt);
  p.block_m = static_cast<int>(block_m);
  p.block_n = static_cast<int>(block_n);
  p.block_nq = static_cast<int>(mask.kv_indices.size(2));
  p.block_nkv = static_cast<int>(mask.kv_indices.size(3));
  p.block_kv_num = mask.kv_num_blocks.data_ptr<int>();
  p.block_kv_num_batch_stride = broadcast_stride(mask.kv_num_blocks, 0);
  p.block_kv_num_head_stride = broadcast_stride(mask.kv_num_blocks, 1);
  p.block_kv_idx = mask.kv_indices.data_ptr<int>();
  p.block_kv_idx_batch_stride = broadcast_stride(mask.kv_indices, 0);
  p.block_kv_idx_head_stride = broadcast_stride(mask.kv_indices, 1);
  if (mask.q_num_blocks.defined()) {
    p.block_q_num = mask.q_num_blocks.data_ptr<int>();
    p.block_q_num_batch_stride = broadcast_stride(mask.q_num_blocks, 0);
    p.block_q_num_head_stride = broadcast_stride(mask.q_num_blocks, 1);
    p.block_q_idx = mask.q_indices.data_ptr<int>();
    p.block_q_idx_batch_stride = broadcast_stride(mask.q_indices, 0);
    p.block_q_idx_head_stride = broadcast_stride(mask.q_indices, 1);
  }
  return p;
}

namespace {

std::tuple<at::Tensor, at::Tensor> block_sparse_fwd_cpu_op(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& kv_num_blocks, const at::Tensor& kv_indices, int64_t block_m,
    int64_t block_n, std::optional<double> softmax_scale, bool causal, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& rel_bias) {
  BlockSparseMaskTensors mask{kv_num_blocks, kv_indices, {}, {}};
  check_block_sparse_inputs(q_in, k_in, v_in, mask, block_m, block_n);
  const FlashOptions opt =
      block_sparse_options(q_in, softmax_scale, causal, BwdMode::kTwoPass, softcap);
  const ScoreTensors mods(op, q_in, q_in.size(0), alibi_slopes, sinks, rel_bias);
  mask = contiguous_mask(mask);
  check_block_sparse_mask_values(mask);
  const at::Tensor q = cpu_compute(q_in), k = cpu_compute(k_in), v = cpu_compute(v_in);
  at::Tensor out = at::empty(out_shape(q, v), q.options());
  at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  if (q.numel() > 0) {
    AttnParams p = make_block_sparse_params(q, k, v, mask, block_m, block_n, opt);
    mods.set(p);
    set_fwd_outputs(p, out, lse);
    // The kernel walks the block lists (core/block_sparse.h).
    attention_fwd_cpu(softmax_variant(opt, mods), p, q.scalar_type());
  }
  return {out.to(q_in.scalar_type()), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> block_sparse_bwd_cpu_op(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
    const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& lse,
    const at::Tensor& kv_num_blocks, const at::Tensor& kv_indices,
    const at::Tensor& q_num_blocks, const at::Tensor& q_indices, int64_t block_m,
    int64_t block_n, std::optional<double> softmax_scale, bool causal,
    c10::string_view bwd_mode, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& rel_bias,
    bool param_grads) {
  BlockSparseMaskTensors mask{kv_num_blocks, kv_indices, q_num_blocks, q_indices};
  check_block_sparse_inputs(q_in, k_in, v_in, mask, block_m, block_n);
  // The CPU kernels are deterministic in either mode.
  const FlashOptions opt = block_sparse_options(q_in, softmax_scale, causal,
                                                parse_bwd_mode(bwd_mode), softcap);
  check_flash_bwd_inputs(op, dout_in, q_in, v_in, out_in, lse, /*packed=*/false);
  const ScoreTensors mods(op, q_in, q_in.size(0), alibi_slopes, sinks, rel_bias);
  at::Tensor dsinks = mods.grad_like(mods.sinks, param_grads, q_in);
  at::Tensor drel_bias = mods.grad_like(mods.rel_bias, param_grads, q_in);
  mask = contiguous_mask(mask);
  check_block_sparse_mask_values(mask);
  const at::Tensor q = cpu_compute(q_in), k = cpu_compute(k_in), v = cpu_compute(v_in);
  const at::Tensor out = cpu_compute(out_in), dout = cpu_compute(dout_in);
  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v.sizes(), v.options());
  if (q.numel() > 0 && k.numel() > 0) {
    AttnParams p = make_block_sparse_params(q, k, v, mask, block_m, block_n, opt);
    // The CPU kernel keeps its row statistics in T and reads neither p.lse nor p.delta: an empty
    // tensor stands in for the delta scratch.
    at::Tensor no_scratch = at::empty({0}, lse.options());
    mods.set(p, &dsinks, &drel_bias);
    set_bwd_tensors(p, dout, out, lse, dq, dk, dv, no_scratch);
    attention_bwd_cpu(softmax_variant(opt, mods), p, q.scalar_type());
  } else {
    dq.zero_();
    dk.zero_();
    dv.zero_();
  }
  const auto t = q_in.scalar_type();
  return {dq.to(t), dk.to(t), dv.to(t), dsinks, drel_bias};
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = std::optional<at::Tensor>;

using BlockSparseFwdSig = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    int64_t, int64_t, std::optional<double>, bool, double, const OptTensor&, const OptTensor&,
    const OptTensor&);
using BlockSparseBwdSig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    int64_t, int64_t, std::optional<double>, bool, c10::string_view, double, const OptTensor&,
    const OptTensor&, const OptTensor&, bool);

c10::TypedOperatorHandle<BlockSparseFwdSig> block_sparse_fwd_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("adaattn::block_sparse_fwd", "")
                       .typed<BlockSparseFwdSig>();
  return op;
}

// Forward: block_sparse_fwd below autograd; backward: block_sparse_bwd with both indices. lse is
// returned but not differentiable; the mask tensors get no gradient.
class BlockSparseAttnFunction : public torch::autograd::Function<BlockSparseAttnFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const at::Tensor& kv_num_blocks,
                               const at::Tensor& kv_indices, const at::Tensor& q_num_blocks,
                               const at::Tensor& q_indices, int64_t block_m, int64_t block_n,
                               std::optional<double> softmax_scale, bool causal,
                               c10::string_view bwd_mode, double softcap,
                               const OptTensor& alibi_slopes, const OptTensor& sinks,
                               const OptTensor& rel_bias) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, lse] = block_sparse_fwd_op().call(q, k, v, kv_num_blocks, kv_indices, block_m,
                                                 block_n, softmax_scale, causal, softcap,
                                                 alibi_slopes, sinks, rel_bias);
    ctx->save_for_backward({q, k, v, out, lse, kv_num_blocks, kv_indices, q_num_blocks,
                            q_indices, alibi_slopes.value_or(at::Tensor()),
                            sinks.value_or(at::Tensor()), rel_bias.value_or(at::Tensor())});
    ctx->saved_data["block_m"] = block_m;
    ctx->saved_data["block_n"] = block_n;
    save_scale(ctx, softmax_scale);
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["bwd_mode"] = std::string(bwd_mode);
    ctx->saved_data["softcap"] = softcap;
    // Whether the backward computes the sinks / rel_bias gradients.
    ctx->saved_data["param_grads"] = (sinks.has_value() && sinks->requires_grad()) ||
                                     (rel_bias.has_value() && rel_bias->requires_grad());
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const at::Tensor& out = s[3];
    const std::optional<double> scale = saved_scale(ctx);
    const at::Tensor dout = output_grad(grads[0], out);
    static auto bwd = c10::Dispatcher::singleton()
                          .findSchemaOrThrow("adaattn::block_sparse_bwd", "")
                          .typed<BlockSparseBwdSig>();
    const bool param_grads = ctx->saved_data["param_grads"].toBool();
    auto [dq, dk, dv, dsinks, drel_bias] = bwd.call(
        dout, s[0], s[1], s[2], out, s[4], s[5], s[6], s[7], s[8],
        ctx->saved_data["block_m"].toInt(), ctx->saved_data["block_n"].toInt(), scale,
        ctx->saved_data["causal"].toBool(), ctx->saved_data["bwd_mode"].toStringRef(),
        ctx->saved_data["softcap"].toDouble(), saved_optional(s[9]), saved_optional(s[10]),
        saved_optional(s[11]), param_grads);
    return {dq,           dk,           dv,           at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            param_grads && s[10].defined() ? dsinks : at::Tensor(),
            param_grads && s[11].defined() ? drel_bias : at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> block_sparse_attn_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& kv_num_blocks, const at::Tensor& kv_indices,
    const at::Tensor& q_num_blocks, const at::Tensor& q_indices, int64_t block_m,
    int64_t block_n, std::optional<double> softmax_scale, bool causal,
    c10::string_view bwd_mode, double softcap, const OptTensor& alibi_slopes,
    const OptTensor& sinks, const OptTensor& rel_bias) {
  // Shapes of the transposed index and bwd_mode are checked now, not first in backward.
  check_block_sparse_inputs(q, k, v, {kv_num_blocks, kv_indices, q_num_blocks, q_indices},
                            block_m, block_n);
  parse_bwd_mode(bwd_mode);
  auto res = BlockSparseAttnFunction::apply(q, k, v, kv_num_blocks, kv_indices, q_num_blocks,
                                            q_indices, block_m, block_n, softmax_scale, causal,
                                            bwd_mode, softcap, alibi_slopes, sinks, rel_bias);
  return {res[0], res[1]};
}

// Below autograd (inference mode, or backends reached past the Autograd key): the transposed
// index and bwd_mode are not needed, but they are checked as on the autograd path.
std::tuple<at::Tensor, at::Tensor> block_sparse_attn_no_grad(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& kv_num_blocks, const at::Tensor& kv_indices,
    const at::Tensor& q_num_blocks, const at::Tensor& q_indices, int64_t block_m,
    int64_t block_n, std::optional<double> softmax_scale, bool causal,
    c10::string_view bwd_mode, double softcap, const OptTensor& alibi_slopes,
    const OptTensor& sinks, const OptTensor& rel_bias) {
  check_block_sparse_inputs(q, k, v, {kv_num_blocks, kv_indices, q_num_blocks, q_indices},
                            block_m, block_n);
  parse_bwd_mode(bwd_mode);
  return block_sparse_fwd_op().call(q, k, v, kv_num_blocks, kv_indices, block_m, block_n,
                                    softmax_scale, causal, softcap, alibi_slopes, sinks,
                                    rel_bias);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(adaattn, m) {
  m.def(
      "block_sparse_attn(Tensor q, Tensor k, Tensor v, Tensor kv_num_blocks, Tensor kv_indices, "
      "Tensor q_num_blocks, Tensor q_indices, int block_m=128, int block_n=128, "
      "float? softmax_scale=None, bool causal=False, str bwd_mode=\"atomic\", "
      "float softcap=0.0, Tensor? alibi_slopes=None, Tensor? sinks=None, Tensor? rel_bias=None) "
      "-> (Tensor out, Tensor lse)");
  m.def(
      "block_sparse_fwd(Tensor q, Tensor k, Tensor v, Tensor kv_num_blocks, Tensor kv_indices, "
      "int block_m, int block_n, float? softmax_scale, bool causal, float softcap=0.0, "
      "Tensor? alibi_slopes=None, Tensor? sinks=None, Tensor? rel_bias=None) -> "
      "(Tensor out, Tensor lse)");
  m.def(
      "block_sparse_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor kv_num_blocks, Tensor kv_indices, Tensor q_num_blocks, Tensor q_indices, "
      "int block_m, int block_n, float? softmax_scale, bool causal, str bwd_mode=\"atomic\", "
      "float softcap=0.0, Tensor? alibi_slopes=None, Tensor? sinks=None, Tensor? rel_bias=None, "
      "bool param_grads=False) -> (Tensor grad_q, Tensor grad_k, Tensor grad_v, "
      "Tensor grad_sinks, Tensor grad_rel_bias)");
}

TORCH_LIBRARY_IMPL(adaattn, CPU, m) {
  m.impl("block_sparse_fwd", &block_sparse_fwd_cpu_op);
  m.impl("block_sparse_bwd", &block_sparse_bwd_cpu_op);
}

TORCH_LIBRARY_IMPL(adaattn, Autograd, m) {
  m.impl("block_sparse_attn", &block_sparse_attn_autograd);
}

TORCH_LIBRARY_IMPL(adaattn, CompositeExplicitAutograd, m) {
  m.impl("block_sparse_attn", &block_sparse_attn_no_grad);
}

}  // namespace adaattn
