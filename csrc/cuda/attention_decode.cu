// The KV-cache decode launchers: the split-KV kernel (tc/decode.h) per compiled (variant, D, Dv,
// dtype, row warps), its split count, and the in-place append of the new keys and values.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "../attention_api.h"
#include "../core/seq.h"
#include "tc/decode_fp8.h"
#include "tc/pdl.h"
#include "tc/runtime.h"

namespace adaattn {
namespace {

// Rows of a CTA: group * Lq query rows; 16 go to one warp and the four warps split the keys,
// or 64 to four warps (row blocks past 64 rows re-read the cache).
int row_warps(int64_t rows) { return rows > 16 ? 4 : 1; }
int row_warps(const AttnParams& p) {
  return row_warps(static_cast<int64_t>(p.heads_q / p.heads_kv) * p.len_q);
}

// The tile configurations: 16 rows: four warps split each tile's keys; 64 rows: each warp owns
// 16 rows of the whole tile. Tiles of 64 keys in two stages, or three for the online pass (3-6%
// faster on a contiguous cache; paged, with a block-table lookup per tile, 1-5% faster at two
// CTAs per SM, H100); 4 stages, 8-warp CTAs, 32-key tiles and occupancy floors were slower on
// the decode shapes of bench_decode.py (H200, docs/lab/decode.md).
template <int D, int DV>
using NarrowCfg = tc::DecodeTraits<D, DV, 1, 4, 64, 2>;
// Keys narrower than the values (a low-rank key cache) run four CTAs per SM in two stages
// (their split count, decode_num_splits, counts on it): over the bf16 cache in CUDA graphs
// (H200, R = 32, B = 1 / 32 / 128) 1.46 / 1.50 / 1.47x, at three CTAs in three stages 1.44 /
// 1.51 / 1.42x (bytes per token: 1.6x).
template <int D, int DV>
using DeepNarrowCfg = tc::DecodeTraits<D, DV, 1, 4, 64, D < DV ? 2 : 3, D < DV ? 4 : 1>;
template <int D, int DV>
using WideCfg = tc::DecodeTraits<D, DV, 4, 1, 64, 2>;
// WideCfg's rows in one warpgroup whose products are wgmma (sm_90a): the mma.sync kernel's
// four warps each read all of a tile's K and V fragments from shared memory (ldmatrix), and
// with the exponentials and two CTAs per SM they issued at 41% with "wait" stalls first (ncu,
// H200, B = 128, Lk = 2k, Lq = 16: 1.51x the time of Lq = 1). With wgmma: flash Lq = 16
// 0.86-0.90x, the two-pass (not normalised) transform 0.72-0.81x that time
// (docs/lab/decode.md).
template <int D, int DV>
using WideWgmmaCfg = tc::DecodeTraits<D, DV, 4, 1, 64, 2, 1, 0, true>;

// The lse pass of NarrowCfg's rows: eight warps on tiles of 128 keys (16 each), in three K
// stages. It reads half the online pass's bytes per tile with almost all of its instructions;
// at NarrowCfg's four warps per CTA (two CTAs, eight warps per SM) its chains of dependent
// products and exponentials left DRAM at 60% of its peak (ncu, H200, B = 32, Lk = 8k; the
// online pass 89%): twice the warps hide them. Other configurations run it as they are.
template <typename Traits>
struct LsePassCfg {
  using type = Traits;
};
template <int D, int DV>
struct LsePassCfg<NarrowCfg<D, DV>> {
  using type = tc::DecodeTraits<D, DV, 1, 8, 128, 2, 1, 3 * 128 * D * 2>;
};

// The weight pass in the lse pass's kernel (decode_lse_weights_kernel, at one split): NarrowCfg's
// rows on all eight of the lse pass's warps and its 128-key tiles, in the stages that the lse
// pass's shared memory holds; void where the passes run apart. The two passes of a transform
// that is not normalised in one kernel against two (H200, GQA 32/8, D = 128, CUDA graphs; four
// warps then): B = 128 Lk = 2k 290 -> 282 us (paged 295 -> 287), B = 32 Lk = 8k 273 -> 268
// (paged 278 -> 271). Eight warps against four (three alternating rounds): B = 32 273.9 ->
// 269.8 (paged 276.2 -> 273.8), B = 128 286.3 -> 284.1 (292.3 -> 290.5); the weight pass apart
// (B = 1) was not faster with eight (154.2 -> 154.4), so it keeps NarrowCfg.
template <typename Traits>
struct FusedWeightsCfg {
  using type = void;
};
template <int D, int DV>
struct FusedWeightsCfg<NarrowCfg<D, DV>> {
  using Lse = typename LsePassCfg<NarrowCfg<D, DV>>::type;
  using type = tc::DecodeTraits<D, DV, 1, Lse::kKeyWarps, Lse::kBlockN, 2, 1, Lse::kStagesBytes>;
};

// An 8-bit cache is read by decode_fp8_kernel on DeepNarrowCfg's tiles (with_decode_kernel),
// whose scales are per page, read once per tile: pages must hold whole tiles, and its rows are
// one row warp's.
static_assert(DeepNarrowCfg<128, 128>::kBlockN == kDecodeFp8MinPage &&
                  DeepNarrowCfg<64, 64>::kBlockN == kDecodeFp8MinPage,
              "8-bit caches take pages of whole tiles");
static_assert(DeepNarrowCfg<128, 128>::kRows == kDecodeFp8MaxRows,
              "8-bit caches: rows of one row warp");

template <int N>
using Int = std::integral_constant<int, N>;

// The (D, Dv) pairs with a decode kernel: D = Dv in {64, 128} for every variant with one, and
// the narrow keys of a low-rank key cache (D in {32, 64}, Dv = 128) for plain flash attention.
bool decode_dims(bool plain, int d, int dv) {
  return (d == dv && (d == 64 || d == 128)) || (plain && dv == 128 && (d == 32 || d == 64));
}

// Calls f(T{}, Traits{}, Variant{}, Fp8{}) for the compiled decode kernel of the arguments
// (Fp8: std::bool_constant, an 8-bit paged cache); returns false when there is none. 8-bit
// caches have kernels for plain softmax attention at every (D, Dv) of decode_dims with one
// row warp (at most 16 rows per kv head: kDecodeFp8MaxRows).
template <typename F>
bool with_decode_kernel(VariantId variant, int d, int dv, c10::ScalarType dtype, int rw,
                        bool fp8, F&& f) {
  if (!decode_dims(variant == VariantId::kPlain, d, dv)) return false;
  if (dtype != c10::kBFloat16 && dtype != c10::kHalf) return false;
  if (fp8 && (variant != VariantId::kPlain || rw != 1)) return false;
  return with_variant(variant, [&](auto v) {
    using V = decltype(v);
    auto by_dtype = [&](auto t) {
      using T = decltype(t);
      auto by_dims = [&](auto dim, auto dim_v) {
        constexpr int D = decltype(dim)::value, DV = decltype(dim_v)::value;
        auto by_cfg = [&](auto cfg) {
          // The 8-bit kernel (its own stages) for the one configuration that reaches it.
          if constexpr (std::is_same_v<V, PlainVariant> &&
                        std::is_same_v<decltype(cfg), DeepNarrowCfg<D, DV>>) {
            if (fp8) return f(T{}, cfg, V{}, std::true_type{});
          }
          return f(T{}, cfg, V{}, std::false_type{});
        };
        if (rw == 1) {
          if constexpr (V::kNormalized) {
            return by_cfg(DeepNarrowCfg<D, DV>{});
          } else {
            return by_cfg(NarrowCfg<D, DV>{});
          }
        }
        if constexpr (tc::kBuiltSm90a && D == DV) {
          if (tc::use_sm90()) return by_cfg(WideWgmmaCfg<D, DV>{});
        }
        return by_cfg(WideCfg<D, DV>{});
      };
      if constexpr (std::is_same_v<V, PlainVariant>) {
        if (d == 32) return by_dims(Int<32>{}, Int<128>{});
        if (d == 64 && dv == 128) return by_dims(Int<64>{}, Int<128>{});
      }
      if (d == 64) return by_dims(Int<64>{}, Int<64>{});
      return by_dims(Int<128>{}, Int<128>{});
    };
    if (dtype == c10::kBFloat16) {
      by_dtype(__nv_bfloat16{});
    } else {
      by_dtype(__half{});
    }
    return true;
  });
}

// Dynamic shared memory beyond the default 48 KB, and the largest carveout so that several
// CTAs share an SM. Set once per kernel and device (the driver calls cost host time per step).
template <auto kernel>
void set_smem(int bytes) {
  static std::array<std::atomic<bool>, 64> done{};
  const int device = c10::cuda::current_device();
  if (device < static_cast<int>(done.size()) && done[device].load()) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                      cudaSharedmemCarveoutMaxShared));
  if (device < static_cast<int>(done.size())) done[device].store(true);
}

