// The variants each op family compiles, and the choice among them from an op's arguments. A
// new variant is a policy file (a score modifier or a transform, variant.h) plus a row here
// (and in csrc/cuda/tc/generate.py's VARIANTS for the tensor-core instantiations).
#pragma once

#include "composed.h"
#include "elastic.h"
#include "rel_bias.h"
#include "sinks.h"
#include "softcap.h"
#include "softmax.h"
#include "variant.h"

namespace adaattn {

using PlainVariant = Variant<NoScoreMod, SoftmaxTransform>;    // flash_attn and its relatives
using SoftcapVariant = Variant<SoftcapMod, SoftmaxTransform>;  // softcap > 0
using LazyVariant = Variant<RelBiasMod, ElasticTransform>;     // lazy_attn
// alibi_slopes, sinks or rel_bias (with or without softcap): one type for every combination,
// each member off when its argument is absent (composed.h, sinks.h).
using ComposedVariant = Variant<ComposedMod, SinkSoftmaxTransform>;

// Names of the compiled variants across the launcher API (attention_api.h).
enum class VariantId { kPlain, kSoftcap, kLazy, kComposed, kCount };

// The softmax-family variant that the score modifiers' arguments select (flash, varlen,
// block-sparse, low-rank). Plain and softcap-only calls keep their own instantiations, so
// they pay nothing for the composed modifier's runtime checks.
inline VariantId softmax_variant(double softcap, bool composed = false) {
  if (composed) return VariantId::kComposed;
  return softcap > 0.0 ? VariantId::kSoftcap : VariantId::kPlain;
}
inline VariantId softmax_variant(const AttnParams& p) {
  return softmax_variant(p.softcap,
                         p.alibi_slopes != nullptr || p.sinks != nullptr || p.bias != nullptr);
}

// Calls f(V{}) with the variant type of `id`.
template <typename F>
decltype(auto) with_variant(VariantId id, F&& f) {
  switch (id) {
    case VariantId::kSoftcap:
      return f(SoftcapVariant{});
    case VariantId::kLazy:
      return f(LazyVariant{});
    case VariantId::kComposed:
      return f(ComposedVariant{});
    case VariantId::kPlain:
    default:
      return f(PlainVariant{});
  }
}

}  // namespace adaattn
