// The variants each op family compiles, and the choice among them from an op's arguments. A
// new variant is a policy file (a score modifier or a transform, variant.h) plus a row here
// (and in csrc/cuda/tc/generate.py's VARIANTS for the tensor-core instantiations).
#pragma once

#include "elastic.h"
#include "rel_bias.h"
#include "softcap.h"
#include "softmax.h"
#include "variant.h"

namespace adaattn {

using PlainVariant = Variant<NoScoreMod, SoftmaxTransform>;    // flash_attn and its relatives
using SoftcapVariant = Variant<SoftcapMod, SoftmaxTransform>;  // softcap > 0
using LazyVariant = Variant<RelBiasMod, ElasticTransform>;     // lazy_attn

// Names of the compiled variants across the launcher API (attention_api.h).
enum class VariantId { kPlain, kSoftcap, kLazy, kCount };

// The softmax-family variant that the score modifiers' arguments select (flash, varlen,
// block-sparse, low-rank).
inline VariantId softmax_variant(double softcap) {
  return softcap > 0.0 ? VariantId::kSoftcap : VariantId::kPlain;
}
inline VariantId softmax_variant(const AttnParams& p) { return softmax_variant(p.softcap); }

// Calls f(V{}) with the variant type of `id`.
template <typename F>
decltype(auto) with_variant(VariantId id, F&& f) {
  switch (id) {
    case VariantId::kSoftcap:
      return f(SoftcapVariant{});
    case VariantId::kLazy:
      return f(LazyVariant{});
    case VariantId::kPlain:
    default:
      return f(PlainVariant{});
  }
}

}  // namespace adaattn