template <typename Traits>
int key_tiles(const AttnParams& p) {
  return std::max(1, (p.len_k + Traits::kBlockN - 1) / Traits::kBlockN);
}

// Threads of an append_kernel CTA, and the units each thread has in flight.
constexpr int kAppendThreads = 128;
constexpr int kAppendUnroll = 4;

// One CTA per (b, h): every new row of kv head h of entry b (p.k_new, p.v_new) into the cache,
// in units of E (16 bytes where the rows and strides allow, else one element), kAppendUnroll
// loads in flight a thread before their stores. Not one CTA per row: 16 new rows at B = 128,
// GQA 32/8 would be 16384 CTAs of one row each, bound by launch and latency.
template <typename E>
__global__ void __launch_bounds__(kAppendThreads) append_kernel(const AttnParams p,
                                                                 int elem_bytes) {
  const int b = blockIdx.x / p.heads_kv, h = blockIdx.x % p.heads_kv;
  const int cached = p.cache_seqlens[b];
  if (cached < 0) return;
  const int k_units = p.head_dim * elem_bytes / static_cast<int>(sizeof(E));
  const int row_units = k_units + p.head_dim_v * elem_bytes / static_cast<int>(sizeof(E));
  const int rows = min(p.len_q, p.len_k - cached);  // rows past the cache are dropped
  const int units = max(rows, 0) * row_units;
  auto bytes = [&](const void* base, int64_t elems) {
    return static_cast<const char*>(base) + elems * elem_bytes;
  };
  for (int u0 = threadIdx.x; u0 < units; u0 += kAppendUnroll * kAppendThreads) {
    E value[kAppendUnroll];
    E* dst[kAppendUnroll];
#pragma unroll
    for (int i = 0; i < kAppendUnroll; ++i) {
      const int u = u0 + i * kAppendThreads;
      dst[i] = nullptr;
      if (u >= units) continue;
      const int r = u / row_units, c = u % row_units, pos = cached + r;
      const int block = tc::cache_block(p, b, pos);
      const bool is_k = c < k_units;
      const int col = is_k ? c : c - k_units;
      const char* src =
          is_k ? bytes(p.k_new, b * p.k_new_batch_stride + h * p.k_new_head_stride +
                                    r * p.k_new_row_stride)
               : bytes(p.v_new, b * p.v_new_batch_stride + h * p.v_new_head_stride +
                                    r * p.v_new_row_stride);
      const char* to =
          is_k ? bytes(p.k, tc::cache_offset(p, block, p.k_batch_stride, p.k_head_stride,
                                             p.k_row_stride, h, pos))
               : bytes(p.v, tc::cache_offset(p, block, p.v_batch_stride, p.v_head_stride,
                                             p.v_row_stride, h, pos));
      value[i] = reinterpret_cast<const E*>(src)[col];
      dst[i] = reinterpret_cast<E*>(const_cast<char*>(to)) + col;
    }
#pragma unroll
    for (int i = 0; i < kAppendUnroll; ++i) {
      if (dst[i] != nullptr) *dst[i] = value[i];
    }
  }
}

}  // namespace

bool decode_tc_supported(VariantId variant, int head_dim, int head_dim_v, bool fp8_cache) {
  return with_decode_kernel(variant, head_dim, head_dim_v, c10::kBFloat16, 1, fp8_cache,
                            [](auto, auto, auto, auto) {});
}

bool decode_projects_query(int head_dim, int head_dim_v, int64_t rows, int64_t full_dim) {
  bool projects = false;
  with_decode_kernel(VariantId::kPlain, head_dim, head_dim_v, c10::kBFloat16, row_warps(rows), true,
                     [&](auto, auto traits, auto, auto fp8) {
    using Traits = decltype(traits);
    if constexpr (decltype(fp8)::value && Traits::kD < Traits::kDV) {
      projects = full_dim > 0 && full_dim % (8 * (Traits::kThreads / Traits::kD)) == 0;
    }
  });
  return projects;
}

// Splits that fill the last wave of CTAs (`slots` run at once): the fewest whose CTAs fill at
// least 95% of their last wave, looking up to two waves; 1 where one split already fills two.
static int wave_filling_splits(int64_t ctas, int64_t slots, int most) {
  if (ctas >= 2 * slots) return 1;
  int best = 1;
  double best_fill = 0.0;
  for (int s = 1; s <= most && ctas * s <= 2 * slots; ++s) {
    const int64_t waves = (ctas * s + slots - 1) / slots;
    const double fill = static_cast<double>(ctas * s) / static_cast<double>(waves * slots);
    if (fill >= 0.95) return s;
    if (fill > best_fill) best = s, best_fill = fill;
  }
  return best;
}

int decode_num_splits(VariantId variant, const AttnParams& p, c10::ScalarType dtype,
                      int64_t requested) {
  int splits = 1;
  with_decode_kernel(variant, p.head_dim, p.head_dim_v, dtype, row_warps(p),
                     p.k_cache_scale != nullptr, [&](auto, auto traits, auto, auto fp8) {
    using Traits = decltype(traits);
    const int tiles = key_tiles<Traits>(p);
    const int most = std::min(tiles, 128);
    if (requested > 0) {
      splits = static_cast<int>(std::min<int64_t>(requested, most));
      return;
    }
    // As many CTAs as stream the cache at full speed, each with as many key tiles as that leaves;
    // more splits only add partial writes and merging. Two CTAs per SM (B = 1, Lk = 128k, 8 kv
    // heads, contiguous cache, CUDA graphs: H200 33 splits 0.137 ms, 16 0.182, 49 0.178, 66
    // 0.155; H100 0.213 at two per SM against 0.206 at one; paged at one per SM: HBM 0.56),
    // four for keys narrower than the values (below). The 8-bit kernel's three CTAs per SM at
    // full width are a cap, not a target: at B = 1 (4 rows per kv head) 33 splits took 73 us,
    // 49 75 us, 66 99 us; at B = 32 and 128 one split beat 2-4 (H200, CUDA graphs).
    const int64_t rows = static_cast<int64_t>(p.heads_q / p.heads_kv) * p.len_q;
    const int64_t ctas = static_cast<int64_t>(p.batch) * p.heads_kv *
                         ((rows + Traits::kRows - 1) / Traits::kRows);
    const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    if constexpr (Traits::kD < Traits::kDV && Traits::kRowWarps == 1) {
      // Keys narrower than the values (a low-rank key cache), one row warp: the grid sized to
      // fill its last wave at the kernel's CTAs per SM (16 bits: kMinBlocks, four, at most 128
      // registers and 41-49 KB of shared memory in two stages; 8 bits: decode_fp8_ctas_per_sm).
      // H200, R = 32, Dv = 128, GQA 32/8, CUDA graphs, us; 16 bits: B = 32, Lk = 8k: 1 / 2 / 3
      // splits 171.0 / 162.2-163.2 / 179.7-180.0 (two stages need the fourth CTA: at three
      // CTAs in three stages one split took 161.7-162.5); B = 1, Lk = 128k: 33 / 48 / 63 / 66
      // splits 92.6-92.9 / 88.9-89.6 / 88.0-88.3 / 90.7-90.8; B = 128, Lk = 2k: 1 / 2 / 3
      // splits 167.8-168.4 / 182.0-182.9 / 187.3-187.4. 8 bits: B = 32 1 / 2 / 3 splits
      // 108.3-109.1 / 96.9-97.5 / 104.9-105.8; B = 1 33 / 49 / 66 / 99 61.5-61.7 / 56.2-56.4
      // / 56.8-57.0 / 66.6-67.4; B = 128 1 / 2 102.5-102.7 / 124.6-125.2.
      static_assert(Traits::kMinBlocks * (Traits::kSmemBytes + 1024) <= 228 * 1024,
                    "kMinBlocks CTAs per SM fit");
      int per_sm = Traits::kMinBlocks;
      if constexpr (decltype(fp8)::value) {
        per_sm = rows <= 8 ? tc::decode_fp8_ctas_per_sm<Traits, 1>()
                            : tc::decode_fp8_ctas_per_sm<Traits, 2>();
      }
      splits = wave_filling_splits(ctas, per_sm * sms, most);
      return;
    }
    splits = static_cast<int>(std::clamp<int64_t>(2 * sms / ctas, 1, most));
  });
  return splits;
}

int64_t decode_score_cache_stride(VariantId variant, const AttnParams& p,
                                  c10::ScalarType dtype) {
  int64_t stride = 0;
  with_decode_kernel(variant, p.head_dim, p.head_dim_v, dtype, row_warps(p),
                     p.k_cache_scale != nullptr, [&](auto, auto traits, auto v, auto) {
    using Traits = decltype(traits);
    if constexpr (!decltype(v)::kNormalized && Traits::kCanCacheScores) {
      const int64_t rows = static_cast<int64_t>(p.heads_q / p.heads_kv) * p.len_q;
      // Written and read once: 8 bytes per row and key, against a K row of 2 * D bytes.
      if (8 * rows < 2 * p.head_dim) {
        // Whole tiles of both passes (the lse pass writes its tiles' masked keys too).
        using Lse = typename LsePassCfg<Traits>::type;
        static_assert(Lse::kCanCacheScores && Lse::kBlockN % Traits::kBlockN == 0,
                      "the lse pass's tiles cover the weight pass's");
        stride = static_cast<int64_t>(key_tiles<Lse>(p)) * Lse::kBlockN;
      }
    }
  });
  return stride;
}

// Whether the combine kernels may overlap the decode kernel ahead of them (tc/pdl.h): the
// library's sm_90a code runs on this GPU.
static bool overlapping_launches() {
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  return tc::kBuiltSm90a && prop->major == 9 && prop->minor == 0;
}

// Whether the decode kernel writes p's appended rows itself (tc::kAppendChunkThreads): at most
// one 16-byte chunk of them a thread, 16-byte aligned. A separate append kernel ahead of the
// decode kernel cost 1.5-3.6 us a step in CUDA graphs (H200, Lq = 1), even overlapping it.
static bool decode_writes_appended_rows(const AttnParams& p) {
  const int64_t chunks = static_cast<int64_t>(p.len_q) * (p.head_dim + p.head_dim_v) / 8;
  auto aligned = [](const void* ptr, int64_t batch_stride, int64_t head_stride,
                    int64_t row_stride) {
    return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && batch_stride % 8 == 0 &&
           head_stride % 8 == 0 && row_stride % 8 == 0;
  };
  return chunks <= tc::kAppendChunkThreads && p.head_dim % 8 == 0 && p.head_dim_v % 8 == 0 &&
         aligned(p.k_new, p.k_new_batch_stride, p.k_new_head_stride, p.k_new_row_stride) &&
         aligned(p.v_new, p.v_new_batch_stride, p.v_new_head_stride, p.v_new_row_stride);
}

void attention_decode_tc_cuda(VariantId variant, const AttnParams& params, int num_splits,
                              float* o_part, float* lse_part, float* scores,
                              int64_t scores_stride, c10::ScalarType dtype) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AttnParams p = params;
  if (p.k_new != nullptr && !decode_writes_appended_rows(p)) {
    kvcache_append_cuda(p, dtype);
    p.k_new = p.v_new = nullptr;
  }
  // Every combine kernel starts while the decode kernel ahead of it runs, and waits for it
  // (H200, CUDA graphs: docs/lab/decode.md).
  const bool overlap = overlapping_launches();
  auto launch = [&](auto kernel, dim3 grid, int threads, int smem, bool overlaps,
                    const auto&... args) {
    C10_CUDA_CHECK(tc::launch_overlapping(kernel, grid, dim3(threads), smem, stream, overlaps,
                                          args...));
  };
  const bool found = with_decode_kernel(variant, p.head_dim, p.head_dim_v, dtype, row_warps(p),
                                        p.k_cache_scale != nullptr,
                                        [&](auto t, auto traits, auto v, auto fp8) {
    using T = decltype(t);
    constexpr bool kFp8 = decltype(fp8)::value;
    using Traits = decltype(traits);
    constexpr int DV = Traits::kDV;
    using V = decltype(v);
    const int64_t rows = static_cast<int64_t>(p.heads_q / p.heads_kv) * p.len_q;
    const int64_t all_rows = static_cast<int64_t>(p.batch) * p.heads_q * p.len_q;
    // One CTA per (sequence, kv head, row block, key split).
    const dim3 grid(static_cast<unsigned>(static_cast<int64_t>(p.batch) * p.heads_kv),
                    static_cast<unsigned>((rows + Traits::kRows - 1) / Traits::kRows),
                    static_cast<unsigned>(num_splits));
    if constexpr (kFp8) {
      static_assert(Traits::kRows == kDecodeFp8MaxRows, "one CTA takes every row");
      TORCH_CHECK(p.k_new == nullptr, "adaattn: the 8-bit decode kernel appends no rows");
      const tc::DecodeSplits sp{o_part, lse_part, num_splits,
                                (key_tiles<Traits>(p) + num_splits - 1) / num_splits, nullptr, 0};
      auto launch_fp8 = [&](auto row_tiles) {
        constexpr int kRowTiles = decltype(row_tiles)::value;
        constexpr auto kernel = tc::decode_fp8_kernel<T, Traits, kRowTiles>;
        constexpr int kSmem = tc::decode_fp8_smem_bytes<Traits, kRowTiles>();
        set_smem<kernel>(kSmem);
        launch(kernel, grid, Traits::kThreads, kSmem, false, p, sp);
      };
      if (rows <= 8) {
        launch_fp8(Int<1>{});
      } else {
        launch_fp8(Int<2>{});
      }
      if (num_splits > 1) {
        launch(tc::decode_combine_kernel<T, DV, tc::DecodePass::kOnline, typename V::Transform>,
               dim3(static_cast<unsigned>(all_rows)),
               tc::decode_combine_threads(DV, num_splits), 0, overlap, p, sp);
      }
      return;
    }
    auto run = [&](auto pass, auto scores_in) {
      constexpr tc::DecodePass kPass = decltype(pass)::value;
      using PassTraits = std::conditional_t<kPass == tc::DecodePass::kLse,
                                            typename LsePassCfg<Traits>::type, Traits>;
      static_assert(PassTraits::kRows == Traits::kRows, "the passes share their row blocks");
      const int tiles = key_tiles<PassTraits>(p);
      const tc::DecodeSplits sp{o_part, lse_part, num_splits,
                                (tiles + num_splits - 1) / num_splits, scores, scores_stride};
      constexpr bool kScoresIn = decltype(scores_in)::value;
      auto launch_pass = [&](auto key_major) {
        constexpr auto kernel =
            tc::decode_kernel<T, PassTraits, V, kPass, kScoresIn, decltype(key_major)::value>;
        constexpr int kSmem = tc::decode_smem_bytes<PassTraits, kPass, kScoresIn>();
        set_smem<kernel>(kSmem);
        launch(kernel, grid, PassTraits::kThreads, kSmem, false, p, sp);
      };
      if constexpr (tc::decode_has_key_major<PassTraits, V, kPass, kScoresIn>()) {
        if (rows <= tc::kKeyMajorMaxRows) {
          launch_pass(std::true_type{});
        } else {
          launch_pass(std::false_type{});
        }
      } else {
        launch_pass(std::false_type{});
      }
      if (num_splits > 1) {
        // The lse alone is one warp's work.
        launch(tc::decode_combine_kernel<T, DV, kPass, typename V::Transform>,
               dim3(static_cast<unsigned>(all_rows)),
               kPass == tc::DecodePass::kLse ? 32 : tc::decode_combine_threads(DV, num_splits), 0,
               overlap, p, sp);
      }
    };
    using Pass = tc::DecodePass;
    const std::false_type no_scores;
    if constexpr (V::kNormalized) {
      run(std::integral_constant<Pass, Pass::kOnline>{}, no_scores);
    } else {
      using Fused = typename FusedWeightsCfg<Traits>::type;
      if constexpr (!std::is_void_v<Fused>) {
        if (scores != nullptr && num_splits == 1) {
          using Lse = typename LsePassCfg<Traits>::type;
          const tc::DecodeSplits lse_sp{nullptr, nullptr, 1, key_tiles<Lse>(p), scores,
                                        scores_stride};
          const tc::DecodeSplits weight_sp{nullptr, nullptr, 1, key_tiles<Fused>(p), scores,
                                           scores_stride};
          auto launch_fused = [&](auto key_major) {
            constexpr auto kernel =
                tc::decode_lse_weights_kernel<T, Lse, Fused, V, decltype(key_major)::value>;
            constexpr int kSmem =
                std::max(tc::decode_smem_bytes<Lse, Pass::kLse, false>(),
                         tc::decode_smem_bytes<Fused, Pass::kWeights, true>());
            set_smem<kernel>(kSmem);
            launch(kernel, grid, Lse::kThreads, kSmem, false, p, lse_sp, weight_sp);
          };
          if constexpr (tc::decode_has_key_major<Lse, V, Pass::kLse, false>() &&
                        tc::decode_has_key_major<Fused, V, Pass::kWeights, true>()) {
            if (rows <= tc::kKeyMajorMaxRows) {
              launch_fused(std::true_type{});
              return;
            }
          }
          launch_fused(std::false_type{});
          return;
        }
      }
      // The weight pass reads the lse that the lse pass (and its merge) left in p.lse, and the
      // scores it cached where decode_score_cache_stride chose to.
      run(std::integral_constant<Pass, Pass::kLse>{}, no_scores);
      if constexpr (Traits::kCanCacheScores) {
        if (scores != nullptr) {
          run(std::integral_constant<Pass, Pass::kWeights>{}, std::true_type{});
          return;
        }
      }
      run(std::integral_constant<Pass, Pass::kWeights>{}, no_scores);
    }
  });
  TORCH_CHECK(found, "adaattn: no decode kernel for head dims (", p.head_dim, ", ",
              p.head_dim_v, ") and ", dtype);
}

void kvcache_append_cuda(const AttnParams& p, c10::ScalarType dtype) {
  if (static_cast<int64_t>(p.batch) * p.heads_kv * p.len_q == 0) return;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int elem = static_cast<int>(c10::elementSize(dtype));
  // 16-byte units where every row start (new rows and cache slots) is 16-byte aligned.
  auto aligned = [&](const void* ptr, std::initializer_list<int64_t> strides) {
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return false;
    for (int64_t s : strides) {
      if (s * elem % 16 != 0) return false;
    }
    return true;
  };
  const bool wide = p.head_dim * elem % 16 == 0 && p.head_dim_v * elem % 16 == 0 &&
                    aligned(p.k_new, {p.k_new_batch_stride, p.k_new_head_stride,
                                      p.k_new_row_stride}) &&
                    aligned(p.v_new, {p.v_new_batch_stride, p.v_new_head_stride,
                                      p.v_new_row_stride}) &&
                    aligned(p.k, {p.k_batch_stride, p.k_head_stride, p.k_row_stride}) &&
                    aligned(p.v, {p.v_batch_stride, p.v_head_stride, p.v_row_stride});
  const dim3 grid(static_cast<unsigned>(static_cast<int64_t>(p.batch) * p.heads_kv));
  if (wide) {
    append_kernel<uint4><<<grid, kAppendThreads, 0, stream>>>(p, elem);
  } else if (elem == 2) {
    append_kernel<uint16_t><<<grid, kAppendThreads, 0, stream>>>(p, elem);
  } else if (elem == 4) {
    append_kernel<uint32_t><<<grid, kAppendThreads, 0, stream>>>(p, elem);
  } else {
    append_kernel<uint64_t><<<grid, kAppendThreads, 0, stream>>>(p, elem);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace adaattn
